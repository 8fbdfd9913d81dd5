"""``vllm_mode: server``: vLLM servers generate for every training process (TRL's server mode), the way past
one machine's memory for generation; one server, or a pool of them (``vllm_server_base_url`` as a list: which
server serves what, a lost server, one that comes back: ``server_pool.py``).

- A server: ``posttrain vllm-serve CONFIG`` starts vLLM's OpenAI-compatible server for the run's model with
  the settings the colocated engine would take (:func:`server_command`: the context, dtype, processed
  log-probabilities, the model's generation defaults off, and on a CPU eager mode and a KV cache), its
  development endpoints on (``/collective_rpc``, ``/reset_prefix_cache``: ``VLLM_SERVER_DEV_MODE=1``).
- The run: rank 0 waits up to ``vllm_server_timeout`` seconds for the servers' ``/health``, then checks that
  each serves the run's model with a context that holds the longest prompt plus ``max_completion_length`` (one
  line otherwise, exit 2). Every rank sends its own completions, one request each with the completion's key as
  its seed, so draws are those of its key whatever the process count or the server that draws them.
- Weights after every update: the pushed weights (``vllm_backend.named_weights``, every rank taking part in
  the ZeRO-3 gathers) are written by rank 0 once, as one safetensors file under a directory the servers read
  (``vllm_server_weights_dir``; ``/dev/shm`` when there is one), tagged, reloaded in place by every server
  through ``POST /collective_rpc`` (posttrain's worker method, which keeps the tag), then
  ``POST /reset_prefix_cache``; the other ranks wait at a barrier, then ask each server which tag it holds.
  Training on GPUs, the weights go GPU to GPU instead, through vLLM's NCCL weight transfer
  (:class:`NcclWeights`: its trainer engine and HTTP client, one per server, the server started with
  ``--weight-transfer-config '{"backend": "nccl"}'``), written against vLLM 0.32's API and not yet measured:
  no GPU has been lent to run it (a server lost there does not rejoin: its NCCL group is gone).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from posttrain.config.online import server_urls
from posttrain.errors import UserError
from posttrain.generation.engine import EngineCopy
from posttrain.generation.server_pool import ServerClient, ServerPool
from posttrain.generation.types import Completions, EngineInputs, Sampling
from posttrain.generation.vllm_engine import (
    EngineSettings,
    engine_settings,
    free_port,
    model_context,
    named_weights,
    usable_cores,
)
from posttrain.generation.vllm_lora import adapter_push, adapter_state, save_adapter
from posttrain.logs import say

#: ``vllm.LLM`` arguments and the server's flags for them (the rest have no place in a server)
SERVER_FLAGS = {
    "model": "--model",
    "tokenizer": "--tokenizer",
    "dtype": "--dtype",
    "max_model_len": "--max-model-len",
    "seed": "--seed",
    "logprobs_mode": "--logprobs-mode",
    "quantization": "--quantization",
    "generation_config": "--generation-config",
    "kv_cache_memory_bytes": "--kv-cache-memory-bytes",
    "block_size": "--block-size",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "tensor_parallel_size": "--tensor-parallel-size",
    "worker_extension_cls": "--worker-extension-cls",
    "weight_transfer_config": "--weight-transfer-config",
    "max_lora_rank": "--max-lora-rank",
    "max_loras": "--max-loras",
}
#: switches: given when true
SERVER_SWITCHES = {
    "trust_remote_code": "--trust-remote-code",
    "enable_prefix_caching": "--enable-prefix-caching",
    "enforce_eager": "--enforce-eager",
    "enable_lora": "--enable-lora",
}
#: the colocated engine's environment a server does without: its engine runs in a process of its own, and
#: its log (the address it listens on, each request) is the server's to show
COLOCATED_ONLY = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_LOGGING_LEVEL")


def server_urls_of(config: Any) -> list[str]:
    """TRL's rule: ``vllm_server_base_url`` when set (one address, or a pool's), else ``http://host:port``."""
    return server_urls(config.vllm_server_base_url) or [
        f"http://{config.vllm_server_host}:{config.vllm_server_port}"
    ]


def serve_port(config: Any) -> int:
    """The port ``posttrain vllm-serve`` listens on without ``--port``: that of ``vllm_server_base_url`` when
    it names one server with a port, else ``vllm_server_port``."""
    from urllib.parse import urlparse

    urls = server_urls(config.vllm_server_base_url)
    port = urlparse(urls[0]).port if len(urls) == 1 else None
    return int(port or config.vllm_server_port)


def server_command(settings: EngineSettings, host: str, port: int) -> tuple[list[str], dict[str, str]]:
    """The command that starts vLLM's server with ``settings`` and the environment it needs."""
    import sys

    command = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry"]
    for key, value in settings.kwargs.items():
        if key in SERVER_FLAGS and value is not None:
            command += [SERVER_FLAGS[key], json.dumps(value) if isinstance(value, dict) else str(value)]
        elif key in SERVER_SWITCHES and value:
            command.append(SERVER_SWITCHES[key])
    command += ["--host", host, "--port", str(port)]
    env = {k: v for k, v in settings.env.items() if k not in COLOCATED_ONLY}
    env["VLLM_SERVER_DEV_MODE"] = "1"  # /collective_rpc and /reset_prefix_cache: the weight updates
    if settings.kwargs.get("enable_lora"):  # /v1/load_lora_adapter: a LoRA run's adapter pushes
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    return command, env


def parse_cores(text: str) -> list[int]:
    """``0-3,6`` as core numbers, or one line saying what is wrong."""
    cores: list[int] = []
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            cores += range(int(first), int(last or first) + 1)
    except ValueError:
        raise UserError(f"--cores {text!r}: not a core list; write it as taskset does: 0-3,6") from None
    available = usable_cores()
    outside = sorted(set(cores) - set(available))
    if not cores or outside:
        raise UserError(f"--cores {text}: cores {outside or text} are not this process's ({available})")
    return sorted(set(cores))


def server_settings(config: Any, device_type: str, cores: Sequence[int] | None = None) -> EngineSettings:
    """The server's engine settings for a run's config: those of a colocated engine (``engine_settings``),
    for prompts up to ``data.max_length`` tokens and a KV cache for one process's completions, on this
    machine's device (the server's); on a CPU its threads on ``cores`` (default: every core this process may
    use)."""
    from transformers import AutoConfig

    from posttrain.config.model import canonical_dtype
    from posttrain.models.dimensions import read_dimensions

    if not getattr(config, "use_vllm", False) or config.vllm_mode != "server":
        raise UserError(
            "vllm-serve starts the server of a grpo run with use_vllm: true and vllm_mode: server; this config "
            "has neither (set them, or train with the colocated engine)"
        )
    from posttrain.utils.hub import load_or_explain

    name = config.model.name_or_path  # a missing model is the one line train says
    model = load_or_explain(
        "model.name_or_path",
        name,
        lambda: AutoConfig.from_pretrained(name, trust_remote_code=config.model.trust_remote_code),
    )
    dims = read_dimensions(model)
    dtype_name = canonical_dtype(config.model.dtype)
    dtype = (
        getattr(torch, dtype_name)
        if dtype_name != "auto"
        else getattr(model, "torch_dtype", None) or torch.bfloat16
    )
    rows = config.micro_batch_size * config.gradient_accumulation_steps
    server = config.model_copy(update={"vllm_enable_sleep_mode": False})
    settings = engine_settings(
        server,
        dims,
        dtype,
        device_type=device_type,
        longest_prompt=config.data.max_length,
        rows=rows,
        cores=list(cores) if cores else usable_cores(),
        where="a server",
    )
    if device_type == "cuda":  # the trainer's GPUs send the weights over NCCL (NcclWeights)
        settings.kwargs["weight_transfer_config"] = {"backend": "nccl"}
        # vLLM's batch-invariant kernels: a completion then depends on its key and the weights alone, not on
        # the requests batched with it, so a pool gives one server's numbers and a lost server's requests are
        # drawn again as they were (on a GPU the kernels' reductions otherwise follow the batch). A value the
        # user set in the server's environment is kept.
        if "VLLM_BATCH_INVARIANT" not in os.environ:
            settings.env["VLLM_BATCH_INVARIANT"] = "1"
            said = settings.said + "; batch-invariant kernels (VLLM_BATCH_INVARIANT=1)"
            settings = dataclasses.replace(settings, said=said)
    return settings


def check_served_model(served: dict[str, Any], model: str, needed: int, url: str) -> str:
    """The served model's name, after checking it is the run's model with a context long enough."""
    entries = served.get("data") or []
    if not entries:
        raise UserError(f"vllm_mode: server: the server at {url} serves no model")
    entry = entries[0]
    names = {str(entry.get("id")), str(entry.get("root"))}
    if model not in names and str(Path(model).resolve()) not in names:
        raise UserError(
            f"vllm_mode: server: the server at {url} serves {entry.get('root') or entry.get('id')}, not the run's "
            f"model.name_or_path ({model}); start it for this config: posttrain vllm-serve CONFIG"
        )
    context = entry.get("max_model_len")
    if context is not None and int(context) < needed:
        raise UserError(
            f"vllm_mode: server: the server's context is {context} tokens, shorter than the longest prompt plus "
            f"max_completion_length ({needed}); restart it with posttrain vllm-serve CONFIG (or "
            "vllm_max_model_length)"
        )
    return str(entry.get("id"))


def completion_body(
    model: str,
    prompt: Sequence[int],
    sampling: Sampling,
    stops: Sequence[int],
    key: int | None,
    logprobs: bool,
) -> dict[str, Any]:
    """One completion's request: every sampling field set by posttrain, greedy without a key."""
    sampled = key is not None
    return {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature if sampled else 0.0,
        "top_p": sampling.top_p if sampled else 1.0,
        "top_k": (sampling.top_k or -1) if sampled else -1,
        "min_p": sampling.min_p if sampled else 0.0,
        "repetition_penalty": sampling.repetition_penalty,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "seed": key,
        "stop_token_ids": list(stops),
        "logprobs": 0 if logprobs else None,
        "return_token_ids": True,
        "skip_special_tokens": False,
        "n": 1,
    }


def completions_from(choices: Sequence[dict[str, Any]], stops: Sequence[int], logprobs: bool) -> Completions:
    """The server's answers as :class:`Completions` (the stop token kept, as the engine's rows keep it)."""
    ids, truncated, logps = [], [], []
    stop_set = set(stops)
    for choice in choices:
        tokens = [int(t) for t in choice.get("token_ids") or []]
        ids.append(tokens)
        truncated.append(not tokens or tokens[-1] not in stop_set)
        if logprobs:
            found = (choice.get("logprobs") or {}).get("token_logprobs") or []
            logps.append([float("nan") if v is None else float(v) for v in found][: len(tokens)])
    return Completions(ids, truncated, logps if logprobs else None)


class VLLMServerEngine(EngineCopy):
    """Generation on the run's vLLM servers (see the module docstring and ``server_pool``'s)."""

    name = "vllm-server"

    def __init__(
        self,
        config: Any,
        module: torch.nn.Module,
        stop_ids: Sequence[int],
        dist: Any,
        needed: int,
        stopping: Callable[[], bool] = lambda: False,
    ) -> None:
        self.stop_ids, self.dist = list(stop_ids), dist
        urls = server_urls_of(config)
        self.adapter = adapter_push(config)
        self.servers = ServerPool(
            urls,
            float(config.vllm_server_timeout),
            float(config.request_timeout),
            float(config.weight_sync_timeout),
            dist.is_main,
            adapter=bool(self.adapter.rank),
            stopping=stopping,
        )
        self.weight_sync_timeout = float(config.weight_sync_timeout)
        self.weights_dir = getattr(config, "vllm_server_weights_dir", None)
        self.model = config.model.name_or_path
        self.served = self.model
        if dist.is_main:
            self.served = self.servers.start(
                lambda client: check_served_model(
                    client.call("/v1/models", doing="asking which model it serves"),
                    self.model,
                    needed,
                    client.url,
                )
            )
            where = f"server at {urls[0]}" if len(urls) == 1 else f"{len(urls)} servers ({', '.join(urls)})"
            say(f"vLLM {where}: {self.served}, weights pushed through {self.folder()}")
            if self.adapter.said:
                say(self.adapter.said)
        self.nonce, self.pushes = shared_nonce(), 0
        #: rank 0's last push: seconds to gather the weights, write them, and for every server to load them
        self.push_seconds: dict[str, float] = {}
        self._barrier()
        self.stale = True
        self.nccl: list[NcclWeights] | None = None
        if next(module.parameters()).device.type == "cuda" and not self.adapter.rank:
            self.nccl = [NcclWeights(s.client, module, dist) for s in self.servers.servers if not s.lost]

    def folder(self) -> Path:
        """Where rank 0 writes the weights for the servers to read: ``vllm_server_weights_dir``, else
        memory-backed when the machine has one."""
        if self.weights_dir:
            return Path(self.weights_dir)
        shm = Path("/dev/shm")
        return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())

    def sample(
        self, prompts: Sequence[Sequence[int]], sampling: Sampling, keys: list[int] | None, logprobs: bool
    ) -> Completions:
        bodies = [
            completion_body(
                self.servers.tag if self.adapter.rank else self.served,
                prompt,
                sampling,
                self.stop_ids,
                None if keys is None else keys[i],
                logprobs,
            )
            for i, prompt in enumerate(prompts)
        ]
        timeout = self.servers.servers[0].client.request_timeout
        answers = self.servers.complete(
            bodies, f"generating {len(bodies)} completions (request_timeout {timeout:g} s)"
        )
        return completions_from([answer["choices"][0] for answer in answers], self.stop_ids, logprobs)

    def push(self, module: torch.nn.Module) -> None:
        """The training weights to every server (every rank takes part in the gathers; rank 0 writes them once
        and every server reloads them), then their prefix caches emptied. Every rank's requests have ended
        first (a barrier): the weights never change under another rank's generation."""
        pushing = f"taking the new weights (weight_sync_timeout {self.weight_sync_timeout:g} s)"
        self._barrier()
        self.pushes += 1
        tag = f"{self.nonce}-{self.pushes}"
        if self.nccl is not None:
            for engine in self.nccl:
                engine.push()
            if self.dist.is_main:
                for server in self.servers.servers:
                    server.client.reset_prefix_cache(pushing)
            self._barrier()
            self.servers.confirm(tag, ask=False)
            self.stale = False
            return
        from safetensors.torch import save_file

        started = time.perf_counter()
        if self.adapter.rank:
            weights = adapter_state(module)
        else:
            weights = {name: tensor.detach().cpu().contiguous() for name, tensor in named_weights(module)}
        gathered = time.perf_counter()
        if self.dist.is_main:
            self.servers.drop_weights()
            folder = self.folder() / f"posttrain-weights-{tag}"
            folder.parent.mkdir(parents=True, exist_ok=True)
            partial = Path(tempfile.mkdtemp(prefix=f"{folder.name}.", dir=folder.parent))
            if self.adapter.rank:
                save_adapter(module, weights, partial)
            else:
                save_file(weights, str(partial / "model.safetensors"))
            partial.rename(folder)  # a server never reads half a file
            written = time.perf_counter()
            self.servers.reload_all(folder, tag, pushing)
            self.push_seconds = {
                "gather": gathered - started,
                "write": written - gathered,
                "load": time.perf_counter() - written,
                "bytes": float(sum(t.numel() * t.element_size() for t in weights.values())),
            }
        del weights
        self._barrier()
        self.servers.confirm(tag)
        self.stale = False

    def alive(self) -> bool:
        """Whether a server of the pool is still in it (a generation in flight can still end)."""
        return any(not server.lost for server in self.servers.servers)

    def _barrier(self) -> None:
        import torch.distributed as torch_dist

        if torch_dist.is_available() and torch_dist.is_initialized():
            torch_dist.barrier()

    def close(self) -> None:
        self.servers.close()


def shared_nonce() -> str:
    """A token rank 0 draws and every rank receives: the run's pushes are told apart from any other run's
    (a server that outlives a run holds its last weights' tag)."""
    import secrets

    import torch.distributed as torch_dist

    box = [secrets.token_hex(6)]
    if torch_dist.is_available() and torch_dist.is_initialized():
        torch_dist.broadcast_object_list(box, src=0)
    return str(box[0])


class NcclWeights:
    """Server mode's weights from the training GPUs to the server's over NCCL: vLLM's trainer-side transfer
    engine (``NCCLTrainerWeightTransferEngine``) over its HTTP control client, fed by the pushed weights
    (``named_weights``: every rank iterates them, taking part in the ZeRO-3 gathers; rank 0 sends). Written
    against vLLM 0.32's API; not yet measured (no GPU lent)."""

    def __init__(self, client: ServerClient, module: torch.nn.Module, dist: Any) -> None:
        import socket
        from urllib.parse import urlparse

        from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.nccl_engine import (
            NCCLTrainerInitInfo,
            NCCLTrainerWeightTransferEngine,
        )

        class PushedWeights(WeightSource):
            def __init__(self) -> None:
                self.meta: list[Any] | None = None

            def metadata(self) -> list[Any]:
                if self.meta is None:
                    self.meta = [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in named_weights(module)]
                return self.meta

            def __iter__(self) -> Any:
                return named_weights(module)

        target = urlparse(client.url)
        workers, address = 1, "127.0.0.1"
        if dist.is_main:
            workers = int(client.call("/get_world_size")["world_size"])
            with socket.create_connection((target.hostname, target.port or 80), timeout=10) as probe:
                address = probe.getsockname()[0]  # the interface the server reaches this process by
        info = NCCLTrainerInitInfo(
            master_address=address, master_port=free_port(), world_size=1 + workers, rank=dist.rank
        )
        self.engine = NCCLTrainerWeightTransferEngine.trainer_init(
            info, client=HTTPVLLMWeightSyncClient(client.url, client.timeout), source=PushedWeights()
        )

    def push(self) -> None:
        self.engine.send_weights()


def build_server_backend(
    config: Any,
    module: torch.nn.Module,
    stops: Sequence[int],
    longest: int,
    dist: Any,
    stopping: Callable[[], bool] = lambda: False,
) -> VLLMServerEngine:
    """The run's server backend (rank 0 checks the server; vLLM need not be installed where training runs)."""
    from posttrain.models.dimensions import read_dimensions
    from posttrain.models.token_logps import unwrap

    needed = model_context(config, read_dimensions(unwrap(module).config), longest)
    return VLLMServerEngine(config, module, stops, dist, needed, stopping)


def server_engine(config: Any, inputs: EngineInputs) -> VLLMServerEngine:
    """``registry.GENERATION_ENGINES``' ``vllm-server`` (``use_vllm`` with ``vllm_mode: server``)."""
    if inputs.processor is not None:
        raise UserError(
            "use_vllm: true with a vision-language model: its colocated engine (vllm_mode: colocate) generates "
            "with images, vllm_mode: server does not yet; use vllm_mode: colocate, or use_vllm: false "
            "(transformers' generate on the training weights)"
        )
    return build_server_backend(
        config, inputs.module, inputs.stops, inputs.longest_prompt(), inputs.dist, inputs.stopping
    )
