"""The narrow DeepSpeed adapter: wrap, forward, backward, step, grad norm. The loop never imports deepspeed."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from posttrain.models.compile import compiled_block_classes
from posttrain.models.expert_parallel import expert_group_name, installed_layout


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

        # Plain fp32 without ZeRO: DeepSpeed would clip with a per-parameter norm loop and an all-reduce of the
        # norm, and report no norm; here one foreach pass computes the norm (reduced as DeepSpeed reduces it,
        # so the rounding is the same) and another scales the gradients.
        stage = ds_config.get("zero_optimization", {}).get("stage", 0)
        half = any(ds_config.get(key, {}).get("enabled") for key in ("bf16", "bfloat16", "fp16"))
        self._own_norm = stage == 0 and not half
        self._clip = float(ds_config.get("gradient_clipping", 0.0)) if self._own_norm else 0.0
        if self._own_norm:
            ds_config = {**ds_config, "gradient_clipping": 0.0}
        compiled = compiled_block_classes(model)
        if stage == 3 and compiled:
            from deepspeed.utils import set_z3_leaf_modules

            set_z3_leaf_modules(model, compiled)  # no ZeRO-3 hooks inside a compiled block
        self.ds, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
        )
        if stage == 0 and self.ds.dp_world_size == 1:
            # One process, unsharded: DeepSpeed's boundary all-reduce would flatten every gradient, reduce it
            # over a group of one and copy it back, for nothing.
            self.ds.enable_backward_allreduce = False
        self._params = [p for p in self.ds.module.parameters() if p.requires_grad]
        # expert parallelism: each rank holds other experts, so their share of the norm is summed over the group
        self._experts = installed_layout(model)
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
        shared = [p.grad for p in params if expert_group_name(p) is None]
        norm = torch.stack(torch._foreach_norm(shared)).pow(2).sum()
        local = [p.grad for p in params if expert_group_name(p) is not None]
        if local and self._experts is not None:
            import torch.distributed as dist

            experts = torch.stack(torch._foreach_norm(local)).pow(2).sum()
            dist.all_reduce(experts, group=self._experts.group)
            norm = norm + experts
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
        """Model and optimizer (sharded as ZeRO holds them) and scheduler into ``directory/tag`` (all ranks).
        With expert parallelism every rank also writes its experts' weights (DeepSpeed's model file holds
        rank 0's only; the optimizer state is per expert-parallel rank already)."""
        self.ds.save_checkpoint(directory, tag=tag, save_latest=False)
        if self._experts is not None:
            weights = {name: param.detach() for name, param in self._expert_weights().items()}
            torch.save(weights, self._experts_file(directory, tag))

    def load_state(self, directory: str, tag: str) -> bool:
        """Restore what :meth:`save_state` wrote; False when DeepSpeed found nothing to load."""
        path, _ = self.ds.load_checkpoint(
            directory, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if path is not None and self._experts is not None:
            saved = torch.load(self._experts_file(directory, tag), map_location="cpu", weights_only=True)
            with torch.no_grad():
                for name, param in self._expert_weights().items():
                    param.copy_(saved[name])
        return path is not None

    def _expert_weights(self) -> dict[str, torch.Tensor]:
        """This rank's expert weights by name."""
        return {n: p for n, p in self.ds.module.named_parameters() if expert_group_name(p) is not None}

    def _experts_file(self, directory: str, tag: str) -> str:
        import os

        import torch.distributed as dist

        return os.path.join(directory, tag, f"experts_rank{dist.get_rank()}.pt")

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def train(self, mode: bool = True) -> None:
        self.ds.train(mode)
