"""``posttrain chat EXPORT``: talk to an export in the terminal, its reply streamed as it is generated.

One shot with ``--prompt``; otherwise a conversation read line by line from standard input (a terminal or a
pipe) with the history kept, ``/reset`` to start again and ``/exit`` (or end of input) to leave. Messages
are rendered with the export's own chat template; ``--raw`` continues plain text instead (causal models).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from posttrain.errors import UserError
from posttrain.inference.export import Export, load_export


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 256
    temperature: float = 0.7  # 0: greedy
    top_p: float = 1.0

    def check(self) -> None:
        if self.max_new_tokens < 1:
            raise UserError(f"--max-new-tokens {self.max_new_tokens}: must be >= 1")
        if self.temperature < 0:
            raise UserError(f"--temperature {self.temperature}: must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top-p {self.top_p}: must be in (0, 1]")


def _streamer(tokenizer: Any, out: TextIO) -> Any:
    from transformers import TextStreamer

    class Streamer(TextStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            out.write(text + ("\n" if stream_end else ""))
            out.flush()

    return Streamer(tokenizer, skip_prompt=True, skip_special_tokens=True)


def generate(export: Export, inputs: dict[str, Any], sampling: Sampling, out: TextIO) -> str:
    """Generate after ``inputs`` (token ids and attention mask), streaming the text to ``out``; the reply."""
    import torch

    tokenizer, model = export.tokenizer, export.model
    inputs = {key: value.to(model.device) for key, value in inputs.items()}
    greedy = sampling.temperature == 0
    with torch.inference_mode():
        ids = model.generate(
            **inputs,
            max_new_tokens=sampling.max_new_tokens,
            do_sample=not greedy,
            temperature=None if greedy else sampling.temperature,
            top_p=None if greedy else sampling.top_p,
            top_k=None,
            pad_token_id=tokenizer.pad_token_id
            if tokenizer.pad_token_id is not None
            else tokenizer.eos_token_id,
            streamer=_streamer(tokenizer, out),
        )
    return tokenizer.decode(ids[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def reply(export: Export, messages: list[dict[str, str]], sampling: Sampling, out: TextIO) -> str:
    inputs = export.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    return generate(export, dict(inputs), sampling, out)


def continuation(export: Export, text: str, sampling: Sampling, out: TextIO) -> str:
    return generate(export, dict(export.tokenizer(text, return_tensors="pt")), sampling, out)


def chat(
    path: Path,
    *,
    prompt: str | None = None,
    system: str | None = None,
    raw: bool = False,
    sampling: Sampling = Sampling(),
    device: str | None = None,
    lines: TextIO = sys.stdin,
    out: TextIO = sys.stdout,
) -> int:
    sampling.check()
    export = load_export(path, device=device)
    if not raw and not export.tokenizer.chat_template:
        raise UserError(
            f"{path}: its tokenizer has no chat template; pass --raw to continue plain text, or train with "
            "tokenizer.chat_template set (e.g. chatml)"
        )
    start = [{"role": "system", "content": system}] if system else []
    if prompt is not None:
        if raw:
            continuation(export, prompt, sampling, out)
        else:
            reply(export, [*start, {"role": "user", "content": prompt}], sampling, out)
        return 0
    what = f"adapter on {export.base}" if export.adapter else str(path)
    print(f"posttrain chat: {what}. /reset starts again, /exit or Ctrl-D leaves.", file=sys.stderr)
    messages = list(start)
    interactive = lines.isatty()
    while True:
        if interactive:
            out.write("> ")
            out.flush()
        line = lines.readline()
        if not line or line.strip() == "/exit":
            return 0
        text = line.rstrip("\n")
        if text.strip() == "/reset":
            messages = list(start)
            continue
        if not text.strip():
            continue
        if raw:
            continuation(export, text, sampling, out)
            continue
        messages.append({"role": "user", "content": text})
        messages.append({"role": "assistant", "content": reply(export, messages, sampling, out)})
