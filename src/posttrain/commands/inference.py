"""After training: ``chat`` with an export, ``merge`` an adapter into its base, ``eval`` it with the harness; beside a run: ``vllm-serve``,
the generation server of online RL's server mode."""

from __future__ import annotations

import argparse
from pathlib import Path

from posttrain.commands import command, config_arguments, load

# ------------------------------------------------------------------------------------ after training


def _chat_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("export", type=Path, help="an export directory (a full model or a LoRA adapter)")
    parser.add_argument(
        "--prompt", help="ask once, print the reply and exit (default: a conversation on stdin)"
    )
    parser.add_argument("--system", help="a system message first")
    parser.add_argument("--raw", action="store_true", help="continue plain text, without the chat template")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="the longest reply")
    parser.add_argument("--temperature", type=float, default=0.7, help="0: greedy (default 0.7)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1: off)")
    parser.add_argument("--device", help="cpu, cuda, cuda:1... (default: a GPU when there is one)")
    parser.add_argument(
        "--image",
        type=Path,
        action="append",
        default=[],
        help="an image for a vision-language export, put before the first question (repeatable)",
    )


@command(
    "chat",
    "chat with an export in the terminal (its chat template, replies streamed)",
    _chat_arguments,
    """Talk to an export (a full model or a LoRA adapter on its base) with its own chat template, the reply
    streamed as it is generated; --prompt asks once, otherwise a conversation on stdin (/reset, /exit); --raw
    continues plain text; --temperature 0 is greedy.""",
)
def cmd_chat(args: argparse.Namespace) -> int:
    from posttrain.inference.chat import Sampling, chat

    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p)
    options = {"prompt": args.prompt, "system": args.system, "raw": args.raw, "device": args.device}
    return chat(args.export, sampling=sampling, images=tuple(args.image), **options)


def _merge_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("adapter", type=Path, help="the adapter export (with adapter_config.json)")
    parser.add_argument("-o", "--out", type=Path, required=True, help="the merged model's directory (new)")


@command(
    "merge",
    "merge a LoRA (PEFT) adapter export into its base model",
    _merge_arguments,
    """Merge a LoRA (PEFT) adapter export into its base model: a standalone model directory with the tokenizer
    and a model card, loaded by plain transformers.""",
)
def cmd_merge(args: argparse.Namespace) -> int:
    from posttrain.inference.merge import merge_adapter

    print(f"wrote {merge_adapter(args.adapter, args.out)}")
    return 0


def _eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", type=Path, help="an export or any local model directory (a LoRA export too)")
    parser.add_argument(
        "--tasks", required=True, help="harness task names, comma-separated (lm-eval ls tasks)"
    )
    parser.add_argument("--include-path", type=Path, help="a directory (or file) of local task YAMLs")
    parser.add_argument("--limit", type=float, help="at most N documents per task (a fraction when < 1)")
    parser.add_argument("--batch-size", default="1", help="documents per batch, or auto (default 1)")
    parser.add_argument("--num-fewshot", type=int, help="examples in each prompt (default: the task's)")
    parser.add_argument(
        "--backend", default="hf", choices=["hf", "vllm"], help="transformers, or vLLM where it is installed"
    )
    parser.add_argument(
        "--apply-chat-template", action="store_true", help="render prompts with the model's chat template"
    )
    parser.add_argument("--device", help="cpu, cuda, cuda:1... (default: a GPU when there is one)")
    parser.add_argument(
        "--output-path", type=Path, help="write the results JSON there (a .json file or a directory)"
    )
    parser.add_argument("--json", action="store_true", help="print the harness's results dict, not its table")
    parser.add_argument(
        "--log-samples",
        action="store_true",
        help="keep each document's prompt and response in the results (the harness's --log_samples)",
    )
    parser.add_argument(
        "--card",
        action="store_true",
        help="write each task before training (the base, evaluated once and cached) and after into the "
        "export's model card",
    )
    parser.add_argument(
        "--base", type=Path, help="the model before training for --card (default: the card's)"
    )


@command(
    "eval",
    "evaluate a model directory with EleutherAI's lm-evaluation-harness (its tasks or local ones)",
    _eval_arguments,
    """Run lm-evaluation-harness tasks (lm_eval's own simple_evaluate, so its numbers) on an export or any local
    model directory; a LoRA export runs on its base. Tasks are checked before the model loads: an unknown name
    (with the close ones), a local task YAML that does not parse, a Hub dataset on an offline machine (HF_HUB_OFFLINE).
    The device is a GPU when there is one, else the CPU. Prints the harness's table, or its results dict with
    --json; --output-path writes the JSON; --card writes each task before training (the base model, evaluated once
    and cached by model, task and settings) and after into the export's model card. Needs pip install
    'posttrain[eval]'.""",
)
def cmd_eval(args: argparse.Namespace) -> int:
    import sys

    from posttrain.inference import harness

    evaluation = harness.evaluation_of(args)
    base = harness.resolve_base(args.model, args.base) if args.card else None
    results = harness.evaluate(evaluation)
    if not results:
        return 0
    if args.output_path:
        print(f"wrote {harness.write_results(results, args.output_path)}", file=sys.stderr)
    if base is not None:
        card, cached = harness.before_and_after(evaluation, results, base)
        reused = f" (before: {', '.join(cached)} from the cache)" if cached else ""
        print(f"wrote {card}: before training ({base}) and after{reused}", file=sys.stderr)
    print(harness.as_json(results) if args.json else harness.table(results))
    return 0


# ------------------------------------------------------------------------------------ beside a run


def _vllm_serve_arguments(parser: argparse.ArgumentParser) -> None:
    config_arguments(parser)
    parser.add_argument("--host", help="the address to listen on (default: the config's vllm_server_host)")
    parser.add_argument(
        "--port",
        type=int,
        help="the port (default: that of the config's vllm_server_base_url when it names one server, else "
        "vllm_server_port); each server of a pool on one machine its own",
    )
    parser.add_argument(
        "--cores",
        help="CPU cores for its threads, as taskset writes them (0-3,6); default every core it may use: give "
        "each server on a machine its own",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the command and exit")


@command(
    "vllm-serve",
    "start the vLLM server an online run (grpo, distill) with vllm_mode: server generates on",
    _vllm_serve_arguments,
    """Start vLLM's OpenAI-compatible server for the run's model with the settings its colocated engine would
    take (context from data.max_length + max_completion_length, the model's dtype, processed log-probabilities,
    the model's generation defaults off; on a CPU eager mode, a KV cache and its threads on --cores) and the
    weight-update endpoints on. Run it where it can read the files rank 0 writes (the same machine, or a
    shared file system), then train the same config. --dry-run prints the command.""",
)
def cmd_vllm_serve(args: argparse.Namespace) -> int:
    import os
    import shlex

    import torch

    from posttrain.generation.vllm_engine import require_vllm
    from posttrain.generation.vllm_server import parse_cores, serve_port, server_command, server_settings

    config = load(args.config, args.overrides)
    cores = parse_cores(args.cores) if args.cores else None
    settings = server_settings(config, "cuda" if torch.cuda.is_available() else "cpu", cores)
    host = args.host or config.vllm_server_host
    port = args.port or serve_port(config)
    command_line, env = server_command(settings, host, port)
    shown = " ".join(f"{k}={v}" for k, v in env.items())
    said = f"{settings.said}\n{settings.adapter.said}" if settings.adapter.said else settings.said
    print(f"{said}\n{shown} {shlex.join(command_line)}", flush=True)
    if args.dry_run:
        return 0
    require_vllm()
    if cores:  # every thread of the server, not only its OpenMP ones, on the cores it was given
        os.sched_setaffinity(0, cores)
    os.execve(command_line[0], command_line, {**os.environ, **env})
    return 0  # not reached: the server replaces this process
