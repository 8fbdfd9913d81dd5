"""Training sequences as indexes into the sample store: nothing here copies tokens until an item is read.

Every view is a map-style dataset over ``order`` (its sequence numbers, so a view can be repeated or cut
without touching the store) and hands the collator a dict of int64 numpy arrays:

- ``SampleView``: one stored sample per item (SFT and DPO unpacked, evaluation);
- ``PackedView``: several spans of stored samples per item, positions restarting at each span and each span's
  first label ignored, so no token attends to or predicts across samples;
- ``BlockView``: fixed windows of the concatenated samples (continued pretraining without packing).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from posttrain.data.samples import IGNORE_INDEX
from posttrain.data.store import SampleStore
from posttrain.vision import images

Item = dict[str, Any]


class View(Dataset):
    """Common part: ``order`` maps item numbers to sequence numbers (None: item k is sequence k).
    ``ARRAYS`` names the index arrays saved beside the store (``save``) and memory-mapped back (``restore``),
    so the assembly (packing included) runs once, when the store is built."""

    ARRAYS: tuple[str, ...] = ()
    store: SampleStore
    order: np.ndarray | None = None

    def sequences(self) -> int:
        raise NotImplementedError

    def __len__(self) -> int:
        return self.sequences() if self.order is None else len(self.order)

    def __getitem__(self, index: int) -> Item:
        return self.sequence(index if self.order is None else int(self.order[index]))

    @property
    def item_order(self) -> np.ndarray:
        return np.arange(self.sequences(), dtype=np.int64) if self.order is None else self.order

    def save(self, directory: Path, name: str) -> None:
        for array in self.ARRAYS:
            np.save(directory / f"{name}.{array}.npy", np.asarray(getattr(self, array)))
        scalars = {k: v for k, v in self.__dict__.items() if isinstance(v, int) and not isinstance(v, bool)}
        (directory / f"{name}.view.json").write_text(json.dumps({"kind": type(self).__name__, **scalars}))

    @staticmethod
    def restore(store: SampleStore, directory: Path, name: str) -> View:
        meta = json.loads((directory / f"{name}.view.json").read_text())
        kind = VIEWS[meta.pop("kind")]
        view = object.__new__(kind)
        view.__dict__.update(meta, store=store, order=None, per_sample={})
        for array in kind.ARRAYS:
            view.__dict__[array] = np.load(directory / f"{name}.{array}.npy", mmap_mode="r")
        return view

    def __iter__(self) -> Iterator[Item]:
        for index in range(len(self)):
            yield self[index]

    def sequence(self, number: int) -> Item:
        raise NotImplementedError

    def sequence_lengths(self, column: str = "input_ids") -> np.ndarray:
        """Length of every sequence (indexed by sequence number, not item number)."""
        raise NotImplementedError

    def lengths(self, column: str = "input_ids") -> np.ndarray:
        """Length of every item, in item order."""
        lengths = self.sequence_lengths(column)
        return lengths if self.order is None else lengths[self.order]

    def trained_tokens(self) -> int:
        raise NotImplementedError

    @property
    def input_columns(self) -> list[str]:
        return [c for c in self.store.columns if c.endswith("input_ids")]

    def with_order(self, order: np.ndarray) -> View:
        copy = object.__new__(type(self))
        copy.__dict__.update(self.__dict__)
        copy.order = np.asarray(order, dtype=np.int64)
        return copy

    def repeat(self, copies: int) -> View:
        return self.with_order(np.tile(self.item_order, copies))

    def head(self, count: int) -> View:
        return self.with_order(self.item_order[:count])


class SampleView(View):
    """One stored sample per item; ``per_sample`` adds a value to each sample (DPO's reference log-probabilities)."""

    ARRAYS = ("samples",)

    def __init__(self, store: SampleStore, samples: np.ndarray) -> None:
        self.store = store
        self.samples = np.asarray(samples, dtype=np.int64)
        self.order = None
        self.per_sample: dict[str, np.ndarray] = {}

    def sequences(self) -> int:
        return len(self.samples)

    def sequence(self, number: int) -> Item:
        return self.sample_item(int(self.samples[number]))

    def sample_item(self, sample: int) -> Item:
        """The stored sample ``sample`` (a store id, not an item number) with its per-sample values."""
        item: Item = {column: self.store.get(column, sample) for column in self.store.columns}
        for name, values in self.per_sample.items():
            item[name] = float(values[sample])
        return item

    def sequence_lengths(self, column: str = "input_ids") -> np.ndarray:
        return self.store.lengths(column)[self.samples]

    def trained_tokens(self) -> int:
        columns = [c for c in self.store.columns if c.endswith("labels")]
        samples = self.samples if self.order is None else self.samples[self.order]
        return int(sum(self.store.trained(c)[samples].sum() for c in columns))


class PackedView(View):
    """Sequences made of spans ``(sample, start, length)``; sequence ``k`` holds the spans
    ``members[offsets[k]:offsets[k + 1]]``."""

    ARRAYS = ("span_sample", "span_start", "span_length", "offsets", "members")

    def __init__(
        self,
        store: SampleStore,
        spans: tuple[np.ndarray, np.ndarray, np.ndarray],
        offsets: np.ndarray,
        members: np.ndarray,
    ) -> None:
        self.store = store
        self.span_sample, self.span_start, self.span_length = spans
        self.offsets = offsets
        self.members = members
        self.order = None

    def sequences(self) -> int:
        return len(self.offsets) - 1

    def sequence(self, number: int) -> Item:
        ids, labels, positions = [], [], []
        for span in self.members[self.offsets[number] : self.offsets[number + 1]]:
            sample, start = int(self.span_sample[span]), int(self.span_start[span])
            stop = start + int(self.span_length[span])
            ids.append(self.store.get("input_ids", sample, start, stop))
            label = self.store.get("labels", sample, start, stop)
            label[0] = IGNORE_INDEX  # nothing before it in its own sample
            labels.append(label)
            positions.append(np.arange(stop - start, dtype=np.int64))
        item: Item = {
            "input_ids": np.concatenate(ids),
            "labels": np.concatenate(labels),
            "position_ids": np.concatenate(positions),
        }
        if images.IMAGES_COLUMN in self.store.columns:  # a vision-language run: the spans' images, in order
            spans = self.members[self.offsets[number] : self.offsets[number + 1]]
            stored = [self.store.get(images.IMAGES_COLUMN, int(self.span_sample[s])) for s in spans]
            item[images.IMAGES_COLUMN] = images.join(stored)
        return item

    def sequence_lengths(self, column: str = "input_ids") -> np.ndarray:
        per_span = self.span_length[self.members]
        return np.add.reduceat(per_span, self.offsets[:-1]) if len(per_span) else np.zeros(0, np.int64)

    def trained_tokens(self) -> int:
        # A whole stored sample keeps its trained count (its first label is ignored either way); a partial
        # span only comes from cutting raw text, where every label but the span's first is trained.
        whole = (self.span_start == 0) & (self.span_length == self.store.lengths("labels")[self.span_sample])
        per_span = np.where(whole, self.store.trained("labels")[self.span_sample], self.span_length - 1)
        per_sequence = np.add.reduceat(per_span[self.members], self.offsets[:-1])
        return int((per_sequence if self.order is None else per_sequence[self.order]).sum())


class BlockView(View):
    """``max_length`` windows of the stream of ``samples`` concatenated in order (the last, shorter window
    kept when it has at least two tokens); labels are the stored labels of the same tokens."""

    ARRAYS = ("samples", "starts")

    def __init__(self, store: SampleStore, samples: np.ndarray, block: int) -> None:
        self.store = store
        self.samples = np.asarray(samples, dtype=np.int64)
        self.block = block
        lengths = store.lengths("input_ids")[self.samples]
        self.starts = np.zeros(len(lengths) + 1, dtype=np.int64)  # stream position of each sample
        np.cumsum(lengths, out=self.starts[1:])
        self.total = int(self.starts[-1])
        self.order = None

    def sequences(self) -> int:
        return self.total // self.block + (1 if self.total % self.block >= 2 else 0)

    def sequence(self, number: int) -> Item:
        begin, end = number * self.block, min((number + 1) * self.block, self.total)
        first = int(np.searchsorted(self.starts, begin, side="right")) - 1
        ids, labels = [], []
        position, index = begin, first
        while position < end:
            sample = int(self.samples[index])
            offset = position - int(self.starts[index])
            stop = min(int(self.starts[index + 1]), end) - int(self.starts[index])
            ids.append(self.store.get("input_ids", sample, offset, stop))
            labels.append(self.store.get("labels", sample, offset, stop))
            position += stop - offset
            index += 1
        return {"input_ids": np.concatenate(ids), "labels": np.concatenate(labels)}

    def sequence_lengths(self, column: str = "input_ids") -> np.ndarray:
        lengths = np.full(self.sequences(), self.block, dtype=np.int64)
        if len(lengths) and self.total % self.block >= 2:  # a shorter last block (one token is dropped)
            lengths[-1] = self.total % self.block
        return lengths

    def trained_tokens(self) -> int:
        return int((self.lengths() - 1).sum())


VIEWS: dict[str, type[View]] = {cls.__name__: cls for cls in (SampleView, PackedView, BlockView)}


#: the key an eval shard's filler items carry (a collator whose rows have no labels weighs them 0)
PADDING = "eval_padding"


class EvalShard(Dataset):
    """One rank's share of an eval view; every rank gets the same count, the padding items carry no labels
    (so collectives stay in step and the metrics stay exact)."""

    def __init__(self, view: View, rank: int, world: int) -> None:
        self.view = view
        count = len(view)
        per_rank = -(-count // world) if count else 0
        mine = np.arange(rank, count, world, dtype=np.int64)
        self.items = np.concatenate([mine, np.full(per_rank - len(mine), -1, dtype=np.int64)])

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Item:
        item = int(self.items[index])
        if item >= 0:
            return self.view[item]
        filler = self.view[0]
        return {
            **{
                k: np.full_like(v, IGNORE_INDEX) if k.endswith("labels") else v
                for k, v in filler.items()
                if not k.startswith("ref_")
            },
            PADDING: True,
        }
