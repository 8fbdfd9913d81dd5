"""Images as users have them in their rows, read into one form: messages whose content is a list of parts
(``{"type": "text", "text": ...}`` and ``{"type": "image"}``, TRL's layout) and, in the same order, one
reference per image part.

Rows may give their images

- in an ``images`` column (``image``: a single one), with ``{"type": "image"}`` content parts (TRL) or
  ``<image>`` placeholders in string content (LLaMA-Factory) marking where each goes, in order;
- inline, in the part itself: ``{"type": "image", "image": ...}`` (also ``path`` or ``url``) or OpenAI's
  ``{"type": "image_url", "image_url": {"url": ...}}``.

An image is a path (relative to the data file's directory; ``file://`` accepted), a ``data:image/...;base64``
URI, bytes, a ``{"bytes": ..., "path": ...}`` dict (``datasets.Image`` in Parquet and Arrow) or a Pillow
image (a decoded ``datasets.Image`` column). Web URLs are refused: nothing is downloaded during a run.

The sample store keeps each sample's references as JSON (``images_json``: absolute paths, or the bytes in
base64); the collator opens them again for each micro-batch, so pixels are never stored.
"""

from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from posttrain.data.samples import RowError

#: the store column of each sample's image references (UTF-8 JSON: a list of {"path"} or {"bytes"})
IMAGES_COLUMN = "images_json"
#: the placeholder LLaMA-Factory's rows write in string content where an image goes
PLACEHOLDER = "<image>"
#: the row keys that hold images
IMAGE_KEYS = ("images", "image")
_PLACEHOLDER_SPLIT = re.compile(f"({re.escape(PLACEHOLDER)})")


def row_has_images(row: dict[str, Any]) -> bool:
    """Whether a row carries images anywhere: an image column or image parts in its messages."""
    if any(row.get(key) not in (None, [], "") for key in IMAGE_KEYS):
        return True
    for key in ("messages", "prompt", "chosen", "rejected", "completion"):
        value = row.get(key)
        if isinstance(value, list) and any(_has_image_part(m) for m in value if isinstance(m, dict)):
            return True
    return False


def _has_image_part(message: dict[str, Any]) -> bool:
    content = message.get("content")
    return isinstance(content, list) and any(
        isinstance(p, dict) and p.get("type") in ("image", "image_url") for p in content
    )


def column_images(row: dict[str, Any]) -> list[Any]:
    """The row's ``images`` (or ``image``) column as a list (empty when absent)."""
    for key in IMAGE_KEYS:
        value = row.get(key)
        if value is None or value == "":
            continue
        return list(value) if isinstance(value, (list, tuple)) else [value]
    return []


def parts_of(messages: list[dict[str, Any]], images: list[Any]) -> tuple[list[dict[str, Any]], list[Any]]:
    """Messages with list content (text and image parts) and the image of each image part, in order: the
    column's images fill the parts and placeholders that carry none, one each, in order. A count that does
    not match is the row's error."""
    pending = list(images)
    placeholders = 0
    found: list[Any] = []
    out = []
    for index, message in enumerate(messages):
        parts: list[dict[str, Any]] = []
        content = message.get("content")
        pieces = content if isinstance(content, list) else [{"type": "text", "text": content or ""}]
        for part in pieces:
            if isinstance(part, str):
                part = {"type": "text", "text": part}
            if not isinstance(part, dict) or "type" not in part:
                raise RowError(f"messages[{index}].content: each part must be an object with a 'type'")
            kind = part["type"]
            if kind == "text":
                for piece in _PLACEHOLDER_SPLIT.split(str(part.get("text", ""))):
                    if piece == PLACEHOLDER:
                        placeholders += 1
                        found.append(pending.pop(0) if pending else None)
                        parts.append({"type": "image"})
                    elif piece:
                        parts.append({"type": "text", "text": piece})
            elif kind in ("image", "image_url"):
                inline = _inline(part)
                if inline is None:
                    placeholders += 1
                    found.append(pending.pop(0) if pending else None)
                else:
                    found.append(inline)
                parts.append({"type": "image"})
            else:
                raise RowError(
                    f"messages[{index}].content has a {kind!r} part; posttrain reads text and image parts"
                )
        if message.get("role") == "assistant" and any(p["type"] == "image" for p in parts):
            raise RowError(f"messages[{index}] (assistant) holds an image; images go in user turns")
        out.append({**message, "content": parts})
    given = len(images)
    if placeholders != given:
        raise RowError(
            f"{placeholders} image placeholders ({{'type': 'image'}} parts or {PLACEHOLDER!r}) but {given} "
            "images in the row's images column; give one image per placeholder"
        )
    return out, found


def _inline(part: dict[str, Any]) -> Any:
    """The image a part carries itself, or None when the row's images column fills it."""
    if part["type"] == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not url:
            raise RowError("an image_url part without image_url.url")
        return url
    for key in ("image", "path", "url"):
        if part.get(key) not in (None, ""):
            return part[key]
    return None


def reference(image: Any, directory: Path | None) -> dict[str, str]:
    """A storable reference to ``image``: ``{"path": absolute}`` or ``{"bytes": base64}``."""
    if isinstance(image, dict):
        if image.get("bytes"):
            return {"bytes": base64.b64encode(bytes(image["bytes"])).decode()}
        if image.get("path"):
            return reference(str(image["path"]), directory)
        raise RowError("an image given as an object needs 'bytes' or 'path'")
    if isinstance(image, (bytes, bytearray, memoryview)):
        return {"bytes": base64.b64encode(bytes(image)).decode()}
    if hasattr(image, "save") and hasattr(image, "mode"):  # a Pillow image (a decoded datasets.Image)
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return {"bytes": base64.b64encode(buffer.getvalue()).decode()}
    if not isinstance(image, str):
        raise RowError(
            f"an image must be a path, bytes or a {{bytes, path}} object, not {type(image).__name__}"
        )
    if image.startswith("data:"):
        header, _, data = image.partition(",")
        if ";base64" not in header:
            raise RowError("a data: image URI must be base64 (data:image/png;base64,...)")
        return {"bytes": data}
    if re.match(r"^[a-z][a-z0-9+.-]*://", image) and not image.startswith("file://"):
        raise RowError(
            f"image {image[:80]!r} is a URL; posttrain downloads nothing while training: download the images "
            "and give their paths (relative to the data file)"
        )
    path = Path(image.removeprefix("file://")).expanduser()
    if not path.is_absolute() and directory is not None:
        path = directory / path
    return {"path": str(path.resolve())}


def open_image(ref: dict[str, str]) -> Any:  # -> PIL.Image.Image
    """The image a reference points to, decoded and in RGB; a missing or unreadable one is a ``RowError``."""
    from PIL import Image, UnidentifiedImageError

    try:
        if "path" in ref:
            with Image.open(ref["path"]) as image:
                return image.convert("RGB")
        with Image.open(io.BytesIO(base64.b64decode(ref["bytes"]))) as image:
            return image.convert("RGB")
    except FileNotFoundError:
        raise RowError(f"image {ref['path']} does not exist") from None
    except (UnidentifiedImageError, OSError, ValueError) as error:
        where = ref.get("path", "given as bytes")
        raise RowError(f"image {where} cannot be read as an image ({type(error).__name__})") from None


def encode(refs: list[dict[str, str]]) -> np.ndarray:
    """References as the store keeps them (UTF-8 JSON bytes)."""
    return np.frombuffer(json.dumps(refs).encode(), dtype=np.uint8)


def decode(stored: Any) -> list[dict[str, str]]:
    """A sample's references from its stored bytes (an empty column: none)."""
    raw = bytes(np.asarray(stored, dtype=np.uint8))
    return json.loads(raw.decode()) if raw else []


def join(stored: list[Any]) -> np.ndarray:
    """The references of several samples laid in one sequence (packed), in order."""
    return encode([ref for item in stored for ref in decode(item)])


def data_directory(origin: str) -> Path | None:
    """The directory of the data file a row came from, read from its origin (``path row N``); None for a
    dataset that is not a file (relative image paths are then taken from the working directory)."""
    path = Path(origin.rsplit(" row ", 1)[0])
    return path.parent if path.suffix in (".jsonl", ".json", ".parquet", ".csv") else None
