"""A tiny LLaMA-architecture (or mixture-of-experts) model and byte-level BPE tokenizer, built locally with no network.

Behind `posttrain tiny-model` and `posttrain init`, and used by the tests, the demo and the benchmarks, so nothing is ever
downloaded. Deterministic for a seed: the
training text, the BPE merges and the initial weights all derive from it.
"""

from __future__ import annotations

import random
import string
from pathlib import Path
from typing import Any

BOS, EOS, PAD = "<|begin_of_text|>", "<|im_end|>", "<|pad|>"
IM_START, END_OF_TEXT = "<|im_start|>", "<|end_of_text|>"
SPECIAL_TOKENS = [PAD, BOS, END_OF_TEXT, IM_START, EOS]

# ChatML with `{% generation %}` markers around what the assistant says, end-of-turn token included, so the
# label mask comes from the template itself. HF's Jinja trims the newline right after `{% endgeneration %}`,
# hence the explicit `{{ '\n' }}`.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}"
    "{{ message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS = (
    "the a of and to in is you that it he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up other "
    "about out many then them these so some her would make like him into time has look two more write go see "
    "number no way could people my than first water been call who oil its now find long down day did get come "
    "made may part reverse sort count answer question user assistant system digits letters list please give "
    "add sum plus minus equals true false yes hello thanks sure here result model train data token"
).split()


def _corpus(seed: int, n_lines: int = 4000) -> list[str]:
    """Deterministic training text: English-like words, pseudo-words, numbers and chat markup."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = []
        for _ in range(rng.randint(4, 14)):
            roll = rng.random()
            if roll < 0.55:
                words.append(rng.choice(_WORDS))
            elif roll < 0.8:
                words.append("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 7))))
            elif roll < 0.92:
                words.append(str(rng.randint(0, 99999)))
            else:
                words.append(rng.choice([",", ".", "?", "!", ":", "-", "+", "=", "(", ")"]))
        line = " ".join(words)
        lines.append(line.capitalize() if rng.random() < 0.5 else line)
    return lines


def _train_bpe(vocab_size: int, seed: int):  # -> tokenizers.Tokenizer
    """A byte-level BPE (digits split one per token) trained on ``_corpus(seed)``: the ``tokenizers`` library
    alone, no transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(seed), trainer=trainer)
    return tokenizer


#: what ``tokenizer_config.json`` says of the tiny tokenizer (read by every transformers version)
_TOKENIZER_SETTINGS = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "model_max_length": 1024}


def build_tokenizer(vocab_size: int = 2048, seed: int = 0):  # -> PreTrainedTokenizerFast
    """Train a byte-level BPE tokenizer (digits split one per token) with a ChatML template."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=_train_bpe(vocab_size, seed), **_TOKENIZER_SETTINGS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


#: architectures the tiny builder makes: ``llama`` (dense) and four mixture-of-experts families
ARCHITECTURES = ("llama", "qwen3_moe", "mixtral", "olmoe", "gpt_oss")


def _moe_settings(arch: str, hidden_size: int, heads: int, experts: int, top_k: int) -> dict[str, Any]:
    """The MoE part of a tiny config: ``experts`` experts of width ``hidden_size`` each, ``top_k`` per token."""
    if arch == "mixtral":
        return {"num_local_experts": experts, "num_experts_per_tok": top_k, "intermediate_size": hidden_size}
    if arch == "gpt_oss":
        return {
            "num_local_experts": experts,
            "num_experts_per_tok": top_k,
            "intermediate_size": hidden_size,
            "head_dim": hidden_size // heads,
            "sliding_window": 128,
            "layer_types": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": 150000.0},
        }
    settings = {"num_experts": experts, "num_experts_per_tok": top_k, "intermediate_size": hidden_size * 2}
    if arch == "qwen3_moe":
        settings |= {"moe_intermediate_size": hidden_size, "norm_topk_prob": True, "decoder_sparse_step": 1}
    return settings


def build_model(
    vocab_size: int,
    *,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    seed: int = 0,
    max_position_embeddings: int = 1024,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    arch: str = "llama",
    experts: int = 8,
    top_k: int = 2,
    tied: bool = False,
):  # -> PreTrainedModel
    """A randomly initialised causal LM (float32): LLaMA, or a mixture-of-experts family (``arch``) with
    ``experts`` experts and ``top_k`` of them per token in every layer; ``tied``: the LM head is the input
    embedding (as Qwen2.5 up to 3B, Llama 3.2 1B/3B, Gemma)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if hidden_size % heads:
        raise ValueError(f"hidden_size {hidden_size} must be a multiple of the {heads} attention heads")
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch {arch!r} is not one of {', '.join(ARCHITECTURES)}")
    settings = (
        _dense_settings(hidden_size)
        if arch == "llama"
        else _moe_settings(arch, hidden_size, heads, experts, top_k)
    )
    special = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id}
    shape = _shape(vocab_size, hidden_size, layers, heads, max_position_embeddings, special, tied)
    config = AutoConfig.for_model(arch, **shape, **settings)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def write_tiny_model(
    out_dir: str | Path,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    layers: int = 2,
    vocab_size: int = 2048,
    heads: int = 4,
    arch: str = "llama",
    experts: int = 8,
    top_k: int = 2,
    tied: bool = False,
) -> Path:
    """Write model + tokenizer in Hugging Face format to ``out_dir`` (atomically) and return the path
    (``tied``: the LM head is the input embedding, and the checkpoint holds it once).

    The dense LLaMA is written with ``tokenizers``, NumPy and ``safetensors`` alone (about half a second, no
    torch or transformers import: ``posttrain init`` answers at once); the MoE families are built by
    transformers."""
    from posttrain.utils.fs import atomic_dir

    if arch == "llama":
        if hidden_size % heads:
            raise ValueError(f"hidden_size {hidden_size} must be a multiple of the {heads} attention heads")
        with atomic_dir(out_dir) as tmp:
            _write_llama(tmp, seed, hidden_size, layers, vocab_size, heads, tied)
        return Path(out_dir)
    tokenizer = build_tokenizer(vocab_size=vocab_size, seed=seed)
    model = build_model(
        len(tokenizer),
        hidden_size=hidden_size,
        layers=layers,
        heads=heads,
        seed=seed,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        arch=arch,
        experts=experts,
        top_k=top_k,
        tied=tied,
    )
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return Path(out_dir)


def _shape(
    vocab_size: int,
    hidden_size: int,
    layers: int,
    heads: int,
    positions: int,
    special: dict[str, Any],
    tied: bool = False,
) -> dict[str, Any]:
    """What every tiny model's config sets, whichever way it is built (``build_model``, ``llama_config``)."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "max_position_embeddings": positions,
        "tie_word_embeddings": tied,
        "dtype": "float32",
        **special,
    }


def _dense_settings(hidden_size: int) -> dict[str, Any]:
    return {"intermediate_size": hidden_size * 4}


def llama_config(
    vocab_size: int, hidden_size: int, layers: int, heads: int, special: dict[str, int], tied: bool = False
) -> dict[str, Any]:
    """The tiny LLaMA's ``config.json``: what ``build_model`` sets, and the transformers defaults the NumPy
    weights depend on (activation, norm epsilon, initialisation range)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **_shape(vocab_size, hidden_size, layers, heads, 1024, special, tied),
        **_dense_settings(hidden_size),
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.02,
    }


def _llama_weights(config: dict[str, Any], seed: int) -> dict[str, Any]:
    """LLaMA's initialisation in NumPy: every matrix N(0, initializer_range), the padding row of the
    embedding zero, the norms one."""
    import numpy as np

    rng = np.random.default_rng(seed)
    hidden, ffn, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim

    def matrix(rows: int, cols: int) -> Any:
        return (rng.standard_normal((rows, cols)) * config["initializer_range"]).astype(np.float32)

    weights = {"model.embed_tokens.weight": matrix(vocab, hidden)}
    weights["model.embed_tokens.weight"][config["pad_token_id"]] = 0.0
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        shapes = {
            "self_attn.q_proj": (hidden, hidden),
            "self_attn.k_proj": (kv, hidden),
            "self_attn.v_proj": (kv, hidden),
            "self_attn.o_proj": (hidden, hidden),
            "mlp.gate_proj": (ffn, hidden),
            "mlp.up_proj": (ffn, hidden),
            "mlp.down_proj": (hidden, ffn),
        }
        weights |= {f"{prefix}{name}.weight": matrix(*shape) for name, shape in shapes.items()}
        for norm in ("input_layernorm", "post_attention_layernorm"):
            weights[f"{prefix}{norm}.weight"] = np.ones(hidden, dtype=np.float32)
    weights["model.norm.weight"] = np.ones(hidden, dtype=np.float32)
    if not config["tie_word_embeddings"]:  # a tied head is the embedding, saved once (as transformers does)
        weights["lm_head.weight"] = matrix(vocab, hidden)
    return weights


def _write_llama(
    out: Path, seed: int, hidden_size: int, layers: int, vocab_size: int, heads: int, tied: bool = False
) -> None:
    import json

    from safetensors.numpy import save_file

    tokenizer = _train_bpe(vocab_size, seed)
    special = {
        f"{role}_token_id": tokenizer.token_to_id(token)
        for role, token in (("bos", BOS), ("eos", EOS), ("pad", PAD))
    }
    config = llama_config(tokenizer.get_vocab_size(), hidden_size, layers, heads, special, tied)
    tokenizer.save(str(out / "tokenizer.json"))
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", **_TOKENIZER_SETTINGS}
    files = {
        "tokenizer_config.json": settings | {"chat_template": CHAT_TEMPLATE},
        "config.json": config,
        "generation_config.json": special,
    }
    for name, content in files.items():
        (out / name).write_text(json.dumps(content, indent=2) + "\n")
    save_file(_llama_weights(config, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
