"""After training: ``chat`` with an export, ``merge`` an adapter into its base; beside a run: ``vllm-serve``,
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
    return chat(args.export, sampling=sampling, **options)


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


# ------------------------------------------------------------------------------------ beside a run


def _vllm_serve_arguments(parser: argparse.ArgumentParser) -> None:
    config_arguments(parser)
    parser.add_argument("--host", help="the address to listen on (default: the config's vllm_server_host)")
    parser.add_argument("--port", type=int, help="the port (default: the config's vllm_server_port)")
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

    from posttrain.rollout.vllm_engine import require_vllm
    from posttrain.rollout.vllm_server import parse_cores, server_command, server_settings

    config = load(args.config, args.overrides)
    cores = parse_cores(args.cores) if args.cores else None
    settings = server_settings(config, "cuda" if torch.cuda.is_available() else "cpu", cores)
    host = args.host or config.vllm_server_host
    port = args.port or config.vllm_server_port
    command_line, env = server_command(settings, host, port)
    shown = " ".join(f"{k}={v}" for k, v in env.items())
    print(f"{settings.said}\n{shown} {shlex.join(command_line)}", flush=True)
    if args.dry_run:
        return 0
    require_vllm()
    if cores:  # every thread of the server, not only its OpenMP ones, on the cores it was given
        os.sched_setaffinity(0, cores)
    os.execve(command_line[0], command_line, {**os.environ, **env})
    return 0  # not reached: the server replaces this process
