"""The memory plan's arithmetic: itemised bytes per process on its device and on the host, from the settings
that decide them (pure: a :class:`Settings` and a :class:`~posttrain.memory.shape.ModelShape` in, a
:class:`MemoryPlan` out, so the fixes can re-plan a changed setting in microseconds).

Each item says when it is live. Model states live all run (``states``); the optimizer's temporaries and
gradient-reduction flattening live at the ``step``; activations live through ``forward+backward``; the
loss's working memory at the end of the ``forward``; with activation checkpointing, the one layer recomputed
at a time lives in ``backward`` (after the loss's memory is gone). The peak is the largest sum over the
moments ``forward``, ``backward`` and ``step``.

The per-token activation counts are those of transformers' decoder layers as autograd saves them
(LLaMA-style: two RMSNorms, q/k/v/o projections with rotary embeddings, a gated MLP): per layer and token
``4 h + 2 q + kv`` elements for attention and norms (``6 (q + kv)`` more when a row's documents
attend apart on a CPU), ``4 I`` for a gated MLP (``2 I`` ungated), ``top_k``
experts' share for a mixture of experts, plus the float32 copies half-precision RMSNorms keep. They were
measured on CPU against the process's peak (``benchmarks/memory_plan.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from posttrain.memory.shape import ModelShape
from posttrain.models.token_logps import TILED_LOSS_MIN_TOKENS, chunk_rows

GiB = 2**30
Place = Literal["device", "host"]
Phase = Literal["states", "forward", "backward", "forward+backward", "step", "generation"]
MOMENTS = ("forward", "backward", "step", "generation")

#: bytes per element of the weight dtypes a run trains in
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: 4-bit NF4 weights: half a byte each, plus one float32 scale per block of 64 (double quantisation: less)
FOUR_BIT_BYTES = 0.5 + 4 / 64
#: what a process holds before the model: the CUDA context and cuBLAS/cuDNN workspaces on a GPU, and on the
#: host the libraries (torch, CUDA, transformers, DeepSpeed) a training process imports. Stated, not measured
#: per machine; the accuracy tests compare tensors only (growth over a baseline taken after the imports).
RUNTIME_OVERHEAD = {"cuda": (1.0 * GiB, 3.0 * GiB), "cpu": (0.0, 0.5 * GiB)}
#: torch's AdamW (foreach) allocates one float32 temporary the size of a parameter group at each step
FOREACH_TEMPORARIES = 1
#: DeepSpeed's stage-0 gradient all-reduce flattens at most this many elements at a time
ALLREDUCE_BUCKET = 500_000_000


@dataclass(frozen=True)
class Settings:
    """What the memory of one process depends on, read from a resolved config (``from_config``)."""

    dtype: str  # float32 | bfloat16 | float16
    world_size: int  # processes (DeepSpeed shards over every one of them)
    stage: int  # the ZeRO stage as the run will use it
    offload_optimizer: str = "none"  # none | cpu | nvme
    offload_param: str = "none"
    optimizer: str = "adamw"  # adamw | cpu_adam | fused_adam ...
    reduce_bucket: int = 0  # elements
    prefetch_bucket: int = 0  # ZeRO-3 (elements)
    max_live_parameters: int = 0  # ZeRO-3 (elements)
    checkpointing: bool = True
    checkpoint_offload: bool = False
    tiled_mlp: bool = False
    tiled_loss: bool | str = "auto"  # as ``tiled_loss_compute``: true, false or auto (by tokens per process)
    sequence_parallel: int = 1
    expert_parallel: int = 1
    micro_batch: int = 1
    gradient_accumulation: int = 1
    tokens_per_row: int = 2048  # the longest row of a micro-batch (before sequence parallelism)
    rows_per_sample: int = 1  # 2 for preference pairs (chosen and rejected in one forward)
    eager_attention: bool = False
    documents: bool = False  # rows of several documents (packing, padding-free) attend per document
    four_bit: bool = False
    device: str = "cuda"  # where the model trains: cuda | cpu
    bf16_optimizer: bool = False  # DeepSpeed's BF16_Optimizer: float32 gradients kept between micro-batches
    # online RL (grpo): each rank generates ``generation_rows`` completions of ``generation_tokens`` (prompt +
    # completion) at once; a frozen reference model (``reference_model``); vLLM's share of each GPU; reward
    # models held whole by every process (name, parameters, dtype)
    generation_rows: int = 0
    generation_tokens: int = 0
    reference_model: bool = False
    vllm_share: float = 0.0
    reward_models: tuple[tuple[str, int, str], ...] = ()
    teacher_models: tuple[tuple[str, int, str], ...] = ()  # distill's teacher: (path, parameters, dtype)
    gpu_memory: float = 0.0  # bytes per GPU (vLLM's share is a fraction of it)
    image_tokens: int = 0  # a vision-language run: the most image tokens one row holds (0: none, or unknown)

    @property
    def tokens(self) -> int:
        """Tokens one process holds in a micro-batch."""
        rows = self.micro_batch * self.rows_per_sample
        return rows * -(-self.tokens_per_row // self.sequence_parallel)

    @property
    def loss_tiled(self) -> bool:
        """Whether the loss is computed in chunks (``tiled_loss_compute: auto`` decides by tokens)."""
        if self.tiled_loss == "auto":
            return self.tokens >= TILED_LOSS_MIN_TOKENS
        return bool(self.tiled_loss)


@dataclass(frozen=True)
class Item:
    part: str
    place: Place
    phase: Phase
    bytes: float
    detail: str = ""


@dataclass
class MemoryPlan:
    """The itemised estimate for one process; ``device_peak`` and ``host_peak`` are that process's peaks
    (on a CPU run the device is the host)."""

    settings: Settings
    shape: ModelShape
    items: list[Item] = field(default_factory=list)

    def add(self, part: str, place: Place, phase: Phase, size: float, detail: str = "") -> None:
        if size > 0:
            self.items.append(Item(part, place, phase, float(size), detail))

    def peak(self, place: Place, runtime: bool = True) -> float:
        def live(moment: str) -> float:
            return sum(
                i.bytes
                for i in self.items
                if i.place == place
                and (i.phase == "states" or moment in i.phase.split("+"))
                and (runtime or i.part != "runtime")
            )

        return max(live(moment) for moment in MOMENTS)

    @property
    def device_peak(self) -> float:
        return self.peak("device")

    @property
    def host_peak(self) -> float:
        return self.peak("host")

    def tensors_peak(self) -> float:
        """What one process's tensors take at the peak, on device and host together (no runtime constant):
        what the CPU accuracy tests compare with the process's growth."""
        return self.peak("device", runtime=False) + self.peak("host", runtime=False)


def plan(settings: Settings, shape: ModelShape) -> MemoryPlan:
    """The memory plan of one process of a run with ``settings`` on a model of ``shape``."""
    out = MemoryPlan(settings, shape)
    _weights(out)
    _gradients_and_optimizer(out)
    _deepspeed_buffers(out)
    _activations(out)
    _image_encoder(out)
    _loss(out)
    _fp8(out)
    _generation(out)
    device, host = RUNTIME_OVERHEAD["cuda" if settings.device == "cuda" else "cpu"]
    out.add("runtime", "device", "states", device, "CUDA context, cuBLAS/cuDNN workspaces (stated constant)")
    out.add("runtime", "host", "states", host, "libraries of a training process (stated constant)")
    if settings.device != "cuda":  # one memory: everything the device would hold is on the host
        out.items = [Item(i.part, "host", i.phase, i.bytes, i.detail) for i in out.items]
    return out


def kv_cache_bytes(layers: int, kv_dim: int, tokens: int, element_bytes: int) -> int:
    """A KV cache holding ``tokens`` tokens (over every sequence): a key and a value per layer and token."""
    return 2 * layers * kv_dim * tokens * element_bytes


def _generation(out: MemoryPlan) -> None:
    """Online RL: generation's KV cache and last-token logits (ZeRO-3 gathers every parameter for it), a frozen
    reference model, reward models' weights (their scoring batches are not counted), vLLM's reserved share of
    the GPU."""
    s, shape = out.settings, out.shape
    b = DTYPE_BYTES[s.dtype]
    if s.generation_rows:
        tokens = s.generation_rows * s.generation_tokens
        cache = kv_cache_bytes(shape.layers, shape.kv_dim, tokens, b)
        detail = f"{s.generation_rows} completions x {s.generation_tokens:,} tokens (prompt + completion)"
        out.add("generation KV cache", "device", "generation", cache, detail)
        out.add("generation logits", "device", "generation", s.generation_rows * shape.vocab * 4, "float32")
        if s.stage == 3:
            gathered = shape.params * (1 - 1 / s.world_size) * b
            out.add(
                "generation: gathered parameters", "device", "generation", gathered, "ZeRO 3, all at once"
            )
    if s.reference_model:
        out.add("reference model", "device", "states", shape.params * b, f"frozen, {s.dtype}")
    for name, params, dtype in s.reward_models:
        size = params * DTYPE_BYTES.get(dtype, 4)
        out.add("reward model", "device", "states", size, f"{name}: {params / 1e6:,.1f}M in {dtype}, whole")
    for name, params, dtype in s.teacher_models:  # partitioned with the student under ZeRO-3
        share = s.world_size if s.stage == 3 else 1
        size = params * DTYPE_BYTES.get(dtype, 4) / share
        how = f"ZeRO 3, 1/{share}" if s.stage == 3 else "whole"
        out.add("teacher model", "device", "states", size, f"{name}: {params / 1e6:,.1f}M in {dtype}, {how}")
    if s.vllm_share and s.gpu_memory:
        out.add(
            "vLLM engine", "device", "states", s.vllm_share * s.gpu_memory, f"{s.vllm_share:.0%} of the GPU"
        )


def _local(s: Settings, shape: ModelShape, count: int) -> float:
    """Of ``count`` parameters, those one process holds before ZeRO sharding: experts are split over the
    expert-parallel group."""
    if not shape.experts or s.expert_parallel == 1:
        return count
    return count - shape.experts * (1 - 1 / s.expert_parallel) * (count / shape.params)


def _weights(out: MemoryPlan) -> None:
    s, shape = out.settings, out.shape
    b = DTYPE_BYTES[s.dtype]
    params = _local(s, shape, shape.params)
    if s.four_bit:
        quantised = shape.params - shape.embedding - shape.head - shape.trainable
        size = quantised * FOUR_BIT_BYTES + (params - quantised) * b
        detail = f"{quantised / 1e6:,.0f}M in 4 bit, {(params - quantised) / 1e6:,.0f}M in {s.dtype}"
    else:
        size, detail = params * b, f"{params / 1e6:,.1f}M x {b} B ({s.dtype})"
    if s.stage == 3:
        if s.offload_param != "nvme":  # on NVMe: on disk, behind buffers DeepSpeed sizes itself
            place: Place = "host" if s.offload_param == "cpu" else "device"
            detail += f", 1/{s.world_size} (ZeRO 3)"
            out.add("parameters", place, "states", size / s.world_size, detail)
        live = max(s.max_live_parameters, s.prefetch_bucket, shape.largest_module)
        out.add("ZeRO-3 gathered parameters", "device", "states", live * b, f"{live / 1e6:,.1f}M elements")
    else:
        out.add("parameters", "device", "states", size, detail)


def _gradients_and_optimizer(out: MemoryPlan) -> None:
    s, shape = out.settings, out.shape
    b = DTYPE_BYTES[s.dtype]
    trainable = _local(s, shape, shape.trainable)
    shard = s.world_size if s.stage >= 1 else 1
    half = b < 4
    offload: Place = "host" if s.offload_optimizer == "cpu" else "device"
    if not (s.stage >= 2 and s.offload_optimizer != "none"):  # ZeRO 2/3 offload moves reduced gradients off
        grads = trainable / s.world_size if s.stage >= 2 else trainable
        detail = s.dtype + (", partitioned" if s.stage >= 2 else "")
        out.add("gradients", "device", "states", grads * b, detail)
    if s.offload_optimizer == "nvme":
        return  # on disk: nothing in memory but the pinned swap buffers DeepSpeed sizes itself
    where = f", 1/{shard}" if shard > 1 else ""
    # sharded, each process keeps 1/world of every parameter's state (experts: 1/(world/EP) of its 1/EP)
    states = trainable if shard == 1 else shape.trainable / shard
    if half:
        # DeepSpeed's mixed precision: float32 master weights and a float32 gradient for each of them
        out.add("master weights", offload, "states", states * 4, "float32" + where)
        # stage 0 and DeepSpeed's BF16_Optimizer (one process's bf16 stage 1) accumulate in them, offload
        # keeps them pinned on the host; ZeRO 1-3 on the device build them from the 16-bit gradients at the
        # step and free them after
        persistent = s.stage == 0 or s.bf16_optimizer or offload == "host"
        out.add(
            "float32 gradients", offload, "states" if persistent else "step", states * 4, "float32" + where
        )
    elif s.stage >= 1:
        out.add("master weights", offload, "states", states * 4, "float32 copy" + where)
        if s.stage == 3:  # ZeRO-3 flattens each sub-group's gradient partition for the step, float32 or not
            out.add("float32 gradients", offload, "step", states * 4, "flattened for the step" + where)
    out.add("optimizer states", offload, "states", states * 8, "Adam moments, float32" + where)
    if s.optimizer == "adamw" and s.offload_optimizer == "none":
        out.add(
            "optimizer step temporaries", "device", "step", FOREACH_TEMPORARIES * 4 * states, "torch AdamW"
        )


def _deepspeed_buffers(out: MemoryPlan) -> None:
    s, shape = out.settings, out.shape
    b = DTYPE_BYTES[s.dtype]
    if s.stage == 0 and s.world_size > 1:
        flat = min(_local(s, shape, shape.trainable), ALLREDUCE_BUCKET)
        out.add(
            "all-reduce buffer", "device", "step", flat * b, "DeepSpeed flattens gradients to reduce them"
        )
    elif (s.stage in (1, 2) and s.world_size > 1) or s.stage == 3:
        bucket = min(s.reduce_bucket, shape.trainable)
        out.add(
            "reduce buckets",
            "device",
            "states",
            2 * bucket * b,
            f"2 x reduce_bucket_size {s.reduce_bucket:,}",
        )


def layer_elements(shape: ModelShape, settings: Settings) -> tuple[float, float]:
    """Per token, the elements one decoder layer saves for backward: (attention and norms, MLP)."""
    h, q, kv = shape.hidden, shape.q_dim, shape.kv_dim
    attention = 4 * h + 2 * q + kv + shape.adapter_inputs
    if settings.documents and (settings.device != "cuda" or settings.dtype == "float32"):
        # attention per document without varlen kernels (a CPU; float32 on CUDA, which the varlen kernel
        # refuses): each call's copies of its slices of q, k, v, and the backward's recomputation; calibrated
        # on CPU (benchmarks/memory_plan.py, packed cases)
        attention += 6 * (q + kv)
    if shape.num_experts:
        mlp = shape.top_k * (4 * shape.expert_intermediate + 2 * h) + 4 * shape.shared_intermediate
        mlp += shape.num_experts
    else:
        mlp = (4 if shape.gated else 2) * shape.intermediate
    if settings.tiled_mlp:
        mlp = h  # the MLP keeps its input; each tile is recomputed in backward (see ``_activations``)
    return attention, mlp


def _activations(out: MemoryPlan) -> None:
    s, shape = out.settings, out.shape
    b = DTYPE_BYTES[s.dtype]
    tokens = s.tokens
    attention, mlp = layer_elements(shape, s)
    norm_copies = 8 * shape.hidden if b < 4 else 0  # half precision: each RMSNorm keeps a float32 input
    per_layer = tokens * ((attention + mlp) * b + norm_copies)
    if s.eager_attention:
        rows = s.micro_batch * s.rows_per_sample
        per_layer += 2 * rows * shape.heads * s.tokens_per_row * (tokens // rows) * b
    _math_attention(out)
    if s.checkpointing:
        saved = shape.layers * tokens * shape.hidden * b
        place: Place = "host" if s.checkpoint_offload and s.device == "cuda" else "device"
        out.add("checkpointed layer inputs", place, "forward+backward", saved, f"{shape.layers} layers")
        out.add("activations", "device", "backward", per_layer, "one layer recomputed in backward")
        if not s.tiled_mlp:  # the tiled MLP's own working memory covers its backward
            width = shape.intermediate or shape.top_k * shape.expert_intermediate
            grads = tokens * (2 if shape.gated else 1) * width * b
            out.add("recomputed layer's MLP gradients", "device", "backward", grads, "beside its activations")
    else:
        out.add(
            "activations", "device", "forward+backward", shape.layers * per_layer, f"{shape.layers} layers"
        )
    if s.tiled_mlp:
        intermediate = shape.intermediate or shape.top_k * shape.expert_intermediate
        tile = min(tokens, shape.hidden)
        out.add("tiled MLP working memory", "device", "backward", 4 * tile * intermediate * b, "one tile")
    out.add(
        "embeddings, final norm, gradient flow",
        "device",
        "forward+backward",
        2 * tokens * shape.hidden * b,
        f"{tokens:,} tokens",
    )


#: per position and layer, the elements an image encoder layer (a ViT: two LayerNorms, q/k/v/o projections,
#: an ungated MLP) keeps for backward, in units of (its width, its MLP's width); calibrated on CPU
#: (``benchmarks/memory_plan.py``, the vision cases)
ENCODER_ELEMENTS = (8, 2)


def _image_encoder(out: MemoryPlan) -> None:
    """A vision-language model's image encoder over a micro-batch's images: each image token of the language
    model stands for ``patches_per_token`` encoder positions. A trained tower keeps its layers' activations
    for backward (with activation checkpointing, its layers' inputs and one recomputed layer); a frozen one
    keeps nothing, and one layer's working memory lives during the forward. A trained projector keeps the
    tower's output."""
    s, vision = out.settings, out.shape.vision
    if vision is None or not s.image_tokens:
        return
    b = DTYPE_BYTES[s.dtype]
    rows = s.micro_batch * s.rows_per_sample
    positions = round(rows * s.image_tokens * vision.patches_per_token)
    width, mlp = ENCODER_ELEMENTS
    per_layer = positions * (width * vision.hidden + mlp * vision.intermediate) * b
    detail = f"{positions:,} positions ({rows} rows x {s.image_tokens:,} image tokens)"
    if not vision.tower_trained:  # a layer's input, its q/k/v and output, or its MLP's activation, at once
        working = positions * (4 * vision.hidden + vision.intermediate) * b
        out.add("image encoder (frozen)", "device", "forward", working, detail + ", one layer at a time")
    elif s.checkpointing:
        inputs = vision.layers * positions * vision.hidden * b
        out.add("image encoder: checkpointed layer inputs", "device", "forward+backward", inputs, detail)
        out.add("image encoder activations", "device", "backward", per_layer, "one layer recomputed")
    else:
        everything = vision.layers * per_layer
        out.add("image encoder activations", "device", "forward+backward", everything, detail)
    if vision.projector_trained:
        kept = positions * vision.hidden * b
        out.add(
            "projector input", "device", "forward+backward", kept, "the tower's output, kept for backward"
        )


def _fp8(out: MemoryPlan) -> None:
    """``model.fp8``: the weights stay in high precision (counted above); each converted layer casts its input
    and weight to float8 in forward, and its output gradient (twice: one layout per product), weight and input
    in backward, one byte an element, freed after the layer (torchao's emulation on a CPU also makes float32
    copies of the casts it multiplies)."""
    s, layers = out.settings, out.shape.fp8
    if layers is None or not layers.converted:
        return
    casts = 3 * s.tokens * layers.widest + 2 * layers.largest
    detail = f"one layer's float8 input, weight and output gradient ({len(layers.converted)} layers in FP8)"
    if s.device != "cuda":
        casts += 4 * (s.tokens * layers.widest + layers.largest)
        detail += "; emulated: float32 copies"
    out.add("fp8 casts", "device", "forward+backward", casts, detail)


def math_attention(settings: Settings, shape: ModelShape) -> bool:
    """Whether ``sdpa`` runs its math kernel, which holds every row's ``[heads, tokens, tokens]`` scores: on
    CUDA in float32 with grouped key/value heads, where transformers asks for grouped attention and only the
    math kernel takes it (rows of several documents run posttrain's own per-document calls instead)."""
    return (
        settings.device == "cuda"
        and settings.dtype == "float32"
        and shape.kv_dim < shape.q_dim
        and not settings.documents
        and not settings.eager_attention
    )


def _math_attention(out: MemoryPlan) -> None:
    """The math kernel's float32 scores, measured on an H100 (``benchmarks/memory_plan.py``, 2K and 8K rows):
    each layer keeps its softmax for backward (one ``[heads, tokens, tokens]`` tensor), and a layer's backward
    works on three more at once."""
    s, shape = out.settings, out.shape
    if not math_attention(s, shape):
        return
    rows = s.micro_batch * s.rows_per_sample
    length = -(-s.tokens_per_row // s.sequence_parallel)
    scores = rows * shape.heads * length * length * 4
    detail = f"sdpa's math kernel (float32, grouped KV heads): {shape.heads} x {length:,}^2 per row"
    if s.checkpointing:
        out.add("attention scores", "device", "backward", 4 * scores, detail + ", the recomputed layer")
    else:
        out.add("attention scores", "device", "forward+backward", shape.layers * scores, detail + ", kept")
        out.add("attention scores, backward", "device", "backward", 3 * scores, "one layer's gradients")


def _loss(out: MemoryPlan) -> None:
    s, shape = out.settings, out.shape
    b = DTYPE_BYTES[s.dtype]
    tokens, vocab = s.tokens, shape.vocab
    if s.loss_tiled:
        rows = chunk_rows(vocab, shape.hidden, tokens)
        working = rows * vocab * (8 + b) + tokens * shape.hidden * b + vocab * shape.hidden * 4
        out.add("loss (tiled)", "device", "forward", working, f"chunks of {rows:,} rows x {vocab:,} logits")
    else:
        working = tokens * vocab * (b + 8 + (4 if b < 4 else 0))
        out.add("loss (whole logits)", "device", "forward", working, f"{tokens:,} x {vocab:,} logits")
