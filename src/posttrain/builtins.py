"""The built-in components: one explicit table, name -> config class and the component's place.

Each component is registered by its place (``"package.module:attribute"``) and imported the first time it is
used, so that ``validate``, ``schema`` and ``init``, which need only the config classes (all torch-free, under
``posttrain.config``), answer without importing torch, transformers or DeepSpeed. A trainer's spec is plain
data here; its loss, collator and prepare step are places too.
"""

from __future__ import annotations

from posttrain.config.checkpoint import DeepSpeedCheckpointConfig, HFCheckpointConfig
from posttrain.config.data import (
    CausalDataConfig,
    HFSourceConfig,
    LocalSourceConfig,
    MegatronSourceConfig,
    SFTDataConfig,
)
from posttrain.config.distill import DistillTrainerConfig
from posttrain.config.dpo import DPODataConfig, DPOTrainerConfig
from posttrain.config.grpo import GRPOTrainerConfig
from posttrain.config.kto import KTODataConfig, KTOTrainerConfig
from posttrain.config.model import ModelConfig
from posttrain.config.online import OnlineTrainerConfig
from posttrain.config.optimizer import OptimizerConfig
from posttrain.config.prompts import PromptsDataConfig
from posttrain.config.reward import RewardDataConfig, RewardTrainerConfig
from posttrain.config.scheduler import HFSchedulerConfig, MegatronSchedulerConfig
from posttrain.config.tokenizer import TokenizerConfig
from posttrain.config.trainer import TrainerConfig
from posttrain.registry import (
    CHECKPOINT_ENGINES,
    DATA_FACTORIES,
    DATA_SOURCES,
    GENERATION_ENGINES,
    MODEL_FACTORIES,
    MODEL_TRANSFORMS,
    OPTIMIZERS,
    SCHEDULERS,
    STEP_EXTRAS,
    TOKENIZER_FACTORIES,
    TRAINERS,
    TrainerSpec,
    hf_components,
)

_TOKEN_LOSS = "posttrain.methods.sft:make_token_loss"

TRAINER_SPECS = (
    (
        TrainerSpec(
            name="sft",
            accepts=hf_components("sft"),
            loss=_TOKEN_LOSS,
            description="supervised fine-tuning on chat data",
        ),
        TrainerConfig,
    ),
    (
        TrainerSpec(
            name="causal",
            accepts=hf_components("causal"),
            loss=_TOKEN_LOSS,
            description="(continued) pretraining on raw text",
        ),
        TrainerConfig,
    ),
    (
        TrainerSpec(
            name="dpo",
            accepts=hf_components("dpo"),
            loss="posttrain.methods.dpo:make_dpo_loss",
            collator="posttrain.data.dpo:PairCollator",
            prepare="posttrain.methods.dpo:prepare_reference",
            description="DPO-family preference tuning",
            steps="posttrain.methods.dpo:pair_steps",
            perplexity=False,
            rows_per_sample=2,  # chosen and rejected in one forward
        ),
        DPOTrainerConfig,
    ),
    (
        TrainerSpec(
            name="kto",
            accepts=hf_components("kto"),
            loss="posttrain.methods.kto:make_kto_loss",
            collator="posttrain.data.kto:KTOCollator",
            prepare="posttrain.methods.kto:prepare_reference",
            description="KTO from completions labelled desirable or undesirable",
            perplexity=False,
            rows_per_sample=2,  # a pair's two completions (one for unpaired rows), and the KL sequence apart
            steps="posttrain.methods.kto:kl_steps",
        ),
        KTOTrainerConfig,
    ),
    (
        TrainerSpec(
            name="reward",
            accepts={**hf_components("reward"), "model": ("sequence-classification",)},
            loss="posttrain.methods.reward:make_reward_loss",
            collator="posttrain.data.dpo:PairCollator",
            prepare="posttrain.methods.reward:prepare_head",
            description="reward models: a scalar head trained on preference pairs (Bradley-Terry)",
            perplexity=False,
            rows_per_sample=2,
        ),
        RewardTrainerConfig,
    ),
    (
        TrainerSpec(
            name="grpo",
            accepts=hf_components("prompts"),
            loss="posttrain.methods.grpo:make_grpo_loss",
            collator="posttrain.data.prompts:PromptCollator",
            description="online RL from rewards: GRPO, DAPO, Dr. GRPO, RLOO, GSPO",
            perplexity=False,
            steps="posttrain.methods.grpo:grpo_steps",
            schedule="posttrain.methods.grpo:grpo_schedule",
            memory="posttrain.methods.grpo:grpo_memory",
            report="posttrain.methods.grpo:grpo_report",
        ),
        GRPOTrainerConfig,
    ),
    (
        TrainerSpec(
            name="distill",
            accepts=hf_components("prompts"),
            loss="posttrain.methods.distill:make_distill_loss",
            collator="posttrain.data.prompts:PromptCollator",
            description="on-policy distillation: the student samples, the teacher scores every token (TRL's DistillationTrainer)",
            perplexity=False,
            steps="posttrain.methods.distill:distill_steps",
            schedule="posttrain.methods.distill:distill_schedule",
            memory="posttrain.methods.distill:distill_memory",
            report="posttrain.methods.distill:distill_report",
        ),
        DistillTrainerConfig,
    ),
)

#: registry -> (name, place, config class)
COMPONENTS = (
    (MODEL_FACTORIES, "huggingface", "posttrain.models.huggingface:FACTORY", ModelConfig),
    (MODEL_FACTORIES, "liger", "posttrain.models.liger:FACTORY", ModelConfig),
    (MODEL_FACTORIES, "sequence-classification", "posttrain.models.reward_model:FACTORY", ModelConfig),
    (
        TOKENIZER_FACTORIES,
        "huggingface",
        "posttrain.tokenizers.huggingface:build_huggingface_tokenizer",
        TokenizerConfig,
    ),
    (DATA_SOURCES, "local", "posttrain.data.sources:load_local", LocalSourceConfig),
    (DATA_SOURCES, "huggingface", "posttrain.data.sources:load_huggingface", HFSourceConfig),
    (DATA_SOURCES, "megatron", "posttrain.data.megatron:load_megatron", MegatronSourceConfig),
    (DATA_FACTORIES, "sft", "posttrain.methods.sft:DATA", SFTDataConfig),
    (DATA_FACTORIES, "causal", "posttrain.methods.causal:DATA", CausalDataConfig),
    (DATA_FACTORIES, "dpo", "posttrain.methods.dpo:DATA", DPODataConfig),
    (DATA_FACTORIES, "prompts", "posttrain.methods.prompts:DATA", PromptsDataConfig),
    (DATA_FACTORIES, "kto", "posttrain.methods.kto:DATA", KTODataConfig),
    (DATA_FACTORIES, "reward", "posttrain.methods.reward:DATA", RewardDataConfig),
    (OPTIMIZERS, "adamw", "posttrain.optim.adamw:build_adamw", OptimizerConfig),
    (OPTIMIZERS, "cpu_adam", "posttrain.optim.deepspeed_adam:build_cpu_adam", OptimizerConfig),
    (OPTIMIZERS, "fused_adam", "posttrain.optim.deepspeed_adam:build_fused_adam", OptimizerConfig),
    # ArcticTraining's name for fused_adam with expert parameter groups, which every optimizer here has
    (OPTIMIZERS, "fused_adam_moe", "posttrain.optim.deepspeed_adam:build_fused_adam", OptimizerConfig),
    (SCHEDULERS, "huggingface", "posttrain.optim.schedulers:build_huggingface_scheduler", HFSchedulerConfig),
    (SCHEDULERS, "megatron", "posttrain.optim.megatron:build_megatron_scheduler", MegatronSchedulerConfig),
    (
        CHECKPOINT_ENGINES,
        "huggingface",
        "posttrain.checkpoint.huggingface:HFCheckpointEngine",
        HFCheckpointConfig,
    ),
    (
        CHECKPOINT_ENGINES,
        "deepspeed",
        "posttrain.checkpoint.deepspeed:DeepSpeedCheckpointEngine",
        DeepSpeedCheckpointConfig,
    ),
    # an online run's generation engines (``generation_engine``; default from use_vllm and vllm_mode)
    (
        GENERATION_ENGINES,
        "transformers",
        "posttrain.generation.transformers_engine:transformers_engine",
        OnlineTrainerConfig,
    ),
    (GENERATION_ENGINES, "vllm", "posttrain.generation.vllm_engine:colocated_engine", OnlineTrainerConfig),
    (
        GENERATION_ENGINES,
        "vllm-server",
        "posttrain.generation.vllm_server:server_engine",
        OnlineTrainerConfig,
    ),
)


#: the model stage's transforms, in the order they apply (``stages.model.prepare_model``): a vision-language
#: model's frozen parts first (adapters then freeze the rest); checkpointing before
#: adapters wrap the model; embeddings grown once adapters exist; linear layers to float8 beside the adapters;
#: kernels swapped on the final modules; experts sharded and attention routed before compiling, which captures the blocks as they will run
MODEL_TRANSFORMS_IN_ORDER = (
    ("vision-freeze", "posttrain.vision.freeze:freeze_transform"),
    ("activation-checkpointing", "posttrain.models.memory:checkpointing_transform"),
    ("peft", "posttrain.models.peft:peft_transform"),
    ("fit-embeddings", "posttrain.models.embeddings:fit_embeddings_transform"),
    ("fp8", "posttrain.models.fp8:fp8_transform"),
    ("tiled-mlp", "posttrain.models.memory:tiled_mlp_transform"),
    ("document-attention", "posttrain.models.document_attention:document_attention_transform"),
    ("expert-parallel", "posttrain.models.expert_parallel:expert_parallel_transform"),
    ("sequence-parallel", "posttrain.models.sequence_parallel:sequence_parallel_transform"),
    ("compile", "posttrain.models.compile:compile_transform"),
)
#: what model features add to each training step
STEP_EXTRAS_IN_ORDER = (("moe-router", "posttrain.models.moe:router_extra"),)


def register_builtins() -> None:
    for spec, config in TRAINER_SPECS:
        TRAINERS.add(spec.name, spec, config=config)
    for registry, name, place, config in COMPONENTS:
        registry.add(name, place, config=config)
    for name, place in MODEL_TRANSFORMS_IN_ORDER:
        MODEL_TRANSFORMS.add(name, place)
    for name, place in STEP_EXTRAS_IN_ORDER:
        STEP_EXTRAS.add(name, place)
