"""After training: ``chat`` with an export, ``merge`` an adapter into its base."""

from __future__ import annotations

import argparse
from pathlib import Path

from posttrain.commands import command

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
