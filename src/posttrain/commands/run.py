"""The run's commands: ``train``, ``validate``, ``preprocess``, ``plot-lr``."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from posttrain.commands import command, config_arguments, load
from posttrain.errors import UserError

# ------------------------------------------------------------------------------------------------ train


def _train_arguments(parser: argparse.ArgumentParser) -> None:
    config_arguments(parser)
    parser.add_argument("--nproc", type=int, default=1, help="processes on this machine (default 1)")
    parser.add_argument(
        "--launcher",
        choices=("torchrun", "deepspeed"),
        default="torchrun",
        help="how --nproc processes start",
    )
    parser.add_argument(
        "--launcher-args",
        default="",
        help="extra launcher arguments, quoted: torchrun's '--nnodes 2 --node_rank 0 --master_addr HOST' or "
        "DeepSpeed's '--hostfile FILE --include host1 --master_addr HOST'",
    )


@command(
    "train",
    "train from a YAML config",
    _train_arguments,
    """Validate the config, check its batch sizes for the processes it will run on, then train. --nproc N
    starts N processes on this node through torchrun (default) or DeepSpeed's launcher (gloo on CPU, nccl on
    GPU); --launcher-args passes arguments through (torchrun: --nnodes, --node_rank, --master_addr; DeepSpeed:
    --hostfile, --include, --exclude, --master_addr).""",
)
def cmd_train(args: argparse.Namespace) -> int:
    from posttrain.training.stops import stop_during_set_up

    with stop_during_set_up():  # a signal before the first step ends the command with one line
        return _train(args)


def _train(args: argparse.Namespace) -> int:
    if args.nproc < 1:
        raise UserError(f"--nproc {args.nproc}: must be >= 1 (the number of processes on this machine)")
    config = load(args.config, args.overrides, warn=False)  # validate once before starting any process
    # before starting processes, when this node's --nproc is the world size (a launched rank, or several
    # nodes, check their real world size before their model loads: run.set_up)
    if not args.launcher_args.strip() and "LOCAL_RANK" not in os.environ:
        from posttrain.plan import resolve

        resolve(config, args.nproc)
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
    from posttrain.dist import exit_launched_rank
    from posttrain.run import run

    run(config)
    exit_launched_rank()  # a launched rank ends here, past the interpreter's teardown of gloo's threads
    return 0


# --------------------------------------------------------------------------------------------- validate


def _validate_arguments(parser: argparse.ArgumentParser) -> None:
    config_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of YAML")
    parser.add_argument(
        "--check-paths",
        action="store_true",
        help="fail (exit 2) when a local input the config names is missing",
    )
    _world_size_argument(parser, "none: only what holds for every world size is checked")


@command(
    "validate",
    "validate a config and print it with every default filled in",
    _validate_arguments,
    """Print the fully resolved config (YAML, or JSON); writes nothing, reads no model. Warns about local inputs
    (data files, model directories, a template file) that are missing, or fails on them with --check-paths.
    With --world-size N it also checks the batch sizes for N processes, as train does before any model
    loads. Answers in well under a second (a config with model.peft_config imports PEFT to check it: about
    5 s).""",
)
def cmd_validate(args: argparse.Namespace) -> int:
    import yaml

    from posttrain.config.paths import missing_inputs
    from posttrain.config.provenance import redact

    config = load(args.config, args.overrides)
    if args.world_size is not None:  # the batch sizes for that many processes, as train checks them
        from posttrain.plan import resolve

        resolve(config, _world_size(args.world_size))
    missing = list(missing_inputs(config))
    if missing and args.check_paths:
        raise UserError("missing inputs:\n  - " + "\n  - ".join(missing))
    if config.checks_model and not missing:  # the method's checks on the model's facts, as train runs them
        from posttrain.stages.data import model_facts
        from posttrain.utils.hub import looks_local

        facts = model_facts(config) if looks_local(config.model.name_or_path) else None
        if facts is not None:
            config.refuse_model_problems(facts)
    data = redact(config.model_dump(mode="json"))
    print(json.dumps(data, indent=2) if args.json else yaml.safe_dump(data, sort_keys=False), end="")
    for line in missing:
        print(f"warning: {line} (--check-paths makes this an error)", file=sys.stderr)
    return 0


# ------------------------------------------------------------------------------- preprocess and plot-lr


def _world_size_argument(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--world-size", type=int, help=f"processes the run will use (default: {default})")


def _world_size(world: int) -> int:
    if world < 1:
        raise UserError(f"--world-size {world}: must be >= 1 (the number of processes the run will use)")
    return world


def _preflight(args: argparse.Namespace) -> tuple[Any, Any]:
    """What ``preprocess`` and ``plot-lr`` share: the validated config and its pre-flight (data and steps)."""
    config = load(args.config, args.overrides)
    from posttrain.logs import setup_logging
    from posttrain.preflight import preflight

    setup_logging(config.logger, 0)
    world = args.world_size if args.world_size is not None else getattr(args, "gpus_per_node", None)
    world = _world_size(world) if world is not None else int(os.environ.get("WORLD_SIZE", "1"))
    return config, preflight(config, world)


def _preprocess_arguments(parser: argparse.ArgumentParser) -> None:
    config_arguments(parser)
    _world_size_argument(parser, "--gpus-per-node, else 1")
    parser.add_argument("--color", action="store_true", help="highlight trained tokens with colour")
    parser.add_argument("--json", action="store_true", help="print the data summary and memory plan as JSON")
    parser.add_argument("--gpu-memory", help="plan for GPUs of this much memory, e.g. 80GiB (default: found)")
    parser.add_argument(
        "--host-memory", help="plan for hosts of this much memory, e.g. 512GiB (default: found)"
    )
    parser.add_argument(
        "--gpus-per-node", type=int, help="processes sharing one host (default: the world size)"
    )


@command(
    "preprocess",
    "build and cache the data only, and print the pre-flight report and the memory plan (no weight is read)",
    _preprocess_arguments,
    """Build and cache the data exactly as train would (no weight is read) and print the pre-flight report:
    rows read, dropped or truncated and why, token totals, trained-token share, padding or packing efficiency,
    steps per epoch and in total, two rendered samples with the trained tokens marked, the end-of-turn check,
    and the memory plan (docs/memory-plan.md) for this machine or the one the flags describe. --json prints
    the numbers and the plan as JSON.""",
)
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


def _plot_lr_arguments(parser: argparse.ArgumentParser) -> None:
    config_arguments(parser)
    parser.add_argument("--out", type=Path, help="PNG path (default <output_dir>/lr-schedule.png)")
    _world_size_argument(parser, "1")


@command(
    "plot-lr",
    "draw the run's learning-rate (and weight-decay) schedule to a PNG",
    _plot_lr_arguments,
    """Draw the run's learning-rate schedule (and weight decay, when it changes) to a PNG, counted in the
    optimizer steps train will take (the same data plan).""",
)
def cmd_plot_lr(args: argparse.Namespace) -> int:
    from posttrain.preflight import plot_lr

    config, flight = _preflight(args)
    out = plot_lr(flight, args.out or Path(config.logger.output_dir) / "lr-schedule.png")
    print(f"wrote {out} ({flight.total_steps} steps)")
    return 0
