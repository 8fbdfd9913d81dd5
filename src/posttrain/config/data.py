"""``data:`` — where rows come from, how they become token ids, and how they are batched."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar, Literal

from pydantic import Field, SerializeAsAny, field_validator

from posttrain.config.base import BaseConfig, ModeKeys, Problem
from posttrain.config.human import HumanFloat, HumanInt

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


class DataSourceConfig(BaseConfig):
    mode_keys: ClassVar[tuple[ModeKeys, ...]] = (
        ModeKeys(
            ("sample_seed",),
            lambda c, root: c.sample_ratio is not None or c.sample_count is not None,
            "data.sources[].sample_ratio or sample_count",
        ),
    )
    type: str = ""
    """Data source type. A plain string source is ``local`` when it ends in .jsonl/.json/.parquet/.csv,
    else ``huggingface``."""

    name_or_path: str
    """A local file, or (``huggingface``) a hub dataset name, a data directory or a ``save_to_disk`` directory."""

    split: str = ""
    """Split to read (``huggingface``: any slice split such as ``train[:10%]``). Empty: ``train``."""

    sample_ratio: HumanFloat | None = Field(default=None, gt=0.0, le=1.0)
    """Keep this fraction of the rows, sampled at random with ``sample_seed``."""

    sample_count: HumanInt | None = Field(default=None, ge=1)
    """Keep this many rows, sampled at random with ``sample_seed``."""

    sample_seed: int = 42
    """Seed of the row sampling (only used with ``sample_ratio`` or ``sample_count``)."""

    columns: dict[str, str] = {}
    """This file's own names for the keys posttrain reads, ``{posttrain name: file name}``, at the top of a row
    and inside its turns, e.g. ``{conversations: dialog, from: speaker, value: text}`` for ShareGPT-like
    rows, or ``{instruction: question, output: answer}``."""

    roles: dict[str, str] = {}
    """This file's role names mapped to posttrain's (``user``, ``assistant``, ``system``) or ShareGPT's
    (``human``, ``gpt``), e.g. ``{bot: assistant, customer: user}``."""

    sampling_weight: HumanFloat = 1.0
    """With ``data.mix: weighted``: this source's share of the draws (SiloGen's ``sampling_weight``).
    0 drops the source; negative weights are an error."""

    process: bool = True
    """Run the trainer's formatter on the rows (render and tokenize). ``false``: rows already hold
    ``input_ids`` and ``labels``."""

    def problems(self) -> Iterator[Problem]:
        if self.sample_ratio is not None and self.sample_count is not None:
            yield Problem("sample_count", "set sample_ratio or sample_count, not both")
        if self.sampling_weight < 0:
            yield Problem(
                "sampling_weight",
                f"{self.sampling_weight} is negative; use a weight >= 0 (0 drops the source)",
            )


class LocalSourceConfig(DataSourceConfig):
    """A local .jsonl, .json, .parquet or .csv file."""

    def problems(self) -> Iterator[Problem]:
        yield from super().problems()
        if self.split not in ("", "train"):
            yield Problem(
                "split",
                f"{self.split!r}: a local file is read whole (split slices apply to type: huggingface); "
                "use sample_ratio or sample_count to read part of it",
            )

    @field_validator("name_or_path")
    @classmethod
    def _suffix(cls, value: str) -> str:
        if not value.endswith(LOCAL_SUFFIXES):
            raise ValueError(
                f"{value!r} has no supported file suffix; allowed: {', '.join(LOCAL_SUFFIXES)} "
                "(use type: huggingface for hub datasets and save_to_disk directories)"
            )
        return value


class HFSourceConfig(DataSourceConfig):
    """A Hugging Face ``datasets`` dataset: hub name, data directory or ``save_to_disk`` directory."""

    kwargs: dict[str, Any] = {}
    """Extra keyword arguments for ``datasets.load_dataset`` (e.g. ``data_files``, ``revision``)."""


class MegatronSourceConfig(DataSourceConfig):
    """A Megatron-LM indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``, as written by Megatron's
    ``preprocess_data.py`` or megatron-core's ``IndexedDatasetBuilder``): one pre-tokenized row per document.
    A Megatron-Bridge blend is several such sources with ``sampling_weight`` and ``data.mix: weighted``."""

    process: bool = False
    """Megatron data is already tokenized, so it is never formatted again (must stay false)."""

    split_ratio: str = ""
    """Megatron's document-level split weights, e.g. ``"969,30,1"`` (train, valid, test): contiguous ranges of
    documents in these proportions; ``split`` picks which one to read. Empty: every document."""

    def problems(self) -> Iterator[Problem]:
        yield from super().problems()
        if self.process:
            yield Problem("process", "Megatron indexed datasets are already tokenized; remove process: true")
        if self.split and self.split not in ("train", "valid", "test"):
            yield Problem("split", f"{self.split!r} is not one of train, valid, test")
        if self.split and not self.split_ratio:
            yield Problem("split", 'set split_ratio (e.g. "969,30,1") to choose a document-level split')
        if self.split_ratio:
            parts = self.split_ratio.replace("/", ",").split(",")
            try:
                weights = [float(x) for x in parts]
            except ValueError:
                weights = []
            if not weights or len(weights) > 3 or min(weights) < 0 or sum(weights) <= 0:
                yield Problem(
                    "split_ratio",
                    f'{self.split_ratio!r}: use up to three non-negative weights, e.g. "969,30,1"',
                )


class DataConfig(BaseConfig):
    mode_keys: ClassVar[tuple[ModeKeys, ...]] = (
        ModeKeys(("mix_seed",), lambda c, root: c.mix == "weighted", "data.mix: weighted"),
        ModeKeys(
            ("split_seed",),
            lambda c, root: c.train_eval_split[1] > 0,
            "a held-out split (data.train_eval_split)",
        ),
        ModeKeys(("packing",), lambda c, root: c.pack_samples, "data.pack_samples: true"),
    )
    type: str = ""
    """Data factory type. Defaults to the trainer's first accepted data factory."""

    sources: list[SerializeAsAny[DataSourceConfig]] = Field(min_length=1)
    """Training data sources, concatenated in order. A string is shorthand for ``{name_or_path: ...}``."""

    eval_sources: list[SerializeAsAny[DataSourceConfig]] = []
    """Evaluation data sources (instead of, or besides, ``train_eval_split``)."""

    train_eval_split: tuple[HumanFloat, HumanFloat] = (1.0, 0.0)
    """Fractions of the training rows kept for training and held out for evaluation; they must sum to 1.
    The split is taken from each source before any mixing or oversampling, so no training row is in the
    eval set."""

    split_seed: int | None = None
    """Seed of the train/eval split (SiloGen's auto-split ``seed``). Null: ``seed``."""

    mix: Literal["concatenate", "weighted"] = "concatenate"
    """How training sources are combined: ``concatenate`` them in order, or a ``weighted`` mix (SiloGen's
    precomputed weighted mix): draw a source by ``sampling_weight`` with ``mix_seed`` and take its next row,
    until every source has been used up at least once (small, heavily weighted sources are oversampled)."""

    mix_seed: int = 19851243
    """Seed of the weighted-mix draws."""

    check_end_of_turn: bool = True
    """Refuse data where an assistant turn's end-of-turn token (EOS, ``<|im_end|>``, ``<|eot_id|>``...) is not
    trained, naming the file and row: such a model never learns to stop. ``false`` turns the check off."""

    max_length: HumanInt = Field(default=8192, ge=2)
    """Longest sequence in tokens. When not set, the run takes the model's ``max_position_embeddings``."""

    num_proc: int = Field(default=16, ge=1)
    """Processes used to tokenize large datasets (small ones are processed in the main process)."""

    dl_num_workers: int = Field(default=2, ge=0)
    """DataLoader worker processes per rank."""

    seed: int = 42
    """Seed of the data order (shuffling, splits)."""

    use_data_cache: bool | None = None
    """Cache processed data on disk under a key of everything that changes it (null: on)."""

    cache_processed_data: bool | None = None
    """Deprecated alias of ``use_data_cache``."""

    cache_dir: str = ""
    """Where processed data is cached. Empty: ``<logger.output_dir>/data-cache`` (ArcticTraining's ``/tmp`` is
    shared by every job on a machine)."""

    cache_fs_type: Literal["auto", "local", "shared"] = "auto"
    """Whether ``cache_dir`` is node-local or shared between nodes (decides who builds the cache)."""

    pack_samples: bool = False
    """Pack several samples into each ``max_length`` sequence, position ids restarting per sample and no
    token attending across samples; needs ``micro_batch_size: 1``. SFT packs whole samples; causal packs
    documents (cut into ``max_length`` chunks), and without packing concatenates all documents and cuts the
    stream into ``max_length`` blocks (attention then crosses document boundaries inside a block). Not for
    preference pairs (``dpo``)."""

    packing: Literal["best-fit", "sequential"] = "best-fit"
    """With ``pack_samples``: ``best-fit`` (longest first, each into the fullest sequence it fits; like
    ERNIEKit's ``greedy_intokens``) or ``sequential`` (in shuffled order, a new sequence when one is full)."""

    padding_free: bool = False
    """Flatten each micro-batch into one row without padding: the same samples, one after another, with
    position ids restarting per sample and no attention across samples (as packing does, but the batches
    stay those of the unpacked run, so the loss is the padded batch's). No compute is spent on padding; with
    ``sdpa`` each sample attends causally within itself (per-document attention, no mask over the row). SFT
    only; not with ``pack_samples`` (already padding-free) or sequence parallelism."""

    overlong_samples: Literal["drop", "truncate"] = "drop"
    """What to do with a sample (a preference pair: its chosen or rejected sequence) longer than
    ``max_length``: drop it, or cut it to ``max_length`` tokens. Causal documents are always cut into
    chunks, so it does not apply there."""

    unsupported: ClassVar[dict[str, str]] = {}
    """Sample-layout keys this data factory does not honour, with the reason (set per data config class)."""

    @field_validator("sources", "eval_sources", mode="before")
    @classmethod
    def _listify(cls, value: Any) -> Any:
        return value if isinstance(value, list) else [value]

    def _layout_problems(self) -> Iterator[Problem]:
        defaults = type(self).model_fields
        for key, reason in self.unsupported.items():
            if getattr(self, key) != defaults[key].default:
                yield Problem(key, f"{reason}; remove the key")
        if self.padding_free and self.pack_samples:
            yield Problem(
                "padding_free",
                "pack_samples already puts several samples in one row without padding; set one of them",
            )

    def problems(self) -> Iterator[Problem]:
        yield from self._layout_problems()
        train, held_out = self.train_eval_split
        if train < 0 or held_out < 0 or abs(train + held_out - 1.0) > 1e-9:
            yield Problem(
                "train_eval_split", f"{[train, held_out]} must be two non-negative fractions summing to 1"
            )
        for index, source in enumerate(self.eval_sources):
            if source.sampling_weight != 1.0:
                yield Problem(
                    f"eval_sources[{index}].sampling_weight",
                    "eval sources are used whole and unweighted; remove it (or drop the source)",
                )
        if self.mix == "concatenate":
            for index, source in enumerate(self.sources):
                if source.sampling_weight != 1.0:
                    yield Problem(f"sources[{index}].sampling_weight", "only used with data.mix: weighted")
        elif not any(source.sampling_weight > 0 for source in self.sources):
            yield Problem("sources", "data.mix: weighted needs at least one source with sampling_weight > 0")
        if (
            self.cache_processed_data is not None
            and self.use_data_cache is not None
            and self.cache_processed_data != self.use_data_cache
        ):  # ArcticTraining warns when both are set; posttrain refuses only when they disagree
            yield Problem(
                "cache_processed_data",
                f"{self.cache_processed_data} disagrees with use_data_cache: {self.use_data_cache} "
                "(a deprecated alias of it); set only use_data_cache",
            )

    @property
    def cache_enabled(self) -> bool:
        for value in (self.use_data_cache, self.cache_processed_data):
            if value is not None:
                return value
        return True

    @property
    def has_eval(self) -> bool:
        return bool(self.eval_sources) or self.train_eval_split[1] > 0


class PromptedDataConfig(DataConfig):
    """Data whose rows hold a prompt apart from what is trained on (preference pairs, KTO rows, RL prompts)."""

    max_prompt_length: HumanInt = Field(default=0, ge=0)
    """Longest prompt in tokens (0: no limit besides max_length); longer prompts are cut per
    ``prompt_truncation``."""

    prompt_truncation: Literal["keep_start", "keep_end"] = "keep_end"
    """Which part of an over-long prompt to keep: its first or (default) its last tokens."""


class SFTDataConfig(DataConfig):
    """Chat data for supervised fine-tuning: rows of ``{"messages": [{"role", "content"}, ...]}``."""

    mask_inputs: bool = True
    """Train only on assistant tokens (each assistant turn's closing end-of-turn token included). ``false``
    trains on every token."""


class CausalDataConfig(DataConfig):
    """Raw text for (continued) pretraining: one document per row."""

    unsupported: ClassVar[dict[str, str]] = {
        "padding_free": "causal data is cut into max_length blocks or packed, so it holds no padding",
        "overlong_samples": "causal documents are always cut into max_length chunks",
    }

    text_column: str = "text"
    """The column holding each document's text."""

    add_bos: bool = True
    """Start every document with the tokenizer's BOS token."""

    add_eos: bool = True
    """End every document with the tokenizer's EOS token (so the model learns where documents end)."""
