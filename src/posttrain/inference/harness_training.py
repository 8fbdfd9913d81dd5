"""``harness:``: lm-evaluation-harness tasks on the model being trained, after every ``interval`` optimizer steps
and at the end, through the harness's own API (``simple_evaluate`` on its transformers model class, handed the
training model itself: nothing is saved or loaded). An :class:`~posttrain.training.extras.Evaluator`: the loop
adds its entries to the step's record.

- Entries: ``eval/<task>/<metric>`` (the harness's metric, with its filter when it is not ``none``:
  ``eval/gsm8k/exact_match/strict-match``), their standard errors left out, and ``time_harness``, the
  seconds the evaluation took (every rank waits for it).
- Where: rank 0 evaluates while the others wait; under ZeRO-3 every rank runs the same evaluation in step
  (each forward gathers the layers from every rank), rank 0's results written.
- The tasks are looked up when the run starts (an unknown task with the close names, a local YAML that does not
  parse, a Hub dataset while offline: one line, exit 2, before the first step).
- Generation (``generate_until`` tasks) goes through the run's vLLM engine when it has one (colocated or its
  servers, given the current weights first), else transformers' ``generate`` on the training model.
- The training's random generators are left as they were (the harness seeds the process's own), so a run
  with the harness trains exactly as the run without it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from posttrain.dist import barrier, kept_random_state
from posttrain.errors import UserError
from posttrain.inference.harness import task_manager
from posttrain.training.steps import SideGeneration


def metrics_of(results: dict[str, Any]) -> dict[str, float]:
    """The harness's results as record entries: ``eval/<task>/<metric>[/<filter>]`` (numbers only, no
    standard errors)."""
    out: dict[str, float] = {}
    for task, values in (results.get("results") or {}).items():
        for key, value in values.items():
            metric, _, kept = key.partition(",")
            if metric.endswith("_stderr") or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            out[f"eval/{task}/{metric}" + (f"/{kept}" if kept and kept != "none" else "")] = float(value)
    return out


class HarnessEvaluator:
    """The ``harness:`` block's tasks (see the module docstring)."""

    def __init__(
        self,
        config: Any,
        tokenizer: Any,
        dist: Any,
        everywhere: bool,
        generation: SideGeneration | None = None,
    ) -> None:
        from posttrain.vision.processor import processor_of

        if processor_of(tokenizer) is not None:
            raise UserError(
                "harness: tasks during the training of a vision-language model are not supported yet; evaluate "
                "its export with posttrain eval (the harness's hf-multimodal model)"
            )
        include = Path(config.include_path) if config.include_path else None
        self.manager = task_manager(config.tasks, include, [], ("harness.tasks", "harness.include_path"))
        self.config, self.tokenizer, self.dist, self.everywhere = config, tokenizer, dist, everywhere
        self.generation = generation  # the run's engine with weights of its own (``feed.EngineGeneration``)
        self.last = -1
        self.generated = 0  # prompts generated through the run's engine

    def due(self, step: int, end: bool) -> bool:
        if step == self.last:  # the last step was just evaluated
            return False
        if end:
            return bool(self.config.at_end)
        return bool(self.config.interval) and step % self.config.interval == 0

    def evaluate(self, module: torch.nn.Module, step: int) -> dict[str, Any]:
        self.last = step
        started = time.perf_counter()
        results: dict[str, Any] = {}
        if self.generation is not None:  # every rank: the engine given the current weights
            self.generation.prepare(module)
        if self.dist.is_main or self.everywhere:
            with kept_random_state():
                results = self._run(module)
        barrier(self.dist)
        record: dict[str, Any] = metrics_of(results) if self.dist.is_main else {}
        record["time_harness"] = time.perf_counter() - started
        return record

    def _run(self, module: torch.nn.Module) -> dict[str, Any]:
        import logging

        from lm_eval import simple_evaluate
        from lm_eval.models.huggingface import HFLM

        from posttrain.models.token_logps import unwrap

        model = unwrap(module)
        training = model.training
        model.eval()
        quiet = logging.getLogger("lm_eval")
        level = quiet.level
        quiet.setLevel(logging.ERROR)  # "pretrained is not a str", per evaluation
        try:
            lm = run_model(HFLM, self)(
                pretrained=model, tokenizer=self.tokenizer, batch_size=self.config.batch_size
            )
            limit = self.config.limit
            results = simple_evaluate(
                model=lm,
                tasks=list(self.config.tasks),
                num_fewshot=self.config.num_fewshot,
                limit=limit if limit is None or limit < 1 else int(limit),
                task_manager=self.manager,
                apply_chat_template=self.config.apply_chat_template,
                log_samples=False,
            )
        finally:
            quiet.setLevel(level)
            model.train(training)
        return results or {}

    def describe(self) -> str:
        every = f"every {self.config.interval} steps" if self.config.interval else ""
        when = " and ".join(w for w in (every, "at the end" if self.config.at_end else "") if w) or "never"
        where = "every rank in step (ZeRO-3)" if self.everywhere else "rank 0"
        through = ", generating through the run's vLLM engine" if self.generation is not None else ""
        return f"harness: {', '.join(self.config.tasks)} {when}, on {where}{through}, logged as eval/<task>/<metric>"

    def close(self) -> None:
        pass


def run_model(base: Any, evaluator: HarnessEvaluator) -> Any:
    """The harness's transformers model class (``base``), its generations sent to the run's vLLM engine when
    the run has one: the prompts' tokens (padding dropped) go to the engine, greedy, and come back after the
    padded prompts as transformers' ``generate`` returns them; the harness cuts them at its stop strings."""
    if evaluator.generation is None:
        return base

    class RunEngineLM(base):  # type: ignore[misc,valid-type]
        def _model_generate(self, context: Any, max_length: int, stop: list[str], **kwargs: Any) -> Any:
            mask = kwargs.get("attention_mask")
            pairs = zip(context, context if mask is None else mask, strict=True)
            rows = [row.tolist() if mask is None else row[keep.bool()].tolist() for row, keep in pairs]
            made = evaluator.generation.generate(rows, max(max_length - context.shape[1], 1))
            evaluator.generated += len(rows)
            pad = self.tokenizer.pad_token_id
            pad = self.tokenizer.eos_token_id if pad is None else pad
            width = max(len(ids) for ids in made)
            tails = [ids + [pad] * (width - len(ids)) for ids in made]
            return torch.cat([context.cpu(), torch.tensor(tails, dtype=context.dtype)], dim=1)

    return RunEngineLM


def evaluators_for(
    config: Any,
    module: torch.nn.Module,
    tokenizer: Any,
    dist: Any,
    generation: SideGeneration | None = None,
) -> list[HarnessEvaluator]:
    """The run's evaluators beside its method's own evaluation: the ``harness:`` block's, when there is one
    (``generation``: the run's engine with weights of its own, which its generations go through)."""
    if config.harness is None:
        return []
    zero3 = any(hasattr(p, "ds_id") for p in module.parameters())
    return [HarnessEvaluator(config.harness, tokenizer, dist, zero3, generation)]
