"""Megatron-LM indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``) as a data source.

This is the format written by Megatron-LM's ``tools/preprocess_data.py`` and megatron-core's
``IndexedDatasetBuilder``. The ``.idx`` file holds a header (``MMIDIDX\\0\\0``, version 1, the token dtype
code, the sequence and document counts), then each sequence's length (int32) and byte offset in ``.bin``
(int64), then the document boundaries (int64 sequence numbers). A document is its sequences' tokens in a
row; each document becomes one pre-tokenized row (``input_ids`` = ``labels``, no BOS/EOS added: the
preprocessor decided those). Both files are memory-mapped; only the documents read are touched.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from posttrain.config.data import MegatronSourceConfig
from posttrain.context import RunContext
from posttrain.data.sources import Row, rows_by_number
from posttrain.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
#: Megatron's dtype codes
DTYPES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
SPLITS = ("train", "valid", "test")


class IndexedDataset:
    """Read-only view of one ``PREFIX.bin``/``PREFIX.idx`` pair."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        index, data = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
        for path in (index, data):
            if not path.is_file():
                raise DataError(f"megatron data source {prefix!r}: no such file {path}")
        with open(index, "rb") as handle:
            header = handle.read(34)
        if len(header) < 34 or header[:9] != MAGIC:
            raise DataError(f"{index}: not a Megatron indexed dataset (bad header)")
        version, code, sequences, documents = struct.unpack("<QBQQ", header[9:34])
        if version != 1 or code not in DTYPES:
            raise DataError(f"{index}: unsupported version {version} or dtype code {code}")
        raw = np.memmap(index, mode="r", dtype=np.uint8)
        offset = 34
        self.sequence_lengths = np.frombuffer(raw, np.int32, sequences, offset)
        offset += 4 * sequences
        self.sequence_pointers = np.frombuffer(raw, np.int64, sequences, offset)
        offset += 8 * sequences
        self.document_indices = np.frombuffer(raw, np.int64, documents, offset)
        self.dtype = DTYPES[code]
        size = data.stat().st_size
        self.tokens = np.memmap(data, mode="r", dtype=self.dtype) if size else np.zeros(0, self.dtype)

    @property
    def documents(self) -> int:
        return max(len(self.document_indices) - 1, 0)

    def document(self, number: int) -> np.ndarray:
        first, last = int(self.document_indices[number]), int(self.document_indices[number + 1])
        if first == last:
            return np.zeros(0, dtype=np.int64)
        itemsize = np.dtype(self.dtype).itemsize
        begin = int(self.sequence_pointers[first]) // itemsize
        end = int(self.sequence_pointers[last - 1]) // itemsize + int(self.sequence_lengths[last - 1])
        return np.asarray(self.tokens[begin:end], dtype=np.int64)


def split_bounds(ratio: str, count: int) -> list[int]:
    """Megatron's document-level split: ``"969,30,1"`` -> the first document of train, valid and test and
    the end, each part a contiguous range in proportion to its weight (bounds rounded as megatron-core's
    ``BlendedMegatronDatasetBuilder`` rounds them)."""
    weights = [float(x) for x in ratio.replace("/", ",").split(",")] if ratio else [1.0]
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    cumulative = np.cumsum([0.0, *(w / total for w in weights)])
    return [round(float(c) * count) for c in cumulative]


class MegatronReader:
    """Documents of one indexed dataset (or one split of it) as pre-tokenized rows."""

    def __init__(self, dataset: IndexedDataset, first: int, stop: int) -> None:
        self.dataset, self.first, self.stop = dataset, first, stop

    def __len__(self) -> int:
        return self.stop - self.first

    def read(self, numbers: np.ndarray) -> list[Row]:
        rows = []
        for index in numbers.tolist():
            tokens = self.dataset.document(self.first + index)
            origin = f"{self.dataset.prefix} document {self.first + index}"
            rows.append(Row({"input_ids": tokens, "labels": tokens}, origin))
        return rows

    def rows(self, wanted: np.ndarray | None = None) -> Iterator[Row]:
        return rows_by_number(self, wanted)


def load_megatron(config: MegatronSourceConfig, ctx: RunContext) -> MegatronReader:
    dataset = IndexedDataset(config.name_or_path)
    if not config.split_ratio:
        return MegatronReader(dataset, 0, dataset.documents)
    bounds = split_bounds(config.split_ratio, dataset.documents)
    part = SPLITS.index(config.split or "train")
    return MegatronReader(dataset, bounds[part], bounds[part + 1])
