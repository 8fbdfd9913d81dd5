"""Online micro-batches joined into one row (``padding_free``, the default) against padded rows: the policy's
forward and backward over GRPO-shaped micro-batches whose completions have a long tail.

    python benchmarks/online_padding_free.py                  # 16 completions a micro-batch, 8 micro-batches
    python benchmarks/online_padding_free.py --median 512 --max-length 8192

Completion lengths are drawn log-normal (median ``--median`` tokens, sigma ``--sigma``, cut at ``--max-length``)
behind prompts of 20 to 60 tokens, as generated batches have them; both layouts run the same micro-batches
(``rollout.feed.training_micro_batches``) through ``token_logps`` and a backward of the policy-gradient sum.
Prints the real tokens per second of each and the ratio, measured in the same process; the losses agree.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch


def batches(args: argparse.Namespace, join: bool) -> list[dict]:
    from posttrain.generation.types import Completions
    from posttrain.rollout.feed import training_micro_batches

    generator = torch.Generator().manual_seed(0)
    count = args.micro * args.batches
    lengths = torch.exp(torch.randn(count, generator=generator) * args.sigma) * args.median
    lengths = lengths.clamp(1, args.max_length).long().tolist()
    prompts = [
        torch.randint(5, 1000, (int(n),), generator=generator).tolist()
        for n in torch.randint(20, 61, (count,), generator=generator)
    ]
    ids = [torch.randint(5, 1000, (n,), generator=generator).tolist() for n in lengths]
    values = {"advantages": torch.randn(count, generator=generator)}
    return training_micro_batches(
        prompts, Completions(ids, [False] * count), values, args.micro, 0, False, join
    )


def run(model: torch.nn.Module, micro_batches: list[dict]) -> tuple[float, float, int]:
    from posttrain.models.token_logps import token_logps

    total, tokens = 0.0, 0
    start = time.perf_counter()
    for batch in micro_batches:
        logps, _ = token_logps(model, batch, "auto", 1.0)
        mask = batch["completion_mask"]
        loss = -(logps * mask * batch["advantages"][:, None]).sum() / mask.sum()
        loss.backward()
        total += float(loss.detach())
        tokens += int(batch["attention_mask"].sum())
    return time.perf_counter() - start, total, tokens


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--micro", type=int, default=16, help="completions a micro-batch")
    parser.add_argument("--batches", type=int, default=8, help="micro-batches")
    parser.add_argument("--median", type=float, default=128.0, help="median completion length")
    parser.add_argument("--sigma", type=float, default=1.0, help="log-normal spread of completion lengths")
    parser.add_argument("--max-length", type=int, default=2048, help="max_completion_length")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    from posttrain.models.document_attention import use_document_attention
    from posttrain.tiny_model import write_tiny_model

    torch.manual_seed(0)
    path = write_tiny_model(
        tempfile.mkdtemp() + "/model", hidden_size=args.hidden, layers=args.layers, heads=4, vocab_size=2048
    )
    # the padded run's model as padding_free: false loads it (plain sdpa), the joined run's as the default does
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert use_document_attention(model) == ""
    padded, joined = batches(args, False), batches(args, True)
    found = {}
    for name, policy, micro_batches in (("padded", plain, padded), ("joined", model, joined)):
        run(policy, micro_batches[:1])  # warm-up
        policy.zero_grad()
        found[name] = run(policy, micro_batches)
    lengths = [int(b["completion_mask"].sum(1).max()) for b in padded]
    real = found["padded"][2]
    grid = sum(b["input_ids"].numel() for b in padded)
    print(
        f"{args.batches} micro-batches of {args.micro} completions (median {args.median:.0f} tokens, sigma "
        f"{args.sigma}, cut at {args.max_length}; longest per micro-batch {min(lengths)}-{max(lengths)}), "
        f"width {args.hidden}, {args.layers} layers, {torch.get_num_threads()} threads"
    )
    print(f"real tokens {real:,}, padded grid {grid:,} ({real / grid:.1%} real)")
    for name, (seconds, loss, tokens) in found.items():
        print(f"{name:>7}: {seconds:7.2f} s, {tokens / seconds:9,.0f} real tokens/s, loss sum {loss:+.6f}")
    print(f"joined / padded tokens/s: {found['padded'][0] / found['joined'][0]:.2f}x")


if __name__ == "__main__":
    main()
