"""Read the history rows of an offline W&B run file (``run-<id>.wandb``) for tests.

The file is a LevelDB-style log: a 7-byte header, then 32 KiB blocks of records, each with a 7-byte header
(CRC32, length, type: 1 full, 2 first, 3 middle, 4 last) and a ``wandb_internal_pb2.Record`` payload.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = 7


def records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    out, pending, position = [], b"", HEADER
    while position + HEADER <= len(data):
        left_in_block = BLOCK - position % BLOCK
        if left_in_block < HEADER:  # block trailer padding
            position += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + HEADER])
        payload = data[position + HEADER : position + HEADER + length]
        position += HEADER + length
        if kind == 0 and length == 0:
            break
        pending += payload
        if kind in (1, 4):
            out.append(pending)
            pending = b""
    return out


def history(path: Path) -> list[dict[str, Any]]:
    from wandb.proto import wandb_internal_pb2

    rows = []
    for payload in records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    return rows
