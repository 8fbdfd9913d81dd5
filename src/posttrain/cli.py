"""``posttrain`` command line: parse, call, print. No training logic lives here."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from posttrain.errors import UserError
from posttrain.testing.tiny import ARCHITECTURES

EXIT_USER_ERROR = 2


def _quiet_environment() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if "DS_ACCELERATOR" not in os.environ:
        import torch

        os.environ["DS_ACCELERATOR"] = "cuda" if torch.cuda.is_available() else "cpu"


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

    preprocess = sub.add_parser(
        "preprocess",
        help="build and cache the data only, and print the pre-flight report (no model is loaded)",
    )
    preprocess.add_argument("config", type=Path)
    preprocess.add_argument("overrides", nargs="*")
    preprocess.add_argument(
        "--world-size", type=int, default=None, help="processes the run will use (default: --nproc 1)"
    )
    preprocess.add_argument("--color", action="store_true", help="highlight trained tokens with colour")

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

    from posttrain.config.provenance import redact

    config = _load(args.config, args.overrides)
    data = redact(config.model_dump(mode="json"))
    print(json.dumps(data, indent=2) if args.json else yaml.safe_dump(data, sort_keys=False), end="")
    return 0


def _launch(args: argparse.Namespace, kill_switch: str) -> int:
    """Re-run this command with ``--nproc`` processes on this node through torchrun or DeepSpeed's launcher;
    ``--launcher-args`` pass through (nodes, master address/port, hostfile, include/exclude)."""
    import shlex

    from posttrain.dist import free_port

    extra = shlex.split(args.launcher_args)
    port = (
        []
        if any(a.startswith(("--master_port", "--master-port", "--rdzv")) for a in extra)
        else [f"--master_port={free_port()}"]
    )
    # launcher module, its process-count flag, and how it is told to run a module
    launchers = {
        "deepspeed": ("deepspeed.launcher.runner", f"--num_gpus={args.nproc}", "--module"),
        "torchrun": ("torch.distributed.run", f"--nproc_per_node={args.nproc}", "-m"),
    }
    module, nproc_flag, module_flag = launchers[args.launcher]
    command = [sys.executable, "-m", module, nproc_flag, *port, *extra, module_flag, "posttrain"]
    command += ["train", str(args.config), *args.overrides]
    return _run_relaying_signals(command, kill_switch)


#: set by ``--nproc`` for the ranks: where a rank that stops on a user error (bad config or data) notes it
USER_ERROR_DIR = "POSTTRAIN_USER_ERROR_DIR"


def _note_user_error() -> None:
    directory = os.environ.get(USER_ERROR_DIR)
    if directory and "RANK" in os.environ:
        Path(directory, f"rank-{os.environ['RANK']}").write_text("user error\n")


def _filter_launcher_errors(stream: Any, user_errors: Path) -> None:
    """Pass the launcher's standard error through, except, when a rank stopped on a user error (its message
    is already printed), the launcher's own ``ChildFailedError`` traceback and failure report."""
    held: list[str] = []
    dropping = False
    for line in stream:
        if dropping:
            continue
        if held or line.startswith("Traceback (most recent call last):"):
            held.append(line)
            if (
                line[:1].isspace()
                or line.startswith(("Traceback", "During handling", "The above"))
                or not line.strip()
            ):
                continue
            if "ChildFailedError" in line and any(user_errors.iterdir()):
                dropping = True
            else:
                sys.stderr.writelines(held)
            held = []
            continue
        if "failed (exitcode: 2)" in line and "torch/distributed/elastic" in line:
            continue  # the launcher's log line for a rank that exited on a user error
        sys.stderr.write(line)
    sys.stderr.writelines(held)
    sys.stderr.flush()


def _run_relaying_signals(command: list[str], kill_switch: str) -> int:
    """Run the launcher in its own session and turn SIGTERM/SIGINT sent to this process into the run's kill
    switch: every rank then stops after the same step, saves, and exits 0. A second SIGINT kills the job.
    A rank that stops on a user error makes the whole command exit with status 2."""
    import signal
    import tempfile
    import threading

    user_errors = Path(tempfile.mkdtemp(prefix="posttrain-errors-"))
    env = {**os.environ, USER_ERROR_DIR: str(user_errors)}
    process = subprocess.Popen(command, start_new_session=True, env=env, stderr=subprocess.PIPE, text=True)
    assert process.stderr is not None
    forward = threading.Thread(
        target=_filter_launcher_errors, args=(process.stderr, user_errors), daemon=True
    )
    forward.start()
    received: list[str] = []

    def relay(signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if received and signum == signal.SIGINT:
            os.killpg(process.pid, signal.SIGKILL)
            return
        received.append(name)
        Path(kill_switch).parent.mkdir(parents=True, exist_ok=True)
        Path(kill_switch).write_text(f"{name} received by the launcher\n")
        print(f"{name} received: every process stops after its current step ({kill_switch})", flush=True)

    previous = {sig: signal.signal(sig, relay) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = process.wait()
        forward.join()
        return EXIT_USER_ERROR if code and any(user_errors.iterdir()) else code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(user_errors, ignore_errors=True)


def cmd_train(args: argparse.Namespace) -> int:
    if args.nproc < 1:
        raise UserError(f"--nproc {args.nproc}: must be >= 1 (the number of processes on this machine)")
    config = _load(args.config, args.overrides, warn=False)  # validate once before starting any process
    # launcher arguments always reach a launcher: `--nproc 1 --launcher-args '--nnodes 2 ...'` is one process
    # on each of two nodes in one run, not a world-size-1 run on each
    if (args.nproc > 1 or args.launcher_args.strip()) and "LOCAL_RANK" not in os.environ:
        return _launch(args, config.kill_switch_path)
    from posttrain.run import run

    run(config)
    return 0


def _world_size(value: int | None) -> int:
    if value is not None and value < 1:
        raise UserError(f"--world-size {value}: must be >= 1 (the number of processes the run will use)")
    return value or int(os.environ.get("WORLD_SIZE", "1"))


def cmd_preprocess(args: argparse.Namespace) -> int:
    config = _load(args.config, args.overrides)
    from posttrain.logs import setup_logging
    from posttrain.preflight import preflight, report_text

    setup_logging(config.logger, 0)
    flight = preflight(config, _world_size(args.world_size))
    print(report_text(flight, config, color=args.color))
    return 0


def cmd_plot_lr(args: argparse.Namespace) -> int:
    config = _load(args.config, args.overrides)
    from posttrain.logs import setup_logging
    from posttrain.preflight import plot_lr, preflight

    setup_logging(config.logger, 0)
    flight = preflight(config, _world_size(args.world_size))
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
    from posttrain.testing.tiny import write_tiny_model

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
}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _quiet_environment()
    from posttrain.config.errors import ConfigError

    try:
        return COMMANDS[args.command](args)
    except ConfigError as exc:
        print(exc.render(), file=sys.stderr)
        _note_user_error()
        return EXIT_USER_ERROR
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        _note_user_error()
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
