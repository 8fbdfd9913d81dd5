"""Tools around a run: ``init``, ``plot``, ``tiny-model``, ``convert``, ``schema``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from posttrain.commands import command
from posttrain.convert import SYSTEM_NAMES
from posttrain.errors import UserError
from posttrain.tiny_model import ARCHITECTURES
from posttrain.vision.tiny import VISION_ARCHITECTURES

# --------------------------------------------------------------------------------- starters and plots


def _plot_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "metrics", type=Path, nargs="+", help="train-log-metrics.jsonl files (several: overlaid)"
    )
    parser.add_argument(
        "-o", "--out", type=Path, default=Path("curves.png"), help="PNG path (default curves.png)"
    )


@command(
    "plot",
    "draw loss, LR and throughput curves of one or more runs to a PNG",
    _plot_arguments,
    """Draw train and eval loss, LR and tokens/s against steps (and the reward of online RL, generation ahead
    of training, the harness tasks run during training); several runs are overlaid.""",
)
def cmd_plot(args: argparse.Namespace) -> int:
    from posttrain.tracking.plot import plot_metrics

    print(f"wrote {plot_metrics(args.metrics, args.out)}")
    return 0


def _init_arguments(parser: argparse.ArgumentParser) -> None:
    from posttrain.starters import STARTERS

    parser.add_argument(
        "kind", nargs="?", default="sft", choices=tuple(STARTERS), help="the method (default sft)"
    )
    parser.add_argument(
        "-o", "--out", type=Path, default=Path("run.yaml"), help="config path (default run.yaml)"
    )


@command(
    "init",
    "write a commented starter config that runs as is on a tiny local model",
    _init_arguments,
    """Write a commented starter config for a method, plus a tiny local model and a small dataset beside it
    when missing; it runs as is (posttrain train run.yaml).""",
)
def cmd_init(args: argparse.Namespace) -> int:
    from posttrain.starters import write_starter

    for path in write_starter(args.kind, args.out):
        print(f"wrote {path}")
    print(f"next: posttrain preprocess {args.out}  then  posttrain train {args.out}")
    return 0


def _tiny_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out_dir", type=Path, help="the model directory to write")
    parser.add_argument(
        "--seed", type=int, default=0, help="weights, tokenizer and its training text follow it"
    )
    parser.add_argument("--hidden-size", type=int, default=64, help="the model width")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers")
    parser.add_argument("--vocab-size", type=int, default=2048, help="the BPE tokenizer's vocabulary")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (half as many key/value heads)")
    parser.add_argument(
        "--arch",
        choices=(*ARCHITECTURES, *VISION_ARCHITECTURES),
        default="llama",
        help="llama (dense), an MoE family, or a vision-language model with its processor "
        f"({', '.join(VISION_ARCHITECTURES)})",
    )
    parser.add_argument("--experts", type=int, default=8, help="MoE: experts per layer")
    parser.add_argument("--top-k", type=int, default=2, help="MoE: experts per token")
    parser.add_argument(
        "--tied", action="store_true", help="the LM head is the input embedding (Qwen2.5, Llama 3.2, Gemma)"
    )


@command(
    "tiny-model",
    "write a tiny random LLaMA (mixture-of-experts, vision-language) model and BPE tokenizer (no network)",
    _tiny_model_arguments,
    """Write a small random model (LLaMA, a mixture-of-experts family, or a vision-language model with its
    processor: Idefics3/SmolVLM, LLaVA, Gemma 3 or, where torchvision imports, the Qwen-VL family, at 32x32
    pixels) and a byte-level BPE tokenizer with a ChatML
    template ({% generation %} markers), deterministic per seed; nothing is downloaded.""",
)
def cmd_tiny_model(args: argparse.Namespace) -> int:
    from posttrain.tiny_model import write_tiny_model
    from posttrain.vision.tiny import write_tiny_vlm

    if args.arch in VISION_ARCHITECTURES:
        shape = ("seed", "hidden_size", "layers", "vocab_size", "heads", "tied")
        print(
            f"wrote {write_tiny_vlm(args.out_dir, args.arch, **{name: getattr(args, name) for name in shape})}"
        )
        return 0
    options = ("seed", "hidden_size", "layers", "vocab_size", "heads", "arch", "experts", "top_k", "tied")
    print(f"wrote {write_tiny_model(args.out_dir, **{name: getattr(args, name) for name in options})}")
    return 0


# ------------------------------------------------------------------------------- converters and schema


def _convert_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", type=Path, nargs="?", help="the other system's config file")
    parser.add_argument(
        "--from",
        dest="system",
        choices=SYSTEM_NAMES,
        help="detected when left out",
    )
    parser.add_argument("-o", "--out", type=Path, help="write the posttrain config here (default: print it)")
    parser.add_argument("--docs", action="store_true", help="print the key-mapping page of --from")
    parser.add_argument(
        "--keep-attention",
        action="store_true",
        help="keep a flash_attention_2/_3 the source names (default: sdpa, no package needed)",
    )


@command(
    "convert",
    "convert a TRL, Axolotl, LLaMA-Factory, SiloGen, ERNIEKit or Megatron-Bridge config, one line per key",
    _convert_arguments,
    """Convert another system's config (the system is detected from its keys when --from is left out) into a
    commented posttrain config, printing one line per source key: where it went, how it was approximated, or
    why it is not supported (tensor parallelism, FP8...); nothing is dropped without a line. Key tables:
    docs/from-<system>.md (trl, axolotl, llama-factory, silogen, erniekit, megatron-bridge).""",
)
def cmd_convert(args: argparse.Namespace) -> int:
    from posttrain.convert import run as convert

    if args.docs:
        if args.system is None:
            raise UserError("--docs needs --from silogen|erniekit|megatron-bridge")
        print(convert.docs_page(args.system), end="")
        return 0
    if args.source is None:
        raise UserError(
            "name the config file to convert: posttrain convert FILE [--from SYSTEM] [-o run.yaml]"
        )
    print(convert.main(args.source, args.system, args.out, args.keep_attention), end="")
    return 0


def _schema_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--markdown", action="store_true", help="print the config reference (docs/reference.md)"
    )


@command(
    "schema",
    "print the JSON schema of the config file (every registered component)",
    _schema_arguments,
    """Print the JSON schema of the config file with every registered component's config (for editors), or
    the Markdown reference (docs/reference.md, generated from the field docstrings).""",
)
def cmd_schema(args: argparse.Namespace) -> int:
    if args.markdown:
        from posttrain.config.docs_page import reference_markdown

        print(reference_markdown(), end="")
        return 0
    from posttrain.config.schema import config_schema

    print(json.dumps(config_schema(), indent=2))
    return 0


# ------------------------------------------------------------------------------------------ the sandbox


def _sandbox_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True)
    run = actions.add_parser("run", help="run FILE.py exactly as the python tool runs model code")
    run.add_argument("file", type=Path, help="the Python program")
    run.add_argument("--timeout", type=float, default=None, help="wall-clock seconds (default the tool's 10)")
    run.add_argument("--json", action="store_true", help="print {returncode, stdout, stderr, timed_out}")
    score = actions.add_parser("score", help="score FILE.py as code_tests scores a completion")
    score.add_argument("file", type=Path, help="the code (a completion's last Python block)")
    score.add_argument("--tests", type=Path, required=True, help="one test per line (assert f(2) == 4)")
    score.add_argument(
        "--timeout", type=float, default=None, help="wall-clock seconds (default code_tests' 10)"
    )
    score.add_argument("--json", action="store_true", help='print {"score": ...}')
    for action in (run, score):
        action.add_argument(
            "--accept-weaker",
            action="store_true",
            help="run where this machine's sandbox lacks a confinement (as sandbox_accept_weaker: true)",
        )
    actions.add_parser("check", help="what the sandbox holds on this machine, one line per confinement")


@command(
    "sandbox",
    "run, score or check the sandbox that model-written code runs in",
    _sandbox_arguments,
    """The sandbox of the python tool and the code_tests reward, by hand. run FILE.py runs it as the tool runs
    model code and prints what it printed (--json: returncode, stdout, stderr, timed_out); posttrain exits 0
    whenever the program ran, whatever it did. score FILE.py --tests TESTS.py scores FILE as code_tests scores a
    completion whose code is FILE and whose tests are TESTS's lines. check prints what holds on this machine,
    one line per confinement, and exits 1 when a required one is missing. run and score refuse (exit 2, the
    python tool's line) where a required confinement is missing, unless --accept-weaker.""",
)
def cmd_sandbox(args: argparse.Namespace) -> int:
    from posttrain.sandbox import confine as sandbox

    if args.action == "check":
        found = sandbox.confinement()
        for line in found.held:
            print(f"holds: {line}")
        for line in found.missing:
            print(f"MISSING: {line}")
        return 1 if found.missing else 0
    code = _read(args.file, str(args.file))
    limits = (
        sandbox.Limits()
        if args.timeout is None
        else sandbox.Limits(wall=args.timeout, cpu=int(args.timeout) + 1)
    )
    # the rule of the python tool and the code_tests reward: refused where a confinement is missing, unless
    # accepted as the run's sandbox_accept_weaker accepts it
    missing = sandbox.require(args.accept_weaker, key="--accept-weaker").missing
    if args.action == "run":
        _show_run(sandbox.run_python(code, limits, strict=not missing), args.json)
        return 0
    from posttrain.sandbox.code_tests import tests_passed

    tests = [line for line in _read(args.tests, f"--tests {args.tests}").splitlines() if line.strip()]
    score = tests_passed(code, tests, limits, strict=not missing)
    print(json.dumps({"score": score}) if args.json else f"score {score:g} ({len(tests)} tests)")
    return 0


def _read(path: Path, named: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as error:
        raise UserError(f"{named}: cannot read it ({error.strerror})") from None


def _shown(text: str, stream: Any) -> str:
    """What a program printed, for ``stream``: on a terminal its control characters (escape sequences that
    would move the cursor, retitle the window or rewrite earlier lines) written as escapes, newlines and tabs
    kept."""
    if not stream.isatty():
        return text
    return "".join(
        c if c in "\n\t" or (c.isprintable() and not 0x7F <= ord(c) <= 0x9F) else repr(c)[1:-1] for c in text
    )


def _show_run(ran: Any, as_json: bool) -> None:
    """What a sandboxed program printed, and how it ended (``--json``: one object)."""
    if as_json:
        print(json.dumps({k: getattr(ran, k) for k in ("returncode", "stdout", "stderr", "timed_out")}))
        return
    print(_shown(ran.stdout, sys.stdout), end="")
    print(_shown(ran.stderr, sys.stderr), end="", file=sys.stderr)
    print(f"(exit {ran.returncode}{', timed out' if ran.timed_out else ''})")
