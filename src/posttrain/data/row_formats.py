"""Row shapes of other systems, read as posttrain's own (so their files load directly, with no conversion).

- ERNIEKit ``erniekit`` SFT rows: ``src`` (user turns) and ``tgt`` (assistant turns) as equal-length lists, an
  optional ``system`` string and an optional ``label`` list (1: train that assistant turn, 0: context only).
- ERNIEKit ``erniekit`` preference rows: ``src`` (n user turns), ``tgt`` (the n-1 assistant turns between
  them), ``response`` (candidate answers to the last user turn, each a list holding one string) and ``sort``
  (one score per response; the highest is chosen, the lowest rejected).
- Megatron-Bridge fine-tuning rows: ``input`` (the prompt) and ``output`` (the answer).
- ERNIEKit ``chatml`` rows, and SiloGen's: ``messages`` (SFT), or ``messages`` as the prompt with ``chosen``
  and ``rejected`` (preference), which the formatters read as they are.
"""

from __future__ import annotations

from typing import Any

from posttrain.data.samples import RowError


def _strings(row: dict[str, Any], key: str) -> list[str]:
    value = row.get(key)
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise RowError(f"erniekit row: {key!r} must be a list of strings")
    return value


def _head(row: dict[str, Any]) -> list[dict[str, Any]]:
    system = row.get("system")
    if system is None or system == "":
        return []
    if not isinstance(system, str):
        raise RowError("erniekit row: 'system' must be a string")
    return [{"role": "system", "content": system}]


def is_prompt_completion(row: dict[str, Any]) -> bool:
    """Megatron-Bridge's fine-tuning rows: ``{"input": ..., "output": ...}``."""
    return "messages" not in row and isinstance(row.get("input"), str) and isinstance(row.get("output"), str)


def prompt_completion_messages(row: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": row["input"]}, {"role": "assistant", "content": row["output"]}]


def is_erniekit(row: dict[str, Any]) -> bool:
    return "src" in row and "messages" not in row


def erniekit_messages(row: dict[str, Any]) -> list[dict[str, Any]]:
    """An ``erniekit`` SFT row as messages; an assistant turn with label 0 carries ``train: False``."""
    src, tgt = _strings(row, "src"), _strings(row, "tgt")
    if len(src) != len(tgt) or not src:
        raise RowError(
            f"erniekit row: 'src' and 'tgt' must have the same, non-zero length ({len(src)}, {len(tgt)})"
        )
    labels = row.get("label")
    if labels is None:
        labels = [1] * len(tgt)
    if not isinstance(labels, list) or len(labels) != len(tgt) or any(x not in (0, 1) for x in labels):
        raise RowError(f"erniekit row: 'label' must be a list of 0/1, one per 'tgt' turn ({len(tgt)})")
    messages = _head(row)
    for user, assistant, label in zip(src, tgt, labels, strict=True):
        messages.append({"role": "user", "content": user})
        turn: dict[str, Any] = {"role": "assistant", "content": assistant}
        if not label:
            turn["train"] = False
        messages.append(turn)
    return messages


def erniekit_pair(row: dict[str, Any]) -> dict[str, Any]:
    """An ``erniekit`` preference row as ``prompt`` (messages), ``chosen`` and ``rejected`` (strings)."""
    src, tgt = _strings(row, "src"), _strings(row, "tgt") if "tgt" in row else []
    if len(tgt) != len(src) - 1:
        raise RowError(
            f"erniekit preference row: 'tgt' must have one item fewer than 'src' ({len(tgt)}, {len(src)})"
        )
    responses, sort = row.get("response"), row.get("sort")
    if not isinstance(responses, list) or len(responses) < 2:
        raise RowError("erniekit preference row: 'response' must list at least two answers")
    answers = []
    for index, item in enumerate(responses):
        text = item[0] if isinstance(item, list) and len(item) == 1 else item
        if not isinstance(text, str):
            raise RowError(
                f"erniekit preference row: response[{index}] must be a string or a list of one string"
            )
        answers.append(text)
    if (
        not isinstance(sort, list)
        or len(sort) != len(answers)
        or not all(isinstance(s, int | float) for s in sort)
    ):
        raise RowError("erniekit preference row: 'sort' must hold one number per response")
    if max(sort) == min(sort):
        raise RowError(
            "erniekit preference row: every response has the same 'sort' value, so none is preferred"
        )
    prompt = _head(row)
    for index, user in enumerate(src):
        prompt.append({"role": "user", "content": user})
        if index < len(tgt):
            prompt.append({"role": "assistant", "content": tgt[index]})
    chosen = answers[sort.index(max(sort))]
    rejected = answers[sort.index(min(sort))]
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}
