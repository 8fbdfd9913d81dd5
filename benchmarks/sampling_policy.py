"""What the policy under truncation costs the loss (``models/sampling_policy.py``): grpo's per-token
log-probabilities, forward and backward, on a LLaMA built here, with the sampler replayed (``top_k``/``top_p``,
``min_p``, a repetition penalty, all of them) against the plain distribution measured in the same run, on the
plain head and the tiled one. Prints the median seconds per call and the ratio to the plain distribution's.

    python benchmarks/sampling_policy.py [--rows 8] [--tokens 512] [--vocab 32768] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from posttrain.data.samples import IGNORE_INDEX
from posttrain.models.sampling_policy import SamplingPolicy
from posttrain.models.token_logps import token_logps
from posttrain.tiny_model import build_model

SETTINGS = {
    "plain distribution": None,
    "top_k 50, top_p 0.9": SamplingPolicy(top_k=50, top_p=0.9),
    "min_p 0.05": SamplingPolicy(min_p=0.05),
    "repetition_penalty 1.1": SamplingPolicy(repetition_penalty=1.1),
    "all four": SamplingPolicy(top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(args.vocab, hidden_size=args.hidden, layers=2, heads=4, seed=0).to(device)
    ids = torch.randint(3, args.vocab, (args.rows, args.tokens), device=device)
    labels = ids.clone()
    labels[:, : args.tokens // 2] = IGNORE_INDEX  # the prompt half
    batch = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}
    print(f"{args.rows} rows x {args.tokens} tokens (half labelled), vocabulary {args.vocab}, {device}")
    for tiled in (False, True):
        base = None
        for name, policy in SETTINGS.items():
            times = []
            for _ in range(args.repeats + 1):
                model.zero_grad(set_to_none=True)
                if device == "cuda":
                    torch.cuda.synchronize()
                started = time.perf_counter()
                logps, _ = token_logps(model, batch, tiled, 0.9, entropy=True, policy=policy)
                logps.sum().backward()
                if device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - started)
            seconds = statistics.median(times[1:])  # the first warms up
            base = base or seconds
            head = "tiled head" if tiled else "plain head"
            print(f"{head:>10} | {name:<24} | {seconds * 1000:8.1f} ms | {seconds / base:5.2f}x")


if __name__ == "__main__":
    main()
