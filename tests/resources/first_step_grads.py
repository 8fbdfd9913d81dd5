"""Run each config for its steps and record the first optimizer step's loss, the full gradient of every
trainable parameter at that step (before clipping and the optimizer), and the last eval loss.

Usage: first_step_grads.py OUT.pt NAME=CONFIG.yaml [...]. Every rank takes part in gathering the
gradients (ZeRO partitions them); rank 0 writes OUT.pt, with its own counts of sequence-parallel
attention calls, of micro-batch slices without labels and of expert-parallel layer calls (proof that the
feature ran). Expert-parallel gradients are gathered over the experts' group into the full tensor.
"""

import os
import sys

import torch
from deepspeed.utils import safe_get_full_grad

from posttrain.config import load_config
from posttrain.dist import exit_launched_rank
from posttrain.models import expert_parallel, sequence_parallel
from posttrain.models.expert_parallel import expert_group_name, gather_experts, installed_layout
from posttrain.run import run
from posttrain.training.engine import Engine

captured: dict = {}
plain_micro_step = Engine.micro_step
plain_clip_own = Engine._clip_own


def full_grad(param: torch.nn.Parameter, layout: object) -> torch.Tensor:
    grad = safe_get_full_grad(param).detach()
    if expert_group_name(param) is not None:  # this rank's experts: gather every rank's block
        grad = gather_experts(grad, layout)
    return grad.float().cpu().clone()


def capture(engine: Engine) -> None:
    if "grads" not in captured:
        layout = installed_layout(engine.ds.module)
        captured["grads"] = {
            name: full_grad(param, layout)
            for name, param in engine.ds.module.named_parameters()
            if param.requires_grad
        }


def clip_own(self: Engine) -> object:
    capture(self)  # posttrain clips unsharded fp32 gradients itself, before DeepSpeed's step
    return plain_clip_own(self)


def micro_step(self: Engine, loss: torch.Tensor, last: bool, timers: object = None) -> None:
    if last and "grads" not in captured:
        real_step = self.ds.step

        def step(*args: object, **kwargs: object) -> object:
            capture(self)
            del self.ds.step
            return real_step(*args, **kwargs)

        self.ds.step = step
    plain_micro_step(self, loss, last, timers)


Engine._clip_own = clip_own
Engine.micro_step = micro_step
counts = {"sp_attention_calls": 0, "slices_without_labels": 0, "sharded_expert_calls": 0}
plain_fit_batch = sequence_parallel._fit_batch
plain_slice = sequence_parallel.SequenceSlicer.__call__


def fit_batch(attention: object, batch_size: int) -> None:
    counts["sp_attention_calls"] += 1
    plain_fit_batch(attention, batch_size)


def slice_batch(self: object, samples: list) -> dict:
    batch = plain_slice(self, samples)
    counts["slices_without_labels"] += batch["num_target_tokens"] == 0
    return batch


plain_sharded_forward = expert_parallel.sharded_forward


def sharded_forward(*args: object) -> torch.Tensor:
    counts["sharded_expert_calls"] += 1
    return plain_sharded_forward(*args)


expert_parallel.sharded_forward = sharded_forward
sequence_parallel._fit_batch = fit_batch
sequence_parallel.SequenceSlicer.__call__ = slice_batch
results = {}
for spec in sys.argv[2:]:
    name, path = spec.split("=", 1)
    captured.clear()
    counts.update(sp_attention_calls=0, slices_without_labels=0, sharded_expert_calls=0)
    history = run(load_config(path)).state.history
    evals = [record["eval_loss"] for record in history if "eval_loss" in record]
    results[name] = {
        "loss": history[0]["loss"],
        "losses": [record["loss"] for record in history if "loss" in record],
        "eval_loss": evals[-1] if evals else None,
        "grads": captured["grads"],
        **counts,
    }
if int(os.environ.get("RANK", "0")) == 0:
    torch.save(results, sys.argv[1])
exit_launched_rank()  # as `posttrain train` ends a launched rank: no abort in the interpreter's teardown
