"""The ``README.md`` model card of a Hugging Face export, and the base model's place in an adapter's config.

Pure text from the run's config and where training stands: what the weights are (a full model or an
adapter, of which base), how they were trained, and how to load them. The YAML front matter is the Hub's
(``base_model``, ``library_name``, ``tags``), so the card is right where the export is uploaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import posttrain


def base_model_place(name_or_path: str) -> str:
    """A local base model as an absolute path (the adapter then loads from any directory); a hub name as it
    is."""
    path = Path(name_or_path).expanduser()
    return str(path.resolve()) if path.exists() else name_or_path


def hub_name(name_or_path: str) -> str | None:
    """The Hub's name of a base model, for the card's ``base_model``: a hub name as it is, a local copy in the
    Hugging Face cache (``models--org--name/snapshots/...``) as ``org/name``; None for a model of one's own on
    disk (the Hub takes only its own names there)."""
    on_disk = name_or_path.startswith(("/", ".", "~")) or Path(name_or_path).expanduser().exists()
    if not on_disk:
        return name_or_path
    cached = next((part for part in Path(name_or_path).parts if part.startswith("models--")), None)
    return cached.removeprefix("models--").replace("--", "/") if cached else None


def front_matter(base: str, library: str, tags: str) -> list[str]:
    """The card's YAML front matter (the Hub's keys); ``base_model`` only under a name the Hub knows."""
    known = hub_name(base)
    return [
        "---",
        *([f"base_model: {known}"] if known else []),
        f"library_name: {library}",
        f"tags: [{tags}]",
        "---",
    ]


def model_card(config: Any, state: Any, *, adapter: bool, merged: bool = False) -> str:
    """The card of an export made after ``state.step`` optimizer steps of the run ``config``. The base model is
    named as the config names it (a local path as written, relative where it was: never this machine's
    absolute path)."""
    base = config.model.name_or_path
    evals = [record for record in state.history if "eval_loss" in record]
    library = "peft" if adapter else "transformers"
    what = (
        f"a {config.model.peft_config.get('peft_type', 'LORA')} adapter for `{base}`"
        if adapter
        else f"`{base}` fine-tuned" + (" (adapter merged into the weights)" if merged else "")
    )
    lines = [
        *front_matter(base, library, f"posttrain, {config.type}"),
        "",
        f"# {what}",
        "",
        f"Trained with posttrain {posttrain.__version__} (`type: {config.type}`), "
        f"{state.step} optimizer step{'' if state.step == 1 else 's'}"
        + (f" (stopped early: {state.stop_reason})" if state.stop_reason else "")
        + ".",
        "",
        "| | |",
        "|---|---|",
        f"| data | {', '.join(f'`{s.name_or_path}`' for s in config.data.sources)} |",
        f"| learning rate | {config.optimizer.lr} |",
        f"| sequence length | {config.data.max_length} |",
    ]
    if evals:
        first, last = evals[0], evals[-1]
        shown = f"{last['eval_loss']:.4f} at step {last['iter']}"
        if first is not last:
            shown = f"{first['eval_loss']:.4f} at step {first['iter']} -> " + shown
        lines.append(f"| held-out loss | {shown} |")
    load = (
        "from peft import AutoPeftModelForCausalLM\n"
        "model = AutoPeftModelForCausalLM.from_pretrained(EXPORT)  # loads the base model too"
        if adapter
        else "from transformers import AutoModelForCausalLM\nmodel = AutoModelForCausalLM.from_pretrained(EXPORT)"
    )
    lines += [
        "",
        "## Use",
        "",
        "```python",
        load,
        "from transformers import AutoTokenizer",
        "tokenizer = AutoTokenizer.from_pretrained(EXPORT)",
        "```",
        "",
        "or `posttrain chat EXPORT`"
        + (", and `posttrain merge EXPORT -o MERGED` for a standalone model." if adapter else "."),
        "",
    ]
    return "\n".join(lines)


def merged_card(base: str, adapter: Path) -> str:
    """The card of ``posttrain merge``'s output: ``base`` with the adapter at ``adapter`` merged in."""
    return "\n".join(
        [
            *front_matter(base, "transformers", "posttrain, merged"),
            "",
            f"# `{base}` with the adapter `{adapter.resolve()}` merged into its weights",
            "",
            f"Merged by posttrain {posttrain.__version__} (`posttrain merge`); a standalone model:",
            "",
            "```python",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "model = AutoModelForCausalLM.from_pretrained(MERGED)",
            "tokenizer = AutoTokenizer.from_pretrained(MERGED)",
            "```",
            "",
        ]
    )
