"""``posttrain`` command line: parse, call, print. No training logic lives here."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from posttrain.errors import UserError
from posttrain.launch import EXIT_USER_ERROR, note_user_error
from posttrain.tiny_model import ARCHITECTURES


def _quiet_environment() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from posttrain.utils.imports import choose_accelerator_on_demand

    choose_accelerator_on_demand()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="posttrain", description="Fine-tune and post-train LLMs from one YAML file."
    )
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)  # set by launchers
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train from a YAML config")
    train.add_argument("config", type=Path)
    train.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. optimizer.lr=1e-4")
    train.add_argument("--nproc", type=int, default=1, help="processes on this machine (default 1)")
    train.add_argument(
        "--launcher",
        choices=("torchrun", "deepspeed"),
        default="torchrun",
        help="how --nproc processes are started (default torchrun)",
    )
    train.add_argument(
        "--launcher-args",
        default="",
        help="extra launcher arguments, quoted: torchrun's '--nnodes 2 --node_rank 0 --master_addr HOST' or "
        "DeepSpeed's '--hostfile FILE --include host1 --master_addr HOST'",
    )

    validate = sub.add_parser("validate", help="validate a config and print it with every default filled in")
    validate.add_argument("config", type=Path)
    validate.add_argument("overrides", nargs="*")
    validate.add_argument("--json", action="store_true", help="print JSON instead of YAML")
    validate.add_argument(
        "--check-paths",
        action="store_true",
        help="fail (exit 2) when a local input the config names is missing (default: a warning)",
    )

    preprocess = sub.add_parser(
        "preprocess",
        help="build and cache the data only, and print the pre-flight report and the memory plan (no weight "
        "is read)",
    )
    preprocess.add_argument("config", type=Path)
    preprocess.add_argument("overrides", nargs="*")
    preprocess.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="processes the run will use (default: --gpus-per-node, else 1)",
    )
    preprocess.add_argument("--color", action="store_true", help="highlight trained tokens with colour")
    preprocess.add_argument(
        "--json", action="store_true", help="print the data summary and memory plan as JSON"
    )
    preprocess.add_argument(
        "--gpu-memory", help="plan for GPUs of this much memory, e.g. 80GiB (default: found)"
    )
    preprocess.add_argument(
        "--host-memory", help="plan for hosts of this much memory, e.g. 512GiB (default: found)"
    )
    preprocess.add_argument(
        "--gpus-per-node", type=int, help="processes sharing one host's memory (default: the world size)"
    )

    plot_lr = sub.add_parser(
        "plot-lr", help="draw the run's learning-rate (and weight-decay) schedule to a PNG"
    )
    plot_lr.add_argument("config", type=Path)
    plot_lr.add_argument("overrides", nargs="*")
    plot_lr.add_argument(
        "--out", type=Path, default=None, help="PNG path (default <output_dir>/lr-schedule.png)"
    )
    plot_lr.add_argument(
        "--world-size", type=int, default=None, help="processes the run will use (default 1)"
    )

    init = sub.add_parser(
        "init", help="write a commented starter config that runs as is on a tiny local model"
    )
    init.add_argument("kind", nargs="?", default="sft", choices=("sft", "dpo", "causal", "lora"))
    init.add_argument(
        "-o", "--out", type=Path, default=Path("run.yaml"), help="config path (default run.yaml)"
    )

    plot = sub.add_parser("plot", help="draw loss, LR and throughput curves of one or more runs to a PNG")
    plot.add_argument(
        "metrics", type=Path, nargs="+", help="train-log-metrics.jsonl files (several: overlaid)"
    )
    plot.add_argument(
        "-o", "--out", type=Path, default=Path("curves.png"), help="PNG path (default curves.png)"
    )

    tiny = sub.add_parser(
        "tiny-model",
        help="write a tiny random LLaMA (or mixture-of-experts) model and BPE tokenizer (no network)",
    )
    tiny.add_argument("out_dir", type=Path)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--hidden-size", type=int, default=64)
    tiny.add_argument("--layers", type=int, default=2)
    tiny.add_argument("--vocab-size", type=int, default=2048)
    tiny.add_argument("--heads", type=int, default=4)
    tiny.add_argument(
        "--arch", choices=ARCHITECTURES, default="llama", help="llama (dense) or a mixture-of-experts family"
    )
    tiny.add_argument("--experts", type=int, default=8, help="MoE: experts per layer")
    tiny.add_argument("--top-k", type=int, default=2, help="MoE: experts per token")

    convert = sub.add_parser(
        "convert",
        help="convert a SiloGen, ERNIEKit or Megatron-Bridge config to a posttrain config, one line per key",
    )
    convert.add_argument("source", type=Path, nargs="?", help="the other system's config file")
    convert.add_argument(
        "--from",
        dest="system",
        choices=("silogen", "erniekit", "megatron-bridge"),
        help="the source system (detected from the keys when left out)",
    )
    convert.add_argument("-o", "--out", type=Path, help="write the posttrain config here (default: print it)")
    convert.add_argument(
        "--docs", action="store_true", help="print the key-mapping page of --from (docs/from-<system>.md)"
    )

    chat = sub.add_parser(
        "chat",
        help="chat with an export in the terminal (its chat template, replies streamed), or --prompt once",
    )
    chat.add_argument("export", type=Path, help="an export directory (a full model or a LoRA adapter)")
    chat.add_argument(
        "--prompt", help="ask once, print the reply and exit (default: a conversation on stdin)"
    )
    chat.add_argument("--system", help="a system message first")
    chat.add_argument("--raw", action="store_true", help="continue plain text, without the chat template")
    chat.add_argument("--max-new-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.7, help="0: greedy (default 0.7)")
    chat.add_argument("--top-p", type=float, default=1.0)
    chat.add_argument("--device", help="cpu, cuda, cuda:1... (default: a GPU when there is one)")

    merge = sub.add_parser(
        "merge", help="merge a LoRA (PEFT) adapter export into its base model: a standalone model directory"
    )
    merge.add_argument("adapter", type=Path, help="the adapter export (with adapter_config.json)")
    merge.add_argument("-o", "--out", type=Path, required=True, help="the merged model's directory (new)")

    schema = sub.add_parser(
        "schema", help="print the JSON schema of the config file (every registered component's config)"
    )
    schema.add_argument(
        "--markdown", action="store_true", help="print the config reference (docs/reference.md)"
    )
    return parser


def _load(config: Path, overrides: list[str], warn: bool = True):  # -> TrainerConfig
    """Load and validate; print a warning for every written key whose mode is off (``train`` leaves that to
    the run's rank 0, so that it is printed once however the run is launched)."""
    from posttrain.config import load_config
    from posttrain.config.mode_keys import inert_warnings

    loaded = load_config(config, overrides)
    if warn:
        for warning in inert_warnings(loaded):
            print(f"warning: {warning}", file=sys.stderr)
    return loaded


def cmd_validate(args: argparse.Namespace) -> int:
    import yaml

    from posttrain.config.paths import missing_inputs
    from posttrain.config.provenance import redact

    config = _load(args.config, args.overrides)
    missing = list(missing_inputs(config))
    if missing and args.check_paths:
        raise UserError("missing inputs:\n  - " + "\n  - ".join(missing))
    data = redact(config.model_dump(mode="json"))
    print(json.dumps(data, indent=2) if args.json else yaml.safe_dump(data, sort_keys=False), end="")
    for line in missing:
        print(f"warning: {line} (--check-paths makes this an error)", file=sys.stderr)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    if args.nproc < 1:
        raise UserError(f"--nproc {args.nproc}: must be >= 1 (the number of processes on this machine)")
    config = _load(args.config, args.overrides, warn=False)  # validate once before starting any process
    # launcher arguments always reach a launcher: `--nproc 1 --launcher-args '--nnodes 2 ...'` is one process
    # on each of two nodes in one run, not a world-size-1 run on each
    if (args.nproc > 1 or args.launcher_args.strip()) and "LOCAL_RANK" not in os.environ:
        from posttrain.launch import launch_train

        return launch_train(
            args.config,
            args.overrides,
            args.nproc,
            args.launcher,
            args.launcher_args,
            config.kill_switch_path,
        )
    from posttrain.run import run

    run(config)
    return 0


def _world_size(value: int | None) -> int:
    if value is not None and value < 1:
        raise UserError(f"--world-size {value}: must be >= 1 (the number of processes the run will use)")
    return value or int(os.environ.get("WORLD_SIZE", "1"))


def _preflight(args: argparse.Namespace) -> tuple[Any, Any]:
    """What ``preprocess`` and ``plot-lr`` share: the validated config and its pre-flight (data and steps)."""
    config = _load(args.config, args.overrides)
    from posttrain.logs import setup_logging
    from posttrain.preflight import preflight

    setup_logging(config.logger, 0)
    world = args.world_size if args.world_size is not None else getattr(args, "gpus_per_node", None)
    return config, preflight(config, _world_size(world))


def cmd_preprocess(args: argparse.Namespace) -> int:
    from posttrain.memory.machine import described, detect
    from posttrain.preflight import memory_report, report_text

    # with --json, stdout holds the JSON alone: the log lines go to stderr
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        config, flight = _preflight(args)
        world = flight.sizes.world_size * flight.config.sequence_parallel_size
        machine = described(args.gpu_memory, args.host_memory, args.gpus_per_node, world) or detect(world)
        text, data = memory_report(flight, machine)
    if args.json:
        print(json.dumps({"data": flight.summary(), "memory": data}, indent=2))
    else:
        print(report_text(flight, config, color=args.color) + "\n\n" + text)
    return 0


def cmd_plot_lr(args: argparse.Namespace) -> int:
    from posttrain.preflight import plot_lr

    config, flight = _preflight(args)
    out = plot_lr(flight, args.out or Path(config.logger.output_dir) / "lr-schedule.png")
    print(f"wrote {out} ({flight.total_steps} steps)")
    return 0


def cmd_init(args: argparse.Namespace) -> int:
    from posttrain.starters import write_starter

    written = write_starter(args.kind, args.out)
    for path in written:
        print(f"wrote {path}")
    print(f"next: posttrain preprocess {args.out}  then  posttrain train {args.out}")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from posttrain.tracking.plot import plot_metrics

    print(f"wrote {plot_metrics(args.metrics, args.out)}")
    return 0


def cmd_tiny_model(args: argparse.Namespace) -> int:
    from posttrain.tiny_model import write_tiny_model

    out = write_tiny_model(
        args.out_dir,
        seed=args.seed,
        hidden_size=args.hidden_size,
        layers=args.layers,
        vocab_size=args.vocab_size,
        heads=args.heads,
        arch=args.arch,
        experts=args.experts,
        top_k=args.top_k,
    )
    print(f"wrote {out}")
    return 0


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
    print(convert.main(args.source, args.system, args.out), end="")
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    if args.markdown:
        from posttrain.config.reference import reference_markdown

        print(reference_markdown(), end="")
        return 0
    from posttrain.config.schema import config_schema

    print(json.dumps(config_schema(), indent=2))
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from posttrain.inference.chat import Sampling, chat

    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p)
    return chat(
        args.export,
        prompt=args.prompt,
        system=args.system,
        raw=args.raw,
        sampling=sampling,
        device=args.device,
    )


def cmd_merge(args: argparse.Namespace) -> int:
    from posttrain.inference.merge import merge_adapter

    print(f"wrote {merge_adapter(args.adapter, args.out)}")
    return 0


COMMANDS = {
    "train": cmd_train,
    "validate": cmd_validate,
    "preprocess": cmd_preprocess,
    "plot-lr": cmd_plot_lr,
    "plot": cmd_plot,
    "init": cmd_init,
    "tiny-model": cmd_tiny_model,
    "schema": cmd_schema,
    "convert": cmd_convert,
    "chat": cmd_chat,
    "merge": cmd_merge,
}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _quiet_environment()
    from posttrain.config.errors import ConfigError

    try:
        return COMMANDS[args.command](args)
    except ConfigError as exc:
        print(exc.render(), file=sys.stderr)
        note_user_error()
        return EXIT_USER_ERROR
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        note_user_error()
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
