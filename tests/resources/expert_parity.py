"""Run under torchrun with 2 processes: for every MoE family, the expert-parallel (EP=2) model against an
unsharded copy on each rank's own tokens. Prints one JSON line per family from rank 0: the largest output
difference, the largest gradient difference (expert gradients gathered over the group and compared with the
sum of both ranks' unsharded gradients, the rest with the rank's own) and whether the gathered expert weights
equal the unsharded ones."""

import copy
import json
import sys

import torch
import torch.distributed as dist

from posttrain.dist import exit_launched_rank, init_distributed
from posttrain.models.expert_parallel import (
    expert_group_name,
    full_experts,
    gather_experts,
    install_expert_parallel,
)
from posttrain.tiny_model import build_model

rank = init_distributed().rank  # gloo, as posttrain runs start it (no DeepSpeed op compiled)
for arch in sys.argv[1:]:
    model = build_model(300, arch=arch, hidden_size=32, layers=2, experts=8, seed=3)
    if arch == "gpt_oss":
        model.config._attn_implementation = "eager"
    reference = copy.deepcopy(model)
    tokens = torch.randint(0, 300, (2, 10), generator=torch.Generator().manual_seed(100 + rank))
    expected = reference(input_ids=tokens).logits
    expected.pow(2).mean().backward()
    layout = install_expert_parallel(model, 2, 8)
    got = model(input_ids=tokens).logits
    got.pow(2).mean().backward()
    wanted = dict(reference.named_parameters())
    grad_diff, sharded = 0.0, 0
    for name, param in model.named_parameters():
        grad, want = param.grad, wanted[name].grad.clone()
        if expert_group_name(param) is not None:
            sharded += 1
            grad = gather_experts(grad, layout)
            dist.all_reduce(want)  # an expert's gradient comes from both ranks' tokens
        grad_diff = max(grad_diff, float((grad - want).abs().max()))
    with full_experts(model):
        same_weights = all(torch.equal(p, wanted[n]) for n, p in model.named_parameters())
        shapes = all(p.shape == wanted[n].shape for n, p in model.named_parameters())
    restored = all(p.shape[0] == 4 for p in model.parameters() if expert_group_name(p) is not None)
    report = {
        "arch": arch,
        "output_diff": float((got - expected).abs().max()),
        "grad_diff": grad_diff,
        "sharded_weights": sharded,
        "same_weights": same_weights and shapes,
        "shards_restored": restored,
    }
    if rank == 0:
        print(json.dumps(report), flush=True)

exit_launched_rank()  # as `posttrain train` ends a launched rank: no abort in the interpreter's teardown
