"""``posttrain init``: commented starter configs that run as they are on the tiny local model.

Each starter is a YAML text with ``{model}`` and ``{data}`` placeholders; ``write_starter`` fills them with
paths beside the config and creates the tiny model and a small dataset there when they are missing.
"""

from __future__ import annotations

from pathlib import Path

from posttrain.testing.data import chat_rows, format_preference_rows, text_rows, write_jsonl
from posttrain.utils.fs import atomic_write_text

_COMMON_TAIL = """\
micro_batch_size: 8
epochs: 1
optimizer:
  lr: {lr}                 # peak learning rate (alias: learning_rate)
  weight_decay: 0.01
scheduler:
  type: huggingface        # or megatron (WSD, inverse-square-root, ...); see docs/reference.md
  name: cosine
  warmup_ratio: 0.05
logger:
  output_dir: {output}     # metrics, logs, resolved config, kill switch
checkpoint:
  - type: huggingface      # a Hugging Face export (adapter + optional merged model with LoRA)
    output_dir: {output}/export
    save_end_of_training: true
  - type: deepspeed        # resumable training state
    output_dir: {output}/state
    save_every_n_steps: 50
    auto_resume: true
"""

_HEADER = """\
# posttrain starter: {kind}. Runs as is on the tiny local model written beside it. Its paths are relative to the
# directory posttrain runs in (every path in a config is), so run it from where `posttrain init` ran:
#   posttrain preprocess {name}    # pre-flight report (data, tokens, steps), no model loaded
#   posttrain train {name}
# Every key and its default: posttrain validate {name}; reference: docs/reference.md.
# Editors: `posttrain schema > posttrain.schema.json` and add this first line for YAML language servers:
# # yaml-language-server: $schema=posttrain.schema.json
"""

STARTERS = {
    "sft": """\
type: sft                  # supervised fine-tuning on chat data
model:
  name_or_path: {model}    # a Hugging Face model directory or hub name
  dtype: float32           # bfloat16 on GPUs
  disable_activation_checkpoint: true   # false on large models: recompute activations to save memory
tokenizer:
  chat_template: keep-original   # or chatml, llama3, mistral-with-system, simplified-llama31, a .jinja file
data:
  sources:
    - {data}               # {{"messages": [{{"role": ..., "content": ...}}, ...]}} per line
  train_eval_split: [0.9, 0.1]
  max_length: 128
  pack_samples: false      # true: several samples per sequence (micro_batch_size: 1)
eval_interval: 20
eval_on_start: true       # the held-out loss before training, to compare with the end
""",
    "lora": """\
type: sft                  # supervised fine-tuning of a LoRA adapter
model:
  name_or_path: {model}
  dtype: float32
  disable_activation_checkpoint: true
  peft_config:
    peft_type: LORA
    r: 16
    lora_alpha: 32
    lora_dropout: 0.0
    target_modules: all-linear
    modules_to_save: [lm_head]   # the tiny random model's output layer knows nothing: train it too
data:
  sources: [{data}]
  train_eval_split: [0.9, 0.1]
  max_length: 128
eval_interval: 20
eval_on_start: true       # the held-out loss before training, to compare with the end
""",
    "dpo": """\
type: dpo                  # preference tuning (DPO family)
beta: 0.1
loss_type: sigmoid         # or ipo, hinge, simpo, orpo, dpop, kto_pair, ... or a list with loss_weights
model:
  name_or_path: {model}
  dtype: float32
  disable_activation_checkpoint: true
data:
  sources: [{data}]        # {{"prompt": ..., "chosen": ..., "rejected": ...}} per line
  train_eval_split: [0.9, 0.1]
  max_length: 64
eval_interval: 20
eval_on_start: true       # the held-out loss before training, to compare with the end
""",
    "kto": """\
type: kto                  # KTO: completions labelled desirable or undesirable, no pairs needed
beta: 0.1
desirable_weight: 1.0      # the run warns when weight x count is out of balance between the two kinds
undesirable_weight: 1.0
model:
  name_or_path: {model}
  dtype: float32
  disable_activation_checkpoint: true
data:
  sources: [{data}]        # {{"prompt": ..., "completion": ..., "label": true|false}} per line (or pairs)
  train_eval_split: [0.9, 0.1]
  max_length: 64
eval_interval: 20
eval_on_start: true       # the held-out loss before training, to compare with the end
""",
    "reward": """\
type: reward               # a reward model: a scalar score head, trained on preference pairs
center_rewards_coefficient: 0.01   # keeps the scores centred on 0 (null: off)
model:
  name_or_path: {model}    # loaded as AutoModelForSequenceClassification (one label)
  dtype: float32
  disable_activation_checkpoint: true
data:
  sources: [{data}]        # {{"prompt": ..., "chosen": ..., "rejected": ..., "margin": optional}} per line
  train_eval_split: [0.9, 0.1]
  max_length: 64
eval_interval: 20          # eval_accuracy: the held-out pairs ranked right; eval_margin
eval_on_start: true       # the held-out loss before training, to compare with the end
""",
    "causal": """\
type: causal               # continued pretraining on raw text
model:
  name_or_path: {model}
  dtype: float32
  disable_activation_checkpoint: true
data:
  sources: [{data}]        # {{"text": ...}} per line
  train_eval_split: [0.9, 0.1]
  max_length: 64
  pack_samples: false      # false: concatenate and cut blocks; true: pack documents apart
eval_interval: 20
eval_on_start: true       # the held-out loss before training, to compare with the end
""",
    "grpo": """\
type: grpo                 # online RL: sample completions, score them, raise the better ones' probability
model:
  name_or_path: {model}
  dtype: float32
  disable_activation_checkpoint: true
data:
  sources: [{data}]        # {{"prompt": [messages] or "text", "answer": ...}} per line; columns go to rewards
  train_eval_split: [0.9, 0.1]
  max_length: 64
rewards:                   # each with a weight; user functions: path/to/file.py:function (TRL's signature)
  - {{type: exact_match, column: answer, extract: last_number}}
  - {{type: regex, pattern: "[0-9]", weight: 0.5}}   # a format reward: the answer holds a digit
num_generations: 8         # completions per prompt; the batch counts completions (8 prompts x 8 here)
max_completion_length: 16
temperature: 1.0
beta: 0.0                  # KL penalty to the reference (0: no reference model loaded)
loss_type: dapo            # grpo | dapo | dr_grpo | reinforce
train_iters: 30
gradient_accumulation_steps: 8
eval_interval: 15          # eval_reward: the rewards of greedy completions to held-out prompts
eval_on_start: true
""",
    "distill": """\
type: distill              # on-policy distillation: the student samples, the teacher scores every token
model:
  name_or_path: {model}    # the student
  dtype: float32
  disable_activation_checkpoint: true
teacher_model_name_or_path: {teacher}   # a larger model with the same tokenizer, taught the task
beta: 0.5                  # 0 forward KL(teacher || student), 1 reverse KL (TRL's default), between: JSD
data:
  sources: [{data}]        # {{"prompt": [messages] or "text"}} per line (other columns are ignored)
  train_eval_split: [0.9, 0.1]
  max_length: 64
max_completion_length: 16
temperature: 1.0
train_iters: 30
gradient_accumulation_steps: 1   # a batch of 8 prompts: 29 batches in an epoch of the 262 training prompts
eval_interval: 15          # eval_divergence: the teacher's judgement of greedy completions to held-out prompts
eval_on_start: true
""",
}
LEARNING_RATES = {
    "sft": "3e-3",
    "lora": "1e-2",
    "dpo": "5e-4",
    "kto": "2e-3",
    "reward": "5e-4",
    "causal": "1e-2",
    "grpo": "3e-3",
    "distill": "1e-2",
}  # tiny model


#: the starters' tiny model: heads of 32 dimensions, a size vLLM's CPU build runs (``use_vllm: true``)
STARTER_HEADS = 2
#: the distill starter's teacher: wider and deeper than the student, the same tokenizer, taught the task
TEACHER_SHAPE = {"hidden_size": 128, "layers": 3, "heads": 4}
TEACHER_STEPS = 200
TEACHER_LR = 3e-3


def train_teacher(out: Path) -> Path:
    """The distill starter's teacher, taught the reversal task first (an SFT run of ``TEACHER_STEPS`` steps
    in a child process, about ten seconds on a CPU): a random teacher would give the student nothing to
    learn. Written to ``out`` in one rename."""
    import subprocess
    import sys

    import yaml

    from posttrain.errors import UserError
    from posttrain.testing.env import child_env
    from posttrain.tiny_model import write_tiny_model
    from posttrain.utils.fs import atomic_dir

    print(f"training the starter's teacher ({TEACHER_STEPS} SFT steps on the reversal chats) ...", flush=True)
    with atomic_dir(out) as tmp:
        work = tmp / "work"
        raw = write_tiny_model(work / "untrained", **TEACHER_SHAPE)
        config = {
            "type": "sft",
            "model": {"name_or_path": str(raw), "dtype": "float32", "disable_activation_checkpoint": True},
            "data": {"sources": [str(write_jsonl(work / "chat.jsonl", chat_rows(600)))], "max_length": 64},
            "micro_batch_size": 16,
            "train_iters": TEACHER_STEPS,
            "optimizer": {"lr": TEACHER_LR},
            "scheduler": {"name": "cosine", "warmup_ratio": 0.1},
            "logger": {"output_dir": str(work / "run")},
            "checkpoint": [
                {"type": "huggingface", "output_dir": str(work / "export"), "save_end_of_training": True}
            ],
        }
        (work / "teacher.yaml").write_text(yaml.safe_dump(config))
        done = subprocess.run(
            [sys.executable, "-m", "posttrain", "train", str(work / "teacher.yaml")],
            capture_output=True,
            text=True,
            env=child_env(),  # its own process group, whatever this process runs
        )
        if done.returncode != 0:
            raise UserError(f"training the starter's teacher failed: {done.stderr.strip()[-1500:]}")
        for file in (work / "export" / "final").iterdir():
            file.rename(tmp / file.name)
        import shutil

        shutil.rmtree(work)
    return out


def prompt_rows(n: int) -> list[dict]:
    """Prompts of the reversal task (grpo's and distill's starters): each chat's first question (with its
    system message), the answer as a column for grpo's reward; each prompt once (a held-out split then
    holds prompts never trained on)."""
    rows: dict[str, dict] = {}
    for chat in chat_rows(n):
        messages = chat["messages"]
        first = next(i for i, m in enumerate(messages) if m["role"] == "user")
        prompt = messages[: first + 1]
        rows.setdefault(prompt[-1]["content"], {"prompt": prompt, "answer": messages[first + 1]["content"]})
    return list(rows.values())


def _dataset(kind: str, path: Path) -> None:
    if kind in ("grpo", "distill"):  # prompts (with the expected answer as a column for grpo's reward)
        rows = prompt_rows(300)
    elif kind == "kto":  # TRL's unpaired layout: each pair's answers as one desirable and one undesirable row
        rows = [
            {"prompt": pair["prompt"], "completion": pair[side], "label": side == "chosen"}
            for pair in format_preference_rows(200)
            for side in ("chosen", "rejected")
        ]
    else:
        pairs = format_preference_rows(200)
        rows = {"dpo": pairs, "reward": pairs, "causal": text_rows(300)}.get(kind) or chat_rows(300)
    write_jsonl(path, rows)


def write_starter(kind: str, out: Path) -> list[Path]:
    """Write the starter config to ``out`` (refusing to overwrite) and whatever it needs beside it."""
    from posttrain.errors import UserError

    if kind not in STARTERS:
        raise UserError(f"unknown starter {kind!r}; choose one of {', '.join(STARTERS)}")
    if out.exists():
        raise UserError(f"{out} exists; choose another path with -o (nothing was changed)")
    base = out.parent
    model = base / "tiny-model"
    names = {
        "dpo": "preferences",
        "reward": "preferences",
        "kto": "feedback",
        "causal": "text",
        "grpo": "prompts",
        "distill": "prompts",
    }
    data = base / "data" / f"{names.get(kind, 'chat')}.jsonl"
    written = []
    if not (model / "config.json").is_file():
        from posttrain.tiny_model import write_tiny_model

        written.append(write_tiny_model(model, heads=STARTER_HEADS))
    if not data.is_file():
        _dataset(kind, data)
        written.append(data)
    teacher = base / "tiny-teacher"
    if kind == "distill" and not (teacher / "config.json").is_file():
        written.append(train_teacher(teacher))
    text = _HEADER.format(kind=kind, name=out) + STARTERS[kind].format(
        model=model, data=data, teacher=teacher
    )
    text += _COMMON_TAIL.format(lr=LEARNING_RATES[kind], output=base / "runs" / out.stem)
    atomic_write_text(out, text)
    return [out, *written]
