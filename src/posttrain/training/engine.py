"""The narrow DeepSpeed adapter: wrap, forward, backward, step, grad norm. The loop never imports deepspeed."""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class RankState(Protocol):
    """Model state a feature keeps per rank beside DeepSpeed's checkpoint (expert-parallel experts: DeepSpeed's
    model file holds rank 0's only)."""

    def save(self, module: torch.nn.Module, directory: str) -> None: ...

    def load(self, module: torch.nn.Module, directory: str) -> None: ...


@dataclass(frozen=True)
class EngineFeatures:
    """What the model's features ask of the engine; handed in by the model stage, so that the engine knows
    no feature itself.

    ``zero3_leaves``: module classes ZeRO-3 must gather whole and hook nothing inside (compiled blocks).
    ``local_group`` / ``is_local``: parameters that differ across the ranks of a process group (expert-parallel
    experts); their share of the gradient norm is summed over it. ``rank_state``: saved and loaded per rank
    with every checkpoint."""

    zero3_leaves: tuple[type, ...] = ()
    local_group: Any = None
    is_local: Callable[[torch.nn.Parameter], bool] | None = None
    rank_state: RankState | None = None


class Engine:
    """Owns the DeepSpeed engine built from the model, a client optimizer and scheduler, and a config dict.

    Gradient accumulation is driven by the loop: it marks the last micro-batch of each optimizer step as the
    accumulation boundary, so a short last step of an epoch is handled exactly, and it scales each
    micro-batch loss itself (``backward`` does not divide by the accumulation steps again).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        ds_config: dict[str, Any],
        features: EngineFeatures | None = None,
    ) -> None:
        import deepspeed

        self.features = features or EngineFeatures()

        # Plain fp32 without ZeRO: DeepSpeed would clip with a per-parameter norm loop and an all-reduce of the
        # norm, and report no norm; here one foreach pass computes the norm (reduced as DeepSpeed reduces it,
        # so the rounding is the same) and another scales the gradients.
        stage = ds_config.get("zero_optimization", {}).get("stage", 0)
        half = any(ds_config.get(key, {}).get("enabled") for key in ("bf16", "bfloat16", "fp16"))
        self._own_norm = stage == 0 and not half
        self._clip = float(ds_config.get("gradient_clipping", 0.0)) if self._own_norm else 0.0
        if self._own_norm:
            ds_config = {**ds_config, "gradient_clipping": 0.0}
        if stage == 3 and self.features.zero3_leaves:
            from deepspeed.utils import set_z3_leaf_modules

            set_z3_leaf_modules(model, list(self.features.zero3_leaves))
        self.ds, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
        )
        unsharded = stage == 0 or type(self.optimizer).__name__ == "BF16_Optimizer"
        if unsharded and self.ds.dp_world_size == 1:
            # One process, unsharded: DeepSpeed's boundary all-reduce would flatten every gradient, reduce it
            # over a group of one and copy it back, for nothing (BF16_Optimizer still moves each micro-batch's
            # gradients into its float32 buffer before it).
            self.ds.enable_backward_allreduce = False
        self._params = [p for p in self.ds.module.parameters() if p.requires_grad]
        self._norm: torch.Tensor | None = None

    @property
    def module(self) -> torch.nn.Module:
        return self.ds.module

    @property
    def device(self) -> torch.device:
        return self.ds.device

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.ds(*args, **kwargs)

    def micro_step(self, loss: torch.Tensor, last: bool, timers: Any = None) -> None:
        """Backward one micro-batch; on the last one of the step, reduce gradients, clip and step.
        ``timers`` (optional, ``tracking.system.Timers``) gets the ``backward`` and ``optimizer`` time."""
        backward = timers.section("backward") if timers is not None else nullcontext()
        with backward:
            self.ds.set_gradient_accumulation_boundary(last)
            self.ds.backward(loss, scale_wrt_gas=False)  # at the boundary this also averages over ranks
        optimizer = timers.section("optimizer") if timers is not None and last else nullcontext()
        with optimizer:
            if last and self._own_norm:
                self._norm = self._clip_own()
            self.ds.step()

    def _clip_own(self) -> torch.Tensor | None:
        params = [p for p in self._params if p.grad is not None]
        if not params:
            return None
        # the sum of squared per-tensor norms, as DeepSpeed's clipping reduces them (same rounding)
        is_local = self.features.is_local or (lambda _: False)
        shared = [p.grad for p in params if not is_local(p)]
        norm = torch.stack(torch._foreach_norm(shared)).pow(2).sum()
        local = [p.grad for p in params if is_local(p)]
        if local:  # each rank holds other parameters: their share of the norm is summed over the group
            import torch.distributed as dist

            part = torch.stack(torch._foreach_norm(local)).pow(2).sum()
            dist.all_reduce(part, group=self.features.local_group)
            norm = norm + part
        norm = norm.pow(0.5)
        if self._clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self._clip, norm, foreach=True)
        return norm

    def grad_norm(self) -> float:
        """Global gradient norm of the last optimizer step, before clipping."""
        norm = self._norm if self._own_norm else self.ds.get_global_grad_norm()
        if norm is None:
            return float("nan")
        return float(norm.item() if isinstance(norm, torch.Tensor) else norm)

    def save_state(self, directory: str, tag: str) -> None:
        """Model and optimizer (sharded as ZeRO holds them) and scheduler into ``directory/tag`` (all ranks),
        and the features' per-rank state."""
        self.ds.save_checkpoint(directory, tag=tag, save_latest=False)
        if self.features.rank_state is not None:
            self.features.rank_state.save(self.ds.module, os.path.join(directory, tag))

    def load_state(self, directory: str, tag: str) -> bool:
        """Restore what :meth:`save_state` wrote; False when DeepSpeed found nothing to load. The schedule
        stays the config's: the checkpoint gives its step, not its learning rates (:func:`follow_schedule`)."""
        configured = list(getattr(self.scheduler, "base_lrs", []))
        path, _ = self.ds.load_checkpoint(
            directory, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if path is not None and self.features.rank_state is not None:
            self.features.rank_state.load(self.ds.module, os.path.join(directory, tag))
        if path is not None and configured:
            follow_schedule(self.optimizer, self.scheduler, configured)
        return path is not None

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def train(self, mode: bool = True) -> None:
        self.ds.train(mode)


def follow_schedule(optimizer: Any, scheduler: Any, configured: list[float]) -> None:
    """After a resume, the config's learning rates at the checkpoint's step: a scheduler restores the base
    rates it was saved with, so a changed ``optimizer.lr`` would otherwise be ignored (said in one line)."""
    from posttrain.logs import say

    saved = list(scheduler.base_lrs)
    scheduler.base_lrs = list(configured)
    for group, base in zip(optimizer.param_groups, configured, strict=False):
        group["initial_lr"] = base
    if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        now = [
            base * factor(scheduler.last_epoch)
            for base, factor in zip(configured, scheduler.lr_lambdas, strict=True)
        ]
    else:
        now = list(scheduler.get_lr())
    for group, value in zip(optimizer.param_groups, now, strict=False):
        group["lr"] = value
    scheduler._last_lr = list(now)
    if any(abs(a - b) > 1e-12 * max(abs(a), abs(b), 1e-30) for a, b in zip(saved, configured, strict=False)):
        say(
            f"resume: the config's learning rate ({configured[0]:g}) differs from the checkpoint's ({saved[0]:g}); "
            f"the config's schedule goes on from step {scheduler.last_epoch} (lr {now[0]:g})"
        )
