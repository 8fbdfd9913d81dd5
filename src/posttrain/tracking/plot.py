"""``posttrain plot``: loss (train and eval), the reward of online RL runs, generation ahead of training
(staleness, the trainer's and the generator's waits), lm-evaluation-harness tasks run during training
(``eval/<task>/<metric>``), learning rate and throughput against steps, several runs
overlaid, from metrics JSON-lines files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from posttrain.errors import UserError
from posttrain.utils.fs import atomic_write


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise UserError(f"{path}: no such metrics file")
    """The file's records as one run: where the steps go back (a resumed run continues from its checkpoint's
    step, after the killed run had written later ones), the continuation's records replace the earlier
    ones from that step on, so no curve joins two runs."""
    records: list[dict[str, Any]] = []
    latest = -1
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f"{path} line {number}: not JSON (is this a metrics file?)") from None
        step = record.get("iter") if isinstance(record, dict) else None
        if isinstance(step, int) and step < latest:
            records = [r for r in records if not (isinstance(r.get("iter"), int) and r["iter"] >= step)]
        latest = step if isinstance(step, int) else latest
        records.append(record)
    return records


def _label(path: Path, paths: list[Path]) -> str:
    names = [p.parent.name for p in paths]
    return path.parent.name if names.count(path.parent.name) == 1 else str(path)


def plot_metrics(paths: list[Path], out: Path) -> Path:
    """Loss (train, eval), the reward of online RL runs (train and held-out), generation ahead, dynamic
    sampling, the harness tasks, LR and tokens/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(path, read_metrics(path)) for path in paths]
    rewards = any(r.get("reward") is not None for _, records in runs for r in records)
    ahead = any(r.get("sample/staleness_max") is not None for _, records in runs for r in records)
    dynamic = any(r.get(KEPT) is not None for _, records in runs for r in records)
    harness = harness_keys(runs)
    panels = 3 + rewards + ahead + dynamic + bool(harness)
    figure, axes = plt.subplots(panels, 1, figsize=(9, 3.3 * panels), sharex=True)
    loss_axis, *middle, lr_axis, speed_axis = axes
    for index, (path, records) in enumerate(runs):
        color, label = f"C{index}", _label(path, paths)
        train = [r for r in records if r.get("loss") is not None]
        _curve(loss_axis, records, "loss", "eval_loss", color, label)
        if rewards:
            _curve(middle[0], records, "reward", "eval_reward", color, label)
        lr_axis.plot(
            [r["iter"] for r in train if "lr" in r], [r["lr"] for r in train if "lr" in r], color=color
        )
        speed = [r for r in train if r.get("tokens_per_second") is not None]
        speed_axis.plot([r["iter"] for r in speed], [r["tokens_per_second"] for r in speed], color=color)
        if ahead:
            _ahead(middle[rewards], records, color, label)
        if dynamic:
            _dynamic(middle[rewards + ahead], records, color, label)
        for style, key in enumerate(harness):
            found = [r for r in records if r.get(key) is not None]
            middle[-1].plot(
                [r["iter"] for r in found],
                [r[key] for r in found],
                color=color,
                marker="os^Dv"[style % 5],
                linestyle=["-", "--", ":", "-."][style % 4],
                label=f"{label} {key.removeprefix('eval/')}",
            )
    loss_axis.set_ylabel("loss")
    loss_axis.legend(fontsize="small")
    if rewards:
        middle[0].set_ylabel("reward")
        middle[0].legend(fontsize="small")
    if ahead:
        middle[rewards].set_ylabel("seconds waited / staleness")
        middle[rewards].legend(fontsize="small")
    if dynamic:
        middle[rewards + ahead].set_ylabel("dynamic sampling")
        middle[rewards + ahead].legend(fontsize="small")
    if harness:
        middle[-1].set_ylabel("harness tasks")
        middle[-1].legend(fontsize="small")
    lr_axis.set_ylabel("learning rate")
    speed_axis.set_ylabel("tokens / s")
    speed_axis.set_xlabel("optimizer step")
    figure.tight_layout()
    try:
        return atomic_write(out, lambda tmp: figure.savefig(tmp, dpi=100))
    finally:
        plt.close(figure)


def harness_keys(runs: list[tuple[Path, list[dict[str, Any]]]]) -> list[str]:
    """The lm-evaluation-harness metrics the runs logged (``eval/<task>/<metric>``), drawn in a panel of their
    own."""
    return sorted({key for _, records in runs for r in records for key in r if key.startswith("eval/")})


def _ahead(axis: Any, records: list[dict[str, Any]], color: str, label: str) -> None:
    """Generation ahead of training: the batches' staleness, the trainer's wait for generation (solid) and
    the generator's wait for weights (dotted)."""
    steps = [r for r in records if r.get("sample/staleness_max") is not None]
    x = [r["iter"] for r in steps]
    axis.step(
        x,
        [r["sample/staleness_max"] for r in steps],
        where="post",
        color=color,
        alpha=0.4,
        label=f"{label} staleness",
    )
    axis.plot(
        x,
        [r.get("time_waiting_generation", 0.0) for r in steps],
        color=color,
        label=f"{label} trainer waited",
    )
    axis.plot(
        x,
        [r.get("time_waiting_weights", 0.0) for r in steps],
        ":",
        color=color,
        label=f"{label} generator waited",
    )


#: grpo's dynamic sampling records (methods/grpo/dynamic_sampling.py)
KEPT, ROUNDS = "dynamic_sampling/kept_share", "dynamic_sampling/generation_rounds"


def _dynamic(axis: Any, records: list[dict[str, Any]], color: str, label: str) -> None:
    """Dynamic sampling: the share of the first round's groups kept (solid) and the generation rounds a
    batch took (dotted; the filtered and extra counts are in the records)."""
    steps = [r for r in records if r.get(KEPT) is not None]
    x = [r["iter"] for r in steps]
    axis.plot(x, [r[KEPT] for r in steps], color=color, label=f"{label} kept share")
    axis.plot(x, [r[ROUNDS] for r in steps], ":", color=color, label=f"{label} generation rounds")


def _curve(axis: Any, records: list[dict[str, Any]], key: str, held_out: str, color: str, label: str) -> None:
    """A training curve and, as dots, its held-out counterpart."""
    train = [r for r in records if r.get(key) is not None]
    evals = [r for r in records if r.get(held_out) is not None]
    axis.plot([r["iter"] for r in train], [r[key] for r in train], color=color, label=f"{label} train")
    if evals:
        axis.plot(
            [r["iter"] for r in evals],
            [r[held_out] for r in evals],
            "o--",
            color=color,
            label=f"{label} eval",
        )
