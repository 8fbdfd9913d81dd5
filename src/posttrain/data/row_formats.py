"""Row shapes of other systems, read as posttrain's own (so their files load directly, with no conversion).

- ERNIEKit ``erniekit`` SFT rows: ``src`` (user turns) and ``tgt`` (assistant turns) as equal-length lists, an
  optional ``system`` string and an optional ``label`` list (1: train that assistant turn, 0: context only).
- ERNIEKit ``erniekit`` preference rows: ``src`` (n user turns), ``tgt`` (the n-1 assistant turns between
  them), ``response`` (candidate answers to the last user turn, each a list holding one string) and ``sort``
  (one score per response; the highest is chosen, the lowest rejected, and their scores are the pair's
  ``score_chosen`` and ``score_rejected``).
- Megatron-Bridge fine-tuning rows: ``input`` (the prompt) and ``output`` (the answer).
- ERNIEKit ``chatml`` rows, and SiloGen's: ``messages`` (SFT), or ``messages`` as the prompt with ``chosen``
  and ``rejected`` (preference), which the formatters read as they are.
- Alpaca rows: ``instruction``, an optional ``input`` (appended to the instruction) and ``output``, with an
  optional ``system``.
- ShareGPT rows: ``conversations``, a list of ``{from, value}`` turns with roles ``human``/``gpt``/``system``
  (``user``/``assistant`` too; other names through the source's ``roles`` map).
- TRL's prompt-completion rows: ``prompt`` and ``completion``, each a string or a list of messages.

A row is read by exactly one format, found by its keys. A row that also holds another format's content keys
(``instruction`` beside ``input``/``output``, ``text`` beside ``prompt``/``completion``...) is refused, never
half-read. A source's ``columns`` and ``roles`` maps rename a file's own names first (``sources.MappedReader``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
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
    return {
        "prompt": prompt,
        "chosen": chosen,
        "rejected": rejected,
        "score_chosen": max(sort),
        "score_rejected": min(sort),
    }


# ------------------------------------------------------------------------------------- chat row formats

#: ShareGPT's role names (and the standard ones) -> posttrain's roles
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}
#: the keys that carry a row's content, in any format: one a format does not read is never ignored
CONTENT_KEYS = (
    "messages",
    "conversations",
    "instruction",
    "input",
    "output",
    "prompt",
    "completion",
    "text",
    "src",
    "tgt",
)


def _sharegpt(row: dict[str, Any]) -> list[dict[str, Any]]:
    turns = row["conversations"]
    if not isinstance(turns, list) or not turns:
        raise RowError("sharegpt row: 'conversations' must be a non-empty list of {from, value} turns")
    messages = []
    for index, turn in enumerate(turns):
        if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
            raise RowError(f"sharegpt row: conversations[{index}] must be an object with 'from' and 'value'")
        role = SHAREGPT_ROLES.get(turn["from"])
        if role is None:
            raise RowError(
                f"sharegpt row: conversations[{index}].from {turn['from']!r} is not one of "
                f"{', '.join(SHAREGPT_ROLES)}; map it with the source's roles (e.g. roles: {{bot: assistant}})"
            )
        messages.append({"role": role, "content": turn["value"]})
    return messages


def sharegpt_pair(row: dict[str, Any]) -> dict[str, Any]:
    """LLaMA-Factory's ranked ShareGPT rows (``conversations`` up to the last user turn, ``chosen`` and
    ``rejected`` each one ``{from, value}`` turn) as ``prompt``/``chosen``/``rejected`` messages."""
    out = {**row, "prompt": _sharegpt(row)}
    for side in ("chosen", "rejected"):
        turn = row.get(side)
        if isinstance(turn, dict):
            out[side] = _sharegpt({"conversations": [turn]})
    return out


def _alpaca(row: dict[str, Any]) -> list[dict[str, Any]]:
    parts = [row.get(key) for key in ("instruction", "input")]
    if not all(
        part is None or isinstance(part, str) for part in (*parts, row.get("output"), row.get("system"))
    ):
        raise RowError("alpaca row: 'instruction', 'input', 'output' and 'system' must be strings")
    prompt = "\n\n".join(part for part in parts if part and part.strip())
    if not prompt:
        raise RowError(
            "alpaca row: 'instruction' and 'input' are both empty, so the user turn would be empty"
        )
    messages = [{"role": "system", "content": row["system"]}] if row.get("system") else []
    return [*messages, {"role": "user", "content": prompt}, {"role": "assistant", "content": row["output"]}]


def _turns(value: Any, role: str, key: str) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list):
        return value
    raise RowError(f"prompt-completion row: {key!r} must be a string or a list of messages")


def _prompt_completion(row: dict[str, Any]) -> list[dict[str, Any]]:
    return [*_turns(row["prompt"], "user", "prompt"), *_turns(row["completion"], "assistant", "completion")]


@dataclass(frozen=True)
class RowFormat:
    """A chat row format: the keys that identify it, the content keys it reads, how it becomes messages."""

    name: str
    needs: tuple[str, ...]
    reads: tuple[str, ...]
    messages: Callable[[dict[str, Any]], list[dict[str, Any]]]


#: in detection order: the first whose keys are all present reads the row
CHAT_FORMATS = (
    RowFormat("messages", ("messages",), ("messages",), lambda row: row["messages"]),
    RowFormat("erniekit", ("src",), ("src", "tgt"), erniekit_messages),
    RowFormat("sharegpt", ("conversations",), ("conversations",), _sharegpt),
    RowFormat("alpaca", ("instruction", "output"), ("instruction", "input", "output"), _alpaca),
    RowFormat("prompt-completion", ("prompt", "completion"), ("prompt", "completion"), _prompt_completion),
    RowFormat("input-output", ("input", "output"), ("input", "output"), prompt_completion_messages),
)
KNOWN = (
    "messages (chat), conversations (ShareGPT: from/value), instruction/input/output (Alpaca), "
    "prompt/completion (TRL), input/output (Megatron-Bridge), src/tgt (ERNIEKit)"
)


def chat_messages(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation of a chat row in any format above (not yet checked), or a ``RowError`` that names
    the formats and the keys that would read the row."""
    found = next((f for f in CHAT_FORMATS if all(key in row for key in f.needs)), None)
    if found is None:
        keys = ", ".join(map(str, row)) or "none"
        if "text" in row:
            raise RowError(
                f"a plain-text row (keys: {keys}) has no conversation: train text with type: causal "
                "(data.text_column), or write chat rows"
            )
        raise RowError(
            f"no conversation in this row (keys: {keys}); posttrain reads {KNOWN}; other column names: "
            "data.sources[].columns (e.g. {conversations: dialog})"
        )
    ignored = [key for key in CONTENT_KEYS if key in row and key not in found.reads]
    if ignored:
        raise RowError(
            f"a {found.name} row that also holds {', '.join(map(repr, ignored))}, which the {found.name} format "
            "does not read; the row is refused rather than half-read (rename or drop the extra column)"
        )
    return found.messages(row)
