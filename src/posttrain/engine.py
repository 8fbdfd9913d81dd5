"""The narrow DeepSpeed adapter: wrap, forward, backward, step, grad norm. The loop never imports deepspeed."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch


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
    ) -> None:
        import deepspeed

        self.ds, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
        )
        # DeepSpeed reports the gradient norm except for plain fp32 without ZeRO; then it is computed here.
        self._own_norm = self.ds.zero_optimization_stage() == 0 and not (
            self.ds.bfloat16_enabled() or self.ds.fp16_enabled()
        )
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
                grads = [p.grad for p in self.ds.module.parameters() if p.grad is not None]
                self._norm = torch.nn.utils.get_total_norm(grads) if grads else None
            self.ds.step()

    def grad_norm(self) -> float:
        """Global gradient norm of the last optimizer step, before clipping."""
        norm = self._norm if self._own_norm else self.ds.get_global_grad_norm()
        if norm is None:
            return float("nan")
        return float(norm.item() if isinstance(norm, torch.Tensor) else norm)

    def save_state(self, directory: str, tag: str) -> None:
        """Model and optimizer (sharded as ZeRO holds them) and scheduler into ``directory/tag`` (all ranks)."""
        self.ds.save_checkpoint(directory, tag=tag, save_latest=False)

    def load_state(self, directory: str, tag: str) -> bool:
        """Restore what :meth:`save_state` wrote; False when DeepSpeed found nothing to load."""
        path, _ = self.ds.load_checkpoint(
            directory, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        return path is not None

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def train(self, mode: bool = True) -> None:
        self.ds.train(mode)
