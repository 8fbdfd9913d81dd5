"""A hand-written PyTorch training loop over posttrain's own batches: the reference the tests compare
posttrain's steps with and the baseline ``benchmarks/step_time.py`` times.

It reads the same tokenized samples (posttrain's data cache) in the same shard order and does the same
arithmetic as a default posttrain SFT run: decoder layers checkpointed (unless the config turns it off),
torch AdamW with no decay on 1-D parameters, the configured ``transformers`` schedule, gradient clipping,
the loss summed over target tokens divided by the target tokens, read on the host every step. In bfloat16 it
is the standard mixed-precision recipe: bfloat16 weights compute, float32 master weights take the update
(their gradients are the bfloat16 gradients in float32; clipping and AdamW run on them) and are rounded back
into the bfloat16 weights. Nothing of posttrain's engine, loop or loss code is used, so a difference in what
posttrain computes shows up as a different loss. Plain SFT only (no packing, LoRA, sequence parallelism or
accumulation).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class BareRun:
    losses: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)  # ends[0]: before the first step; ends[i]: step i done
    tokens: list[int] = field(default_factory=list)  # input tokens per step


def bare_batches(config: Any, rank: int = 0, world: int = 1) -> Iterator[dict[str, Any]]:
    """The micro-batches posttrain trains on, in its order (``config``: a loaded ``TrainerConfig``)."""
    from torch.utils.data import DataLoader
    from transformers import AutoTokenizer

    from posttrain.context import RunContext
    from posttrain.data.cache import load_datasets
    from posttrain.data.collate import Collator
    from posttrain.data.sampler import ShardSampler
    from posttrain.dist import DistInfo

    tokenizer = AutoTokenizer.from_pretrained(config.model.name_or_path)
    dist = DistInfo(rank=rank, local_rank=rank, world_size=world, device=torch.device("cpu"))
    data = load_datasets(RunContext(config, dist), tokenizer, config.data.max_length)
    sampler = ShardSampler(len(data.train), world, rank, seed=config.data.seed)
    loader = DataLoader(
        data.train,
        batch_size=config.micro_batch_size,
        sampler=sampler,
        collate_fn=Collator(tokenizer.pad_token_id),
    )
    return iter(loader)


def bare_model(config: Any) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        config.model.name_or_path,
        dtype=getattr(torch, config.model.dtype),
        attn_implementation=config.model.attn_implementation,
    )
    model.config.use_cache = False
    if not config.model.disable_activation_checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


class MasterWeights:
    """float32 copies of a 16-bit model's parameters: the optimizer steps them, the model gets them rounded."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.pairs = [(p, p.detach().float().clone()) for p in model.parameters()]
        self.index = {id(p): master for p, master in self.pairs}

    def to_masters(self) -> None:
        for param, master in self.pairs:
            master.grad = None if param.grad is None else param.grad.float()

    def to_model(self) -> None:
        with torch.no_grad():
            for param, master in self.pairs:
                param.copy_(master)
                param.grad = None


def bare_optimizer(model: torch.nn.Module, config: Any, steps: int) -> tuple[Any, Any]:
    from transformers import get_scheduler

    from posttrain.config.scheduler import warmup_steps

    opt = config.optimizer
    masters = MasterWeights(model) if config.model.dtype in ("bfloat16", "float16") else None
    params = [masters.index[id(p)] for p in model.parameters()] if masters else list(model.parameters())
    decay = [p for p in params if p.ndim >= 2]
    rest = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": opt.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps, foreach=True)
    optimizer.masters = masters  # type: ignore[attr-defined]
    warmup = warmup_steps(config.scheduler, steps)
    factor = get_scheduler(config.scheduler.name, optimizer, warmup, steps).lr_lambdas[0]
    # posttrain's documented warmup: the first update runs at peak / warmup, not at 0
    return optimizer, torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: factor(step + 1 if step < warmup else step)
    )


def bare_step(
    model: Any, batch: dict[str, Any], optimizer: Any, scheduler: Any, clip: float, units: float = 0.0
) -> float:
    """One step; the summed loss is divided by ``units`` (default: the batch's target tokens; under
    DistributedDataParallel, which averages over ranks, all ranks' target tokens / world size)."""
    units = units or batch["num_target_tokens"]
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    logits = model(**inputs).logits
    nll = torch.nn.functional.cross_entropy(
        logits[:, :-1].float().flatten(0, 1),
        batch["labels"][:, 1:].flatten(),
        ignore_index=-100,
        reduction="sum",
    )
    (nll / units).backward()
    masters = getattr(optimizer, "masters", None)
    if masters is not None:
        masters.to_masters()
    if clip > 0:
        params = [master for _, master in masters.pairs] if masters is not None else model.parameters()
        torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    if masters is not None:
        masters.to_model()
    return float(nll.detach()) / units


def bare_loop(config: Any, steps: int) -> BareRun:
    """``steps`` optimizer steps of one micro-batch each, one process."""
    batches = bare_batches(config)
    model = bare_model(config)
    optimizer, scheduler = bare_optimizer(model, config, steps)
    clip = float(config.deepspeed.get("gradient_clipping", 1.0))
    run = BareRun(ends=[time.time()])
    for batch in itertools.islice(batches, steps):
        run.losses.append(bare_step(model, batch, optimizer, scheduler, clip))
        run.tokens.append(batch["num_input_tokens"])
        run.ends.append(time.time())
    return run
