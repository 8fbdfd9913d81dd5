"""Generate the bundled synthetic preference pairs: for "reverse N", the reversed digits are preferred over
a plain copy of N. Train and eval numbers are disjoint. Run: ``python examples/make_preference_data.py``."""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent / "data"


def make_pairs(seed: int = 1, n_train: int = 2000, n_eval: int = 200) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    seen: set[str] = set()
    pairs = []
    while len(pairs) < n_train + n_eval:
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 6)))
        if digits in seen or digits == digits[::-1]:
            continue
        seen.add(digits)
        pairs.append({"prompt": f"reverse {digits}", "chosen": digits[::-1], "rejected": digits})
    return pairs[:n_train], pairs[n_train:]


def main() -> None:
    train, evaluation = make_pairs()
    for name, rows in (("prefs-train.jsonl", train), ("prefs-eval.jsonl", evaluation)):
        with open(HERE / name, "w", encoding="utf-8") as handle:
            for row in rows:
                handle.write(json.dumps(row) + "\n")
    print(f"wrote {len(train)} train and {len(evaluation)} eval pairs to {HERE}")


if __name__ == "__main__":
    main()
