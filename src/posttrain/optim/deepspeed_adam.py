"""Optimizers ``cpu_adam``, ``fused_adam`` and ``fused_adam_moe``: DeepSpeed's own Adam kernels
(ArcticTraining's names).

``cpu_adam`` steps on the host, for ZeRO optimizer offload (``deepspeed.zero_optimization.offload_optimizer``
with ``device: cpu``): the optimizer state lives in host memory and the step runs there, vectorised.
``fused_adam`` is one fused kernel over all parameters on the accelerator. Both are AdamW (decoupled weight
decay) with the same parameter groups as ``adamw``, and both compile their op the first time they are used
(about 80 s on a 2-core machine; cached in ``TORCH_EXTENSIONS_DIR``). ``fused_adam_moe`` is ArcticTraining's
name for ``fused_adam`` with the expert weights in parameter groups of their own; every posttrain optimizer
gets those groups (``optim.adamw.param_groups``), so it is ``fused_adam``.
"""

from __future__ import annotations

import torch

from posttrain.config.optimizer import OptimizerConfig
from posttrain.context import RunContext
from posttrain.optim.adamw import adam_arguments
from posttrain.utils.ops import deepspeed_op_build


def build_cpu_adam(config: OptimizerConfig, model: torch.nn.Module, ctx: RunContext) -> torch.optim.Optimizer:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    groups, hyper = adam_arguments(config, model)
    with deepspeed_op_build("cpu_adam"):
        return DeepSpeedCPUAdam(groups, **hyper, adamw_mode=True)


def build_fused_adam(
    config: OptimizerConfig, model: torch.nn.Module, ctx: RunContext
) -> torch.optim.Optimizer:
    from deepspeed.ops.adam import FusedAdam

    groups, hyper = adam_arguments(config, model)
    with deepspeed_op_build("fused_adam"):
        return FusedAdam(groups, **hyper, adam_w_mode=True)
