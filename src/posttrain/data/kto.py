"""KTO rows -> desirable and undesirable completions, each with the mismatched sequence of its KL baseline.

A row is TRL's unpaired feedback (``prompt``, ``completion``, ``label``: true for a desirable completion) or
any preference pair ``dpo`` reads (one desirable and one undesirable completion). Every sample also holds
its KL sequence: its prompt followed by the completion of the next row of the same chunk (KTO estimates the
KL term from such mismatched pairs, TRL by cycling completions within a batch). Fixing the pairing when the
data is built makes it independent of batching and of the process count, and lets the reference score it
once, before training, like every other sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from posttrain.config.kto import KTODataConfig
from posttrain.data.dpo import field_of, pair_row, prompt_of, render_completion, token_columns
from posttrain.data.samples import IGNORE_INDEX, RowError, Sample, pad_rows, trained_tokens
from posttrain.data.views import PADDING

KINDS = ("desirable", "undesirable")
KL = "kl"
COLUMNS = token_columns((*KINDS, KL))


def _label(value: Any) -> bool:
    if isinstance(value, bool) or value in (0, 1):
        return bool(value)
    raise RowError(f"'label' must be true (desirable) or false (undesirable), not {value!r}")


def answers_of(row: dict[str, Any]) -> tuple[dict[str, Any], dict[str, tuple[Any, str]]]:
    """The row with its prompt (a pair's layouts read as ``pair_row`` reads them) and its completions by
    kind: ``{kind: (value, name)}``."""
    if "completion" in row or "label" in row:
        if "label" not in row:
            raise RowError("a 'completion' row needs its 'label' (true: desirable, false: undesirable)")
        kind = KINDS[0] if _label(row["label"]) else KINDS[1]
        return row, {kind: (field_of(row, "completion"), "completion")}
    pair = pair_row(row)
    return pair, {
        kind: (field_of(pair, side), side) for kind, side in zip(KINDS, ("chosen", "rejected"), strict=True)
    }


def _completions(row: dict[str, Any], tokenizer: Any, config: KTODataConfig) -> dict[str, Sample]:
    """The row's completions by kind, each rendered after its prompt."""
    render = dict(
        max_prompt_length=config.max_prompt_length,
        truncation=config.prompt_truncation,
        check_end_of_turn=config.check_end_of_turn,
    )
    prompt_row, answers = answers_of(row)
    prompt = prompt_of(prompt_row)
    return {
        kind: render_completion(tokenizer, prompt, value, name, **render)
        for kind, (value, name) in answers.items()
    }


#: a row's completions by kind, each rendered after its prompt (``format_kto_batch``'s ``completions``)
Completer = Callable[[dict[str, Any], Any, KTODataConfig], dict[str, Sample]]
#: what a rendered completion holds besides what it carries to its sample (its images...)
_RENDERED = ("input_ids", "labels", "prompt_len")


def format_kto_batch(
    rows: list[dict[str, Any]], tokenizer: Any, config: KTODataConfig, completions: Completer = _completions
) -> list[Any]:
    """A chunk of rows -> samples (or the row's ``RowError``); each sample's KL sequence takes the first
    completion of the next good row (cyclically within the chunk). What a completion holds besides its
    tokens (the prompt's images) goes with its sample, whose KL sequence has the same prompt."""
    parsed: list[dict[str, Sample] | RowError] = []
    for row in rows:
        try:
            parsed.append(completions(row, tokenizer, config))
        except RowError as exc:
            parsed.append(exc)
    good = [i for i, item in enumerate(parsed) if not isinstance(item, RowError)]
    place = {row: position for position, row in enumerate(good)}
    out: list[Any] = []
    for index, item in enumerate(parsed):
        if isinstance(item, RowError):
            out.append(item)
            continue
        other = parsed[good[(place[index] + 1) % len(good)]]
        assert not isinstance(other, RowError)
        sample: dict[str, np.ndarray] = {}
        for kind in KINDS:
            found = item.get(kind)
            sample[f"{kind}_input_ids"] = np.asarray(found["input_ids"] if found else [], dtype=np.int64)
            sample[f"{kind}_labels"] = np.asarray(found["labels"] if found else [], dtype=np.int64)
        own = next(iter(item.values()))
        theirs = next(iter(other.values()))
        prompt_len, their_prompt = own["prompt_len"][0], theirs["prompt_len"][0]
        sample[f"{KL}_input_ids"] = np.asarray(
            [*own["input_ids"][:prompt_len], *theirs["input_ids"][their_prompt:]], dtype=np.int64
        )
        sample[f"{KL}_labels"] = np.asarray(
            [IGNORE_INDEX] * prompt_len + list(theirs["labels"][their_prompt:]), dtype=np.int64
        )
        sample.update({key: value for key, value in own.items() if key not in _RENDERED})
        out.append(sample)
    return out


def fit_kto(sample: Sample, max_length: int, config: KTODataConfig) -> tuple[Sample | None, str, bool]:
    """Drop (or cut) a sample with a sequence longer than ``max_length``; drop one whose completion has
    nothing to train."""
    truncated = False
    if any(len(sample[f"{kind}_input_ids"]) > max_length for kind in (*KINDS, KL)):
        if config.overlong_samples == "drop":
            return None, f"longer than max_length={max_length}", False
        sample = {key: value[:max_length] for key, value in sample.items()}
        truncated = True
    for kind in KINDS:
        if len(sample[f"{kind}_input_ids"]) and not trained_tokens(sample[f"{kind}_labels"]):
            return None, "a completion has no trained tokens", truncated
    return sample, "", truncated


class KTOCollator:
    """B samples -> one padded batch of their completions (desirable first within each sample) and one of
    their KL sequences, with each completion's kind and reference log-prob. kto's ``collator`` hook
    (``registry.CollatorBuilder``: the class, built from the pad id)."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        rows, desirable, reference, owner, weights = [], [], [], [], []
        for index, sample in enumerate(samples):
            real = not sample.get(PADDING, False)
            for kind in KINDS:
                ids = sample[f"{kind}_input_ids"]
                if len(ids) == 0:
                    continue
                rows.append((ids, sample[f"{kind}_labels"]))
                desirable.append(kind == KINDS[0])
                reference.append(float(sample.get(f"ref_{kind}", 0.0)))
                owner.append(index)
                weights.append(float(real))
        input_ids, labels, attention = pad_rows(rows, self.pad_id)
        kl_rows = [(s[f"{KL}_input_ids"], s[f"{KL}_labels"]) for s in samples]
        kl_ids, kl_labels, kl_attention = pad_rows(kl_rows, self.pad_id)
        kl_weight = [float(not s.get(PADDING, False)) for s in samples]
        return {
            "input_ids": input_ids,
            "labels": labels,
            "attention_mask": attention,
            "desirable": torch.tensor(desirable, dtype=torch.bool),
            "ref_logps": torch.tensor(reference, dtype=torch.float64),
            "row_weight": torch.tensor(weights, dtype=torch.float64),
            "row_sample": torch.tensor(owner, dtype=torch.long),
            "kl_input_ids": kl_ids,
            "kl_labels": kl_labels,
            "kl_attention_mask": kl_attention,
            "ref_kl": torch.tensor([float(s.get("ref_kl", 0.0)) for s in samples], dtype=torch.float64),
            "kl_weight": torch.tensor(kl_weight, dtype=torch.float64),
            "num_loss_units": int(sum(weights)),
            "num_target_tokens": trained_tokens(labels),
            "num_input_tokens": sum(len(ids) for ids, _ in rows),
            "num_samples": len(samples),
            "num_attention_sq": sum(len(ids) ** 2 for ids, _ in rows),
        }


def kl_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """The KL sequences as a batch of their own: every ``kl_`` input (ids, labels, mask, and a vision-language
    model's image inputs for them)."""
    return {
        key.removeprefix("kl_"): value
        for key, value in batch.items()
        if key.startswith("kl_") and key != "kl_weight"
    }
