"""``posttrain chat EXPORT``: talk to an export in the terminal, its reply streamed as it is generated.

One shot with ``--prompt``; otherwise a conversation read line by line from standard input (a terminal or a
pipe) with the history kept, ``/reset`` to start again and ``/exit`` (or end of input) to leave. Messages
are rendered with the export's own chat template; ``--raw`` continues plain text instead (causal models).
``--image PATH`` (a vision-language export; repeatable) puts the images before the first question.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from posttrain.errors import UserError
from posttrain.inference.export import Export, load_export
from posttrain.vision.processor import processor_of


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


def reply(
    export: Export, messages: list[dict[str, Any]], sampling: Sampling, out: TextIO, pictures: list[Any] = ()
) -> str:
    """The reply to ``messages``; ``pictures``: the images of the image parts, in order (a VLM export)."""
    if pictures:
        processor = processor_of(export.tokenizer)
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs = processor(
            text=[text], images=[list(pictures)], return_tensors="pt", add_special_tokens=False
        )
        return generate(export, dict(inputs), sampling, out)
    inputs = export.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    return generate(export, dict(inputs), sampling, out)


def with_images(message: dict[str, Any], paths: list[Path]) -> tuple[dict[str, Any], list[Any]]:
    """A user message with ``paths`` as image parts before its text, and the images opened (a missing or
    unreadable one: one line, exit 2)."""
    if not paths:
        return message, []
    from posttrain.data.samples import RowError
    from posttrain.vision.images import open_image, reference

    try:
        pictures = [open_image(reference(str(path), None)) for path in paths]
    except RowError as error:
        raise UserError(f"--image: {error}") from None
    parts = [{"type": "image"} for _ in paths] + [{"type": "text", "text": message["content"]}]
    return {**message, "content": parts}, pictures


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
    images: tuple[Path, ...] = (),
    lines: TextIO = sys.stdin,
    out: TextIO = sys.stdout,
) -> int:
    sampling.check()
    export = load_export(path, device=device)
    if images and processor_of(export.tokenizer) is None:
        raise UserError(f"--image: {path} is a text model (it has no image processor); leave --image out")
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
            message, pictures = with_images({"role": "user", "content": prompt}, list(images))
            reply(export, [*start, message], sampling, out, pictures)
        return 0
    what = f"adapter on {export.base}" if export.adapter else str(path)
    print(f"posttrain chat: {what}. /reset starts again, /exit or Ctrl-D leaves.", file=sys.stderr)
    messages = list(start)
    shown: list[Any] = []
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
            messages, shown = list(start), []
            continue
        if not text.strip():
            continue
        if raw:
            continuation(export, text, sampling, out)
            continue
        first = not any(m["role"] == "user" for m in messages)  # the images go with the first question
        message, pictures = with_images({"role": "user", "content": text}, list(images) if first else [])
        shown = pictures if first else shown
        messages.append(message)
        answer = reply(export, messages, sampling, out, shown)
        messages.append(
            {"role": "assistant", "content": [{"type": "text", "text": answer}] if images else answer}
        )
