"""The vLLM backend (``use_vllm: true``): vLLM colocated in every training process, on its GPU, written against
vLLM's documented offline API (``vllm.LLM`` with ``distributed_executor_backend="external_launcher"``, as TRL's
colocate mode runs it). Not measured yet: no GPU has run it (``tests/gpu/test_grpo_vllm_gpu.py`` is ready).

- Each training process holds one engine over its GPU (tensor parallel size 1) sized by
  ``vllm_gpu_memory_utilization``; prompts go in as token ids, one request per completion with the
  completion's own key as the request's seed, so draws are per completion as with ``transformers``.
- After every optimizer update the weights are pushed in process (``load_weights`` on vLLM's model): under
  ZeRO-3 every parameter gathered first, PEFT adapters merged for the push and unmerged after, a
  ``modules_to_save`` module's trained copy under its own name (``named_weights``, tested without vLLM).
- With ``vllm_enable_sleep_mode`` the engine sleeps (weights and KV cache released) while the model trains and
  wakes for generation.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from posttrain.errors import UserError
from posttrain.methods.grpo.generation import Completions, Sampling


class VLLMBackend:
    name = "vllm"

    def __init__(self, config: Any, module: torch.nn.Module, stop_ids: Sequence[int], pad_id: int) -> None:
        from vllm import LLM

        self.stop_ids, self.pad_id, self.config = list(stop_ids), pad_id, config
        longest = config.data.max_length + config.max_completion_length
        self.llm = LLM(
            model=config.model.name_or_path,
            tokenizer=config.tokenizer.name_or_path or config.model.name_or_path,
            dtype=config.model.dtype if config.model.dtype != "auto" else "auto",
            tensor_parallel_size=1,
            gpu_memory_utilization=config.vllm_gpu_memory_utilization,
            max_model_len=longest,
            distributed_executor_backend="external_launcher",
            enable_sleep_mode=config.vllm_enable_sleep_mode,
            seed=config.seed,
            trust_remote_code=config.model.trust_remote_code,
        )
        self.stale = True  # the training weights have not been pushed yet
        self.sync_weights(module)
        self._sleep()

    def generate(
        self,
        module: torch.nn.Module,
        prompts: Sequence[Sequence[int]],
        sampling: Sampling,
        keys: list[int] | None,
    ) -> Completions:
        from vllm import SamplingParams

        self._wake()
        if self.stale:
            self.sync_weights(module)
        requests = [{"prompt_token_ids": list(prompt)} for prompt in prompts]
        params = [
            SamplingParams(
                n=1,
                temperature=sampling.temperature if keys is not None else 0.0,
                top_p=sampling.top_p,
                top_k=sampling.top_k or -1,
                repetition_penalty=sampling.repetition_penalty,
                max_tokens=sampling.max_new_tokens,
                stop_token_ids=self.stop_ids,
                seed=None if keys is None else keys[index] % (2**31),
            )
            for index in range(len(prompts))
        ]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        self._sleep()
        ids, truncated = [], []
        for output in outputs:
            tokens = list(output.outputs[0].token_ids)
            ids.append(tokens)
            truncated.append(not tokens or tokens[-1] not in self.stop_ids)
        return Completions(ids, truncated)

    def sync_weights(self, module: torch.nn.Module) -> None:
        """Push the training weights into vLLM's model (marked stale after every update by the rollout)."""
        self._wake(tags=["weights"])
        model = self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        for name, tensor in named_weights(module):
            model.load_weights([(name, tensor)])
        self.stale = False

    def mark_stale(self) -> None:
        self.stale = True

    def _sleep(self) -> None:
        if self.config.vllm_enable_sleep_mode:
            self.llm.sleep(level=1)

    def _wake(self, tags: list[str] | None = None) -> None:
        if self.config.vllm_enable_sleep_mode:
            self.llm.wake_up(tags=tags)

    def close(self) -> None:
        del self.llm


def named_weights(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's weights under the names of the checkpoint vLLM loaded: LoRA adapters merged in (their own
    weights not pushed), PEFT's prefixes and ``base_layer`` removed, a ``modules_to_save`` module's trained
    copy under the module's own name (its ``original_module`` is not pushed). Under ZeRO-3 every parameter is
    gathered first, so that the adapters merge into whole weights."""
    import contextlib

    partitioned = [p for p in module.parameters() if hasattr(p, "ds_id")]
    gathered: Any = contextlib.nullcontext()
    if partitioned:
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(partitioned)
    peft = hasattr(module, "merge_adapter")
    with gathered:
        if peft:
            module.merge_adapter()
        try:
            for name, param in module.named_parameters():
                if peft and ("lora_" in name or ".original_module." in name):
                    continue
                clean = name.removeprefix("base_model.model.").replace(".base_layer", "")
                yield clean.replace(".modules_to_save.default", ""), param.data
        finally:
            if peft:
                module.unmerge_adapter()


def build_vllm_backend(config: Any, module: torch.nn.Module, stop_ids: Sequence[int], pad_id: int) -> Any:
    """The vLLM backend, or one line saying why it cannot run here (no vLLM, no GPU)."""
    if not torch.cuda.is_available():
        raise UserError(
            "use_vllm: true needs a CUDA GPU (vLLM generates on the training GPUs); set use_vllm: false"
        )
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise UserError(
            "use_vllm: true needs vLLM: pip install 'posttrain[vllm]' (a vLLM built for your CUDA and torch); or "
            "set use_vllm: false to generate with transformers"
        ) from None
    return VLLMBackend(config, module, stop_ids, pad_id)
