"""Tiny vision-language models with their processors, built locally (no network): the tiny text tokenizer
plus the image tokens of each family, a Pillow-only image processor at 32x32 pixels, and a randomly
initialised model that ``AutoModelForImageTextToText`` and ``AutoProcessor`` load.

Deterministic for a seed, like the text ones (``posttrain tiny-model --arch idefics3``). The Qwen-VL family
(Qwen2-VL, Qwen2.5-VL, Qwen3-VL) is built where torchvision imports: transformers 5.24's processors of that
family require a video processor, which transformers builds only with torchvision (the vision tier's venv has
it: ``make test-vision``; docs/methods.md). Gemma 3's processor has no video part and is built with its
Pillow image processor.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.errors import UserError

#: the vision-language families the tiny builder makes
VISION_ARCHITECTURES = ("idefics3", "llava", "gemma3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl")
#: the families whose processors transformers builds only with torchvision
NEEDS_TORCHVISION = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
#: the side of the square images the tiny processors resize to, in pixels
IMAGE_SIDE = 32

# ChatML with `{% generation %}` markers, over content lists (TRL's layout: text parts and image parts), an
# image part written as the family's image token; string content is accepted too.
_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{% set parts = [{'type': 'text', 'text': message['content']}] %}"
    "{% else %}{% set parts = message['content'] %}{% endif %}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{% for part in parts %}{{ part['text'] }}{% endfor %}{{ '<|im_end|>' }}{% endgeneration %}"
    "{{ '\n' }}"
    "{% else %}"
    "{% for part in parts %}{% if part['type'] == 'image' %}{{ '@IMAGE@' }}{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{{ '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_IDEFICS3_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + [
    f"<row_{row}_col_{col}>" for row in range(1, 7) for col in range(1, 7)
]


def chat_template(image_token: str) -> str:
    """The tiny VLMs' chat template, an image part rendered as ``image_token``."""
    return _TEMPLATE.replace("@IMAGE@", image_token)


def _text_config(vocab: int, hidden_size: int, layers: int, heads: int, tokenizer: Any) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden_size,
        "intermediate_size": hidden_size * 4,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "tie_word_embeddings": False,
        "dtype": "float32",
    }


@dataclass(frozen=True)
class Tower:
    """The tiny image encoder: ``layers`` layers of width ``hidden`` over 32x32 images cut in ``patch``-pixel
    squares (None: the family's default, which gives 4 image tokens an image)."""

    hidden: int = 32
    layers: int = 2
    patch: int | None = None

    def config(self, patch: int, **more: Any) -> dict[str, Any]:
        shape = {
            "hidden_size": self.hidden,
            "intermediate_size": 2 * self.hidden,
            "num_hidden_layers": self.layers,
            "num_attention_heads": 2,
        }
        return {**shape, "image_size": IMAGE_SIDE, "patch_size": patch, **more}


def _idefics3(tokenizer: Any, text: dict[str, Any], tower: Tower) -> tuple[Any, Any]:
    from transformers import AutoConfig, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer.add_special_tokens({"additional_special_tokens": _IDEFICS3_TOKENS})
    side = {"longest_edge": IMAGE_SIDE}
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size=side, max_image_size=side)
    patch, scale = tower.patch or 8, 2  # (32 / 8)^2 = 16 patches, merged 2x2 by the connector: 4 image tokens
    processor = Idefics3Processor(
        image_processor=images,
        tokenizer=tokenizer,
        chat_template=chat_template("<image>"),
        image_seq_len=(IMAGE_SIDE // patch) ** 2 // scale**2,
    )
    config = AutoConfig.for_model(
        "idefics3",
        text_config=text | {"vocab_size": len(tokenizer)},
        vision_config=tower.config(patch),
        scale_factor=scale,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=text["tie_word_embeddings"],
        pad_token_id=tokenizer.pad_token_id,
    )
    return config, processor


def _llava(tokenizer: Any, text: dict[str, Any], tower: Tower) -> tuple[Any, Any]:
    from transformers import AutoConfig, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    patch = tower.patch or 16  # (32 / 16)^2 = 4 image tokens
    images = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIDE}, crop_size={"height": IMAGE_SIDE, "width": IMAGE_SIDE}
    )
    processor = LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=patch,
        vision_feature_select_strategy="default",
        chat_template=chat_template("<image>"),
        num_additional_image_tokens=1,  # CLIP's class token, dropped by the "default" strategy
    )
    config = AutoConfig.for_model(
        "llava",
        text_config=text | {"vocab_size": len(tokenizer)},
        vision_config=tower.config(patch, model_type="clip_vision_model", projection_dim=32),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        projector_hidden_act="gelu",
        tie_word_embeddings=text["tie_word_embeddings"],
        pad_token_id=tokenizer.pad_token_id,
    )
    return config, processor


def _gemma3(tokenizer: Any, text: dict[str, Any], tower: Tower) -> tuple[Any, Any]:
    from transformers import AutoConfig, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    names = {
        "boi_token": "<start_of_image>",
        "image_token": "<image_soft_token>",
        "eoi_token": "<end_of_image>",
    }
    tokenizer.add_special_tokens({"additional_special_tokens": list(names.values())})
    tokenizer._set_model_specific_special_tokens(special_tokens=names)  # the attributes Gemma3Processor reads
    # runs of one to four newlines are single tokens, as in Gemma's own vocabulary (the processor writes
    # "\n\n" around each image; vLLM's Gemma 3 code looks these four up by name)
    tokenizer.add_tokens(["\n" * n for n in range(1, 5)])
    patch = tower.patch or 8  # a 4x4 grid of patches, average-pooled to 2x2: 4 image tokens
    tokens = 4
    images = Gemma3ImageProcessorPil(size={"height": IMAGE_SIDE, "width": IMAGE_SIDE})
    processor = Gemma3Processor(
        image_processor=images,
        tokenizer=tokenizer,
        chat_template=chat_template(names["boi_token"]),
        image_seq_length=tokens,
    )
    # Gemma 3's text layers alternate sliding-window and full attention; the window is smaller than the
    # tests' rows so that both kinds are exercised. Every Gemma 3 checkpoint ties its LM head to its input
    # embedding (``tied``; vLLM's Gemma 3 ties them whatever the config says); the demo's learns faster untied.
    gemma_text = {k: v for k, v in text.items() if k != "model_type"}
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    layer_types = [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(text["num_hidden_layers"])
    ]
    gemma_text |= {
        "head_dim": head_dim,
        "query_pre_attn_scalar": head_dim,
        "sliding_window": 16,
        "layer_types": layer_types,
        "vocab_size": len(tokenizer),
    }
    config = AutoConfig.for_model(
        "gemma3",
        text_config=gemma_text,
        vision_config=tower.config(patch, model_type="siglip_vision_model"),
        mm_tokens_per_image=tokens,
        boi_token_index=tokenizer.convert_tokens_to_ids(names["boi_token"]),
        eoi_token_index=tokenizer.convert_tokens_to_ids(names["eoi_token"]),
        image_token_index=tokenizer.convert_tokens_to_ids(names["image_token"]),
        tie_word_embeddings=text["tie_word_embeddings"],
        pad_token_id=tokenizer.pad_token_id,
    )
    return config, processor


_QWEN_TOKENS = {
    "vision_start": "<|vision_start|>",
    "vision_end": "<|vision_end|>",
    "image": "<|image_pad|>",
    "video": "<|video_pad|>",
}


def torchvision_missing() -> str | None:
    """Why torchvision cannot be used here (None: it can): the Qwen-VL processors need it."""
    try:
        import torchvision  # noqa: F401
    except Exception as error:  # an ImportError, or a RuntimeError from a build made for another torch
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return None


def _qwen_vl(arch: str, tokenizer: Any, text: dict[str, Any], tower: Tower) -> tuple[Any, Any]:
    """Qwen2-VL, Qwen2.5-VL or Qwen3-VL: M-RoPE over (time, height, width) in the language model, a tower over
    8-pixel patches merged 2x2 (a 32x32 image: 4 image tokens) and the family's own processor, its video
    processor included."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    reason = torchvision_missing()
    if reason is not None:
        raise UserError(
            f"--arch {arch}: transformers builds this family's processor only with torchvision, which does not "
            f"import here ({reason}); install a torchvision built for this torch (make vision-env)"
        )
    processor_class, video_class = {
        "qwen2_vl": ("Qwen2VLProcessor", "Qwen2VLVideoProcessor"),
        "qwen2_5_vl": ("Qwen2_5_VLProcessor", "Qwen2VLVideoProcessor"),
        "qwen3_vl": ("Qwen3VLProcessor", "Qwen3VLVideoProcessor"),
    }[arch]
    tokenizer.add_special_tokens({"additional_special_tokens": list(_QWEN_TOKENS.values())})
    patch, merge = tower.patch or 8, 2
    sizes = {"patch_size": patch, "temporal_patch_size": 2, "merge_size": merge}
    pixels = {"shortest_edge": (patch * merge) ** 2, "longest_edge": IMAGE_SIDE * IMAGE_SIDE}
    processor = getattr(transformers, processor_class)(
        image_processor=Qwen2VLImageProcessorPil(size=pixels, **sizes),
        video_processor=getattr(transformers, video_class)(size=pixels, **sizes),
        tokenizer=tokenizer,
        chat_template=chat_template(
            _QWEN_TOKENS["vision_start"] + _QWEN_TOKENS["image"] + _QWEN_TOKENS["vision_end"]
        ),
    )
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    half = head_dim // 2  # M-RoPE splits the rotary frequencies between time, height and width
    sections = [half // 4, (half - half // 4) // 2, half - half // 4 - (half - half // 4) // 2]
    qwen_text = {k: v for k, v in text.items() if k != "model_type"}
    qwen_text |= {
        "head_dim": head_dim,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": sections},
    }
    shape = {"depth": tower.layers, "num_heads": 2, "spatial_merge_size": merge, **sizes}
    shape.pop("merge_size")
    if arch == "qwen2_vl":
        vision = shape | {"embed_dim": tower.hidden, "hidden_size": text["hidden_size"], "mlp_ratio": 2}
    else:
        vision = shape | {
            "hidden_size": tower.hidden,
            "intermediate_size": 2 * tower.hidden,
            "out_hidden_size": text["hidden_size"],
        }
    if arch == "qwen2_5_vl":  # windowed attention in the tower, its last layer full
        vision |= {"window_size": IMAGE_SIDE // 2, "fullatt_block_indexes": [tower.layers - 1]}
    if arch == "qwen3_vl":  # interleaved M-RoPE, learned position embeddings, deepstack features
        qwen_text["rope_parameters"] |= {"mrope_interleaved": True}
        vision |= {"num_position_embeddings": (IMAGE_SIDE // patch) ** 2, "deepstack_visual_indexes": [0]}
    ids = {f"{name}_token_id": tokenizer.convert_tokens_to_ids(token) for name, token in _QWEN_TOKENS.items()}
    config = AutoConfig.for_model(
        arch,
        text_config=qwen_text | {"vocab_size": len(tokenizer)},
        vision_config=vision,
        tie_word_embeddings=text["tie_word_embeddings"],
        pad_token_id=tokenizer.pad_token_id,
        **ids,
    )
    return config, processor


_BUILDERS = {
    "idefics3": _idefics3,
    "llava": _llava,
    "gemma3": _gemma3,
    **{arch: functools.partial(_qwen_vl, arch) for arch in NEEDS_TORCHVISION},
}


def build_tiny_vlm(
    arch: str,
    *,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    vocab_size: int = 2048,
    seed: int = 0,
    tower: Tower = Tower(),
    tied: bool = False,
) -> tuple[Any, Any]:
    """(model, processor) of a tiny ``arch`` VLM: float32, random weights drawn from ``seed``; ``tower``: the
    image encoder's size (a wider one for the memory plan's benchmark); ``tied``: the LM head is the input
    embedding (as in Gemma 3's checkpoints)."""
    import torch
    from transformers import AutoModelForImageTextToText

    from posttrain.tiny_model import build_tokenizer

    if arch not in _BUILDERS:
        raise ValueError(f"arch {arch!r} is not one of {', '.join(VISION_ARCHITECTURES)}")
    if hidden_size % heads:
        raise ValueError(f"hidden_size {hidden_size} must be a multiple of the {heads} attention heads")
    tokenizer = build_tokenizer(vocab_size=vocab_size, seed=seed)
    text = _text_config(len(tokenizer), hidden_size, layers, heads, tokenizer) | {"tie_word_embeddings": tied}
    config, processor = _BUILDERS[arch](tokenizer, text, tower)
    tokenizer.chat_template = processor.chat_template  # one template, whichever object renders it
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    generation = model.generation_config
    generation.bos_token_id, generation.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    generation.pad_token_id = tokenizer.pad_token_id
    return model, processor


def write_tiny_vlm(out_dir: str | Path, arch: str, **sizes: Any) -> Path:
    """Write a tiny ``arch`` VLM and its processor (tokenizer included) to ``out_dir``, atomically."""
    from posttrain.utils.fs import atomic_dir

    model, processor = build_tiny_vlm(arch, **sizes)
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
    return Path(out_dir)
