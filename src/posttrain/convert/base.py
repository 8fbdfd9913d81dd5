"""The rule table and the conversion it drives.

A source config is flattened to dotted keys (mappings are walked, lists are values). Every key is matched
against the system's rules (``*`` matches one key segment; the first matching rule wins) and gets exactly one
line: mapped to a posttrain key, approximated, not needed, or not supported. A key that no rule matches is
reported as unknown to the converter, so nothing is dropped without a line.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: how a source key was carried over
SAME, APPROX, NOT_NEEDED, UNSUPPORTED, UNKNOWN, DEFAULT = (
    "mapped",
    "approximated",
    "not needed",
    "not supported",
    "unknown",
    "source default",
)


@dataclass
class Conversion:
    """The posttrain config being built and the line of every source key."""

    system: str
    config: dict[str, Any] = field(default_factory=dict)
    lines: list[tuple[str, str, str]] = field(default_factory=list)  # (source key, verdict, detail)
    scratch: dict[str, Any] = field(default_factory=dict)  # values that several keys combine into
    comments: dict[str, list[str]] = field(
        default_factory=dict
    )  # top-level key -> where its values came from
    keep_attention: bool = False
    """``--keep-attention``: a FlashAttention kernel the source names is kept rather than mapped to sdpa."""
    wrapped: dict[str, str] = field(default_factory=dict)
    """Top-level keys of an unwrapped file -> the wrapper they sit under in the file (``finetuning_config``,
    ``trainer_args``...): reports name every key by its path in the file."""

    def where(self, key: str) -> str:
        """``key`` (a key of the unwrapped config) as the path the file writes it at."""
        wrapper = self.wrapped.get(key.split(".")[0])
        return f"{wrapper}.{key}" if wrapper else key

    def set(self, path: str, value: Any, source: str = "") -> None:
        """Set ``a.b.c`` in the config (creating mappings on the way); ``source`` is noted for the comments."""
        target = self.config
        parts = path.split(".")
        for part in parts[:-1]:
            target = target.setdefault(part, {})
        target[parts[-1]] = value
        if source:
            self.comments.setdefault(parts[0], []).append(f"{path} <- {self.where(source)}")

    def get(self, path: str, default: Any = None) -> Any:
        target: Any = self.config
        for part in path.split("."):
            if not isinstance(target, dict) or part not in target:
                return default
            target = target[part]
        return target

    def has(self, path: str) -> bool:
        marker = object()
        return self.get(path, marker) is not marker

    def line(self, key: str, verdict: str, detail: str) -> None:
        """One report line; a source key is named by its path in the file (a derived ``(key)`` as is)."""
        self.lines.append((key if key.startswith("(") else self.where(key), verdict, detail))


Apply = Callable[[Conversion, str, Any], str | None]


@dataclass(frozen=True)
class Rule:
    """How one source key (pattern) is carried over.

    ``target``: the posttrain key the value goes to (``value`` transforms it first), or a description of
    where it goes when ``apply`` does the work. ``verdict``: mapped, approximated, not needed, not supported.
    ``note``: the approximation, or why the key is not needed or not supported. ``apply(conversion, key,
    value)`` does custom work and may return a more precise detail for the line, or raise ``Unsupported``
    for a value it cannot carry over (the line then says why).
    """

    source: str
    target: str = ""
    verdict: str = SAME
    note: str = ""
    value: Callable[[Any], Any] | None = None
    apply: Apply | None = None
    only_if: Callable[[Any], bool] | None = None
    """Values outside this are not supported (``note`` says why); e.g. a parallel size other than 1."""
    whole: bool = False
    """The value is taken whole (a mapping such as ``peft_kwargs`` is not walked key by key)."""


class Unsupported(Exception):
    """A value a rule cannot carry over; the message says why."""


class NotNeeded(Exception):
    """A value a rule has nothing to carry over for (here, or given the rest of the file); the message says
    why."""


@dataclass(frozen=True)
class System:
    """A source system: its rules, its defaults that differ from posttrain's, and the hooks that prepare the
    flat keys and finish the config."""

    name: str
    title: str
    rules: tuple[Rule, ...]
    defaults: tuple[tuple[Any, ...], ...] = ()
    """(posttrain key, the source system's default, why it is stated[, the trainer types it applies to]) for
    defaults that differ from posttrain's."""
    unwrap: Callable[[dict[str, Any], Conversion], dict[str, Any]] = lambda data, conv: data
    finish: Callable[[Conversion], None] = lambda conv: None

    def rule_for(self, key: str) -> Rule | None:
        for rule in self.rules:
            if matches(rule.source, key):
                return rule
        return None

    def flatten(self, data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in data.items():
            path = f"{prefix}{key}"
            rule = self.rule_for(path)
            if isinstance(value, dict) and value and not (rule is not None and rule.whole):
                out.update(self.flatten(value, f"{path}."))
            else:
                out[path] = value
        return out


def adam_beta(index: int) -> Apply:
    """Adam's beta1 (index 0) or beta2 (1), written as one ``optimizer.betas`` pair."""

    def apply(conv: Conversion, key: str, value: Any) -> str:
        betas = list(conv.get("optimizer.betas", [0.9, 0.999]))
        betas[index] = value
        conv.set("optimizer.betas", betas, key)
        return f"optimizer.betas[{index}]"

    return apply


def remember(name: str, where: str) -> Apply:
    """Keep the value for the system's ``finish`` hook, which combines it with others; ``where`` says where
    it ends up."""

    def apply(conv: Conversion, key: str, value: Any) -> str:
        conv.scratch[name] = value
        return where

    return apply


def to(path: str, detail: str = "") -> Apply:
    """Write the value to ``path``; ``detail`` adds what the line should say about it."""

    def apply(conv: Conversion, key: str, value: Any) -> str:
        conv.set(path, value, key)
        return f"{path} ({detail})" if detail else path

    return apply


#: :func:`when_set` writes the source's own value
THE_VALUE = object()


def when_set(path: str, otherwise: str, write: Any = THE_VALUE) -> Apply:
    """A switch or an optional path: when the value is set (truthy), write it (or ``write``) to ``path``;
    otherwise write nothing and say ``otherwise``."""

    def apply(conv: Conversion, key: str, value: Any) -> str:
        if not value:
            return otherwise
        written = value if write is THE_VALUE else write
        conv.set(path, written, key)
        if write is THE_VALUE:
            return path
        return f"{path}: {str(written).lower() if isinstance(written, bool) else written}"

    return apply


def model_dtype(conv: Conversion, key: str, value: Any) -> str:
    """A dtype named as transformers does (``bfloat16``, ``torch.bfloat16``, ``auto``) as ``model.dtype``."""
    conv.set("model.dtype", str(value).removeprefix("torch."), key)
    return "model.dtype"


def process_count(conv: Conversion, key: str, value: Any) -> str:
    """A process or GPU count: posttrain takes it at the launch, not in the config."""
    return f"the launch: posttrain train run.yaml --nproc {value}"


def accept(allowed: tuple[Any, ...], why: str, detail: str) -> Apply:
    """A key whose only supported values need nothing written (posttrain's defaults)."""

    def apply(conv: Conversion, key: str, value: Any) -> str:
        if value not in allowed:
            raise Unsupported(why)
        return detail

    return apply


#: attention kernels of separate packages, which posttrain's sdpa path replaces
FLASH_KERNELS = ("flash_attention_2", "flash_attention_3")


def attention(conv: Conversion, key: str, value: str) -> str:
    """The source's attention kernel. A FlashAttention kernel becomes sdpa (posttrain's sdpa runs packed rows
    as one varlen call per layer on CUDA, with no package to build), unless ``--keep-attention``."""
    if value in FLASH_KERNELS and not conv.keep_attention:
        conv.set("model.attn_implementation", "sdpa", key)
        return (
            f"model.attn_implementation: sdpa ({value} needs its own package; posttrain's sdpa runs packed rows "
            "as one varlen call per layer on CUDA; --keep-attention keeps it)"
        )
    conv.set("model.attn_implementation", value, key)
    return f"model.attn_implementation: {value}"


def precision_flag(conv: Conversion, key: str, value: Any) -> str:
    """``bf16: true`` / ``fp16: true`` switches: the weights' dtype, which DeepSpeed's precision follows."""
    if value:
        conv.set("model.dtype", "float16" if key.endswith("fp16") else "bfloat16", key)
    return "model.dtype"


def optimizer_offload(conv: Conversion, key: str, value: Any) -> str:
    """An optimizer-offload switch: DeepSpeed's CPU Adam with ZeRO's optimizer offload."""
    if not value:
        return "no optimizer offload"
    conv.set("optimizer.type", "cpu_adam", key)
    conv.set("deepspeed.zero_optimization.offload_optimizer", {"device": "cpu"}, key)
    return "optimizer.type: cpu_adam + deepspeed.zero_optimization.offload_optimizer.device: cpu"


def resumable_engine(out: str, every: Any = 0, keep: Any = 0, resume: bool = True) -> dict[str, Any]:
    """The ``deepspeed`` checkpoint engine under ``out/checkpoints``: every ``every`` steps, the newest ``keep``
    kept (0 or less: all), resuming from there when ``resume``."""
    engine: dict[str, Any] = {"type": "deepspeed", "output_dir": f"{out}/checkpoints"}
    if every:  # a fraction below 1 stays one: a share of the run's steps, as Hugging Face reads it
        engine["save_every_n_steps"] = every if 0 < float(every) < 1 else int(every)
    if keep and int(keep) > 0:
        engine["save_total_limit"] = int(keep)
    engine["auto_resume"] = resume
    return engine


def export_engine(out: str, name: str = "export", merged: bool = False) -> dict[str, Any]:
    """The ``huggingface`` export at the end of training, under ``out/name``."""
    engine: dict[str, Any] = {
        "type": "huggingface",
        "output_dir": f"{out}/{name}",
        "save_end_of_training": True,
    }
    if merged:
        engine["save_merged"] = True
    return engine


def step_limit(otherwise: str) -> Apply:
    """``max_steps``-like keys: a positive value is ``train_iters``; 0 or -1 leaves the epochs in charge."""

    def apply(conv: Conversion, key: str, value: Any) -> str:
        if value is None or int(value) <= 0:
            return otherwise
        conv.set("train_iters", int(value), key)
        return "train_iters"

    return apply


#: what a converted config holds where the source file names no data (a partial file: an overlay, a recipe
#: override): a path the user replaces, reported on its own line
DATA_PLACEHOLDER = "REPLACE-WITH-DATA.jsonl"


def placeholder_data(conv: Conversion, why: str) -> None:
    """``data.sources`` for a file that names no data: a placeholder, and a line saying so."""
    conv.set("data.sources", [DATA_PLACEHOLDER], "no dataset in the file")
    conv.line("(data)", UNSUPPORTED, f"{why}: data.sources is a placeholder to replace")


def blend_sources(conv: Conversion, blend: list[tuple[str, Any]], split: Any, source: str) -> None:
    """Megatron-style indexed datasets (``weight prefix`` pairs, an optional ``998,1,1`` train/valid/test
    split) as ``type: megatron`` sources of a weighted mix, the split's valid part as the eval sources."""
    sources = []
    for prefix, weight in blend:
        item: dict[str, Any] = {"type": "megatron", "name_or_path": prefix, "sampling_weight": float(weight)}
        if split:
            item |= {"split": "train", "split_ratio": str(split)}
        sources.append(item)
    conv.set("data.sources", sources, source)
    if len(sources) > 1:
        conv.set("data.mix", "weighted", source)
    if split:
        evals = [{k: v for k, v in s.items() if k != "sampling_weight"} | {"split": "valid"} for s in sources]
        conv.set("data.eval_sources", evals, source)


def matches(pattern: str, key: str) -> bool:
    """Segment by segment: ``*`` never crosses a dot."""
    parts, segments = pattern.split("."), key.split(".")
    return len(parts) == len(segments) and all(
        fnmatch.fnmatchcase(segment, part) for part, segment in zip(parts, segments, strict=True)
    )


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 50 else text[:47] + "..."


def convert(
    system: System, data: dict[str, Any], keep_attention: bool = False, source: Path | None = None
) -> Conversion:
    """``source``: the file ``data`` was read from (paths it names, a DeepSpeed JSON or a dataset index,
    are looked for beside it)."""
    conv = Conversion(system.name, keep_attention=keep_attention)
    if source is not None:
        conv.scratch["source_path"] = source
    flat = system.flatten(system.unwrap(data, conv))
    for key, value in flat.items():
        rule = system.rule_for(key)
        if rule is None:
            conv.line(
                key,
                UNKNOWN,
                f"{_show(value)}: not a {system.title} key the converter knows; not carried over",
            )
            continue
        _apply(conv, rule, key, value)
    system.finish(conv)
    for path, value, why, *types in system.defaults:
        if types and conv.config.get("type") not in types[0]:
            continue
        if not conv.has(path):
            conv.set(path, value, f"{system.title}'s default")
            conv.line(f"({path})", DEFAULT, f"{value!r} written: {why}")
    return conv


def _apply(conv: Conversion, rule: Rule, key: str, value: Any) -> None:
    shown = _show(value)
    if value is None and rule.only_if is None and rule.verdict in (SAME, APPROX):
        # a dump's null (``eval_interval: null``): not set, so posttrain's default stands; never copied
        conv.line(key, NOT_NEEDED, "null: not set; posttrain's default applies")
        return
    if rule.only_if is not None and not rule.only_if(value):
        conv.line(key, UNSUPPORTED, f"{shown}: {rule.note}")
        return
    if rule.only_if is not None and rule.verdict == UNSUPPORTED:
        conv.line(key, NOT_NEEDED, f"{shown}: the default; nothing to carry over")
        return
    if rule.apply is None and (rule.verdict in (NOT_NEEDED, UNSUPPORTED) or not rule.target):
        # nothing to write: a rule with no target only reports (it must never write a key named '')
        conv.line(key, rule.verdict, f"{shown}: {rule.note}" if rule.note else shown)
        return
    try:
        if rule.apply is not None:
            detail = rule.apply(conv, key, value)
        else:
            conv.set(rule.target, rule.value(value) if rule.value else value, key)
            detail = None
    except Unsupported as exc:
        conv.line(key, UNSUPPORTED, f"{shown}: {exc}")
        return
    except NotNeeded as exc:
        conv.line(key, NOT_NEEDED, f"{shown}: {exc}")
        return
    where = detail or rule.target
    note = f" ({rule.note})" if rule.note and rule.verdict == APPROX else ""
    conv.line(key, rule.verdict, f"{shown} -> {where}{note}" if where else f"{shown}{note}")


def render_lines(conv: Conversion) -> str:
    width = max((len(key) for key, _, _ in conv.lines), default=0)
    return "\n".join(f"{key:<{width}}  {verdict:<13} {detail}" for key, verdict, detail in conv.lines)


def rules_markdown(system: System, intro: str) -> str:
    """The key mapping of ``system`` as a Markdown page (``docs/from-<system>.md``)."""
    out = [
        f"# From {system.title}",
        "",
        intro.strip(),
        "",
        f"Generated from the converter's table (`src/posttrain/convert/{system.name.replace('-', '_')}.py`) by "
        "`posttrain convert --docs`; a test keeps it current. `*` matches one key segment; the first matching "
        "row applies; a key no row matches is reported as unknown (never dropped without a line).",
        "",
        "| source key | posttrain | how |",
        "|---|---|---|",
    ]
    for rule in system.rules:
        how = rule.verdict + (f": {rule.note}" if rule.note else "")
        out.append(
            f"| `{rule.source}` | {f'`{rule.target}`' if rule.target else ''} | {how} |".replace("||", "| |")
        )
    if system.defaults:
        out += [
            "",
            f"Defaults of {system.title} that differ from posttrain's are written into the converted config:",
            "",
        ]
        out += ["| posttrain key | written value | why |", "|---|---|---|"]
        for path, value, why, *types in system.defaults:
            only = f" (`type: {'/'.join(types[0])}` only)" if types else ""
            out.append(f"| `{path}` | `{value!r}` | {why}{only} |")
    return "\n".join(out) + "\n"


#: posttrain's keys for what of a vision-language model is frozen
FREEZE_KEYS = (
    "model.freeze_vision_tower",
    "model.freeze_multi_modal_projector",
    "model.freeze_language_model",
)


def vision_freezes(
    conv: Conversion, frozen: dict[str, bool], key: str, own: tuple[str, ...] = FREEZE_KEYS
) -> str:
    """Write all three ``model.freeze_*`` keys from a source that names what it freezes: what it does not
    name trains (the source's default), whatever posttrain's own defaults are. ``own``: the targets ``key``
    itself sets (noted as its in the converted file)."""
    for target in FREEZE_KEYS:
        conv.set(target, bool(frozen.get(target, False)), key if target in own else "")
    named = [t.removeprefix("model.") for t in FREEZE_KEYS if frozen.get(t)]
    return f"{', '.join(named) or 'nothing'} frozen; the other parts train"
