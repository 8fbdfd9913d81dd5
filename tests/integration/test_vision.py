"""Vision-language SFT on tiny Idefics3 (SmolVLM's architecture) and LLaVA models built here with their
processors: rows in every layout users have, the processor's own tokens, labels on the assistant's text
only, bad image rows reported at once, the frozen parts left as they were, packed and padding-free rows
giving the padded loss, and an export transformers loads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch

from posttrain.data.samples import IGNORE_INDEX
from posttrain.errors import DataError
from posttrain.testing.data import write_jsonl
from posttrain.testing.vision import QUESTION, colour_rows, draw_square
from posttrain.vision import images
from posttrain.vision.formatting import ORIGIN, format_image_rows
from posttrain.vision.freeze import part_of
from posttrain.vision.processor import attach, feature_token_id, input_only_tokens
from posttrain.vision.tiny import NEEDS_TORCHVISION, VISION_ARCHITECTURES, torchvision_missing
from tests.conftest import make_base_config
from tests.integration.helpers import merge, metrics, train

pytestmark = pytest.mark.integration

#: the families every venv builds, and the Qwen-VL family, whose processors need torchvision (make test-vision)
QWEN = tuple(pytest.param(arch, marks=pytest.mark.torchvision) for arch in NEEDS_TORCHVISION)
ARCHS = (*(arch for arch in VISION_ARCHITECTURES if arch not in NEEDS_TORCHVISION), *QWEN)


@pytest.fixture(scope="module")
def vlms(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny VLMs this venv can build, each written once for the module."""
    from posttrain.vision.tiny import write_tiny_vlm

    root = tmp_path_factory.mktemp("vlm")
    buildable = [
        a for a in VISION_ARCHITECTURES if a not in NEEDS_TORCHVISION or torchvision_missing() is None
    ]
    return {arch: write_tiny_vlm(root / arch, arch, vocab_size=1024) for arch in buildable}


@pytest.fixture(scope="module")
def colour_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("colours")
    write_jsonl(directory / "train.jsonl", colour_rows(directory, 16, seed=1))
    return directory / "train.jsonl"


def processor_and_tokenizer(path: Path) -> tuple[Any, Any]:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    return processor, attach(processor.tokenizer, processor)


def vlm_config(weights: Path, source: Path, tmp_path: Path, **changes: Any) -> dict[str, Any]:
    """The suite's small SFT config (``make_base_config``) on a VLM and image rows, rows up to 96 tokens."""
    return merge(merge(make_base_config(weights, source, tmp_path), data={"max_length": 96}), **changes)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_layout_gives_the_processors_tokens_and_labels_only_the_answer(
    vlms: dict[str, Path], tmp_path: Path, arch: str
) -> None:
    processor, tokenizer = processor_and_tokenizer(vlms[arch])
    draw_square(tmp_path / "images" / "a.png", "red", seed=3)
    origin = {ORIGIN: f"{tmp_path / 'train.jsonl'} row 1"}
    png = (tmp_path / "images" / "a.png").read_bytes()
    inline = {"type": "image", "image": "images/a.png"}
    layouts = [
        {
            "messages": [_user([{"type": "image"}, _text(QUESTION)]), _answer("red")],
            "images": ["images/a.png"],
        },
        {"messages": [_user(f"<image>{QUESTION}"), _answer("red")], "images": ["images/a.png"]},
        {
            "messages": [
                _user([{"type": "image_url", "image_url": {"url": "images/a.png"}}, _text(QUESTION)]),
                _answer("red"),
            ]
        },
        {"messages": [_user([inline, _text(QUESTION)]), _answer("red")]},
        {
            "messages": [_user([{"type": "image"}, _text(QUESTION)]), _answer("red")],
            "images": [{"bytes": png}],
        },
        {
            "messages": [_user([{"type": "image"}, _text(QUESTION)]), _answer("red")],
            "images": [f"file://{tmp_path}/images/a.png"],
        },
    ]
    samples = format_image_rows([{**row, **origin} for row in layouts], tokenizer, _Config())
    assert not [s for s in samples if isinstance(s, Exception)], samples
    first = samples[0]
    for sample in samples[1:]:
        assert np.array_equal(sample["input_ids"], first["input_ids"])
        assert np.array_equal(sample["labels"], first["labels"])

    # the processor's own call on the rendered row (as TRL makes it) gives the same ids
    from PIL import Image

    messages = [_user([{"type": "image"}, _text(QUESTION)]), _answer("red")]
    text = processor.apply_chat_template(messages, tokenize=False)
    own = processor(
        text=[text],
        images=[[Image.open(tmp_path / "images" / "a.png").convert("RGB")]],
        add_special_tokens=False,
    )
    assert first["input_ids"].tolist() == own["input_ids"][0]
    labelled = first["labels"][first["labels"] != IGNORE_INDEX]
    assert tokenizer.decode(labelled) == "red<|im_end|>"
    assert (first["input_ids"] == feature_token_id(processor)).sum() == 4  # the tiny processors' 4 per image
    assert not np.any(np.isin(first["labels"], input_only_tokens(tokenizer)))
    assert images.decode(first[images.IMAGES_COLUMN]) != []


def test_several_images_in_a_row_expand_in_order_and_stay_unlabelled(
    vlms: dict[str, Path], tmp_path: Path
) -> None:
    processor, tokenizer = processor_and_tokenizer(vlms["idefics3"])
    for name, colour in (("a", "red"), ("b", "blue")):
        draw_square(tmp_path / f"{name}.png", colour)
    row = {
        "messages": [
            _user("<image> then <image>: which colours?"),
            _answer("red, blue"),
            _user("and the first <image>?"),
            _answer("red"),
        ],
        "images": ["a.png", "b.png", "a.png"],
        ORIGIN: f"{tmp_path / 'rows.jsonl'} row 1",
    }
    [sample] = format_image_rows([row], tokenizer, _Config())
    assert not isinstance(sample, Exception), sample
    refs = images.decode(sample[images.IMAGES_COLUMN])
    assert [Path(ref["path"]).name for ref in refs] == ["a.png", "b.png", "a.png"]
    ids, labels = sample["input_ids"], sample["labels"]
    assert (ids == processor.image_token_id).sum() == 3 * 4
    assert tokenizer.decode(labels[labels != IGNORE_INDEX]) == "red, blue<|im_end|>red<|im_end|>"


def test_bad_image_rows_are_reported_together_with_their_rows(vlms: dict[str, Path], tmp_path: Path) -> None:
    draw_square(tmp_path / "good.png", "green")
    (tmp_path / "broken.png").write_text("not an image")
    rows = [
        {"messages": [_user("<image>colour?"), _answer("green")], "images": ["good.png"]},
        {"messages": [_user("<image>colour?"), _answer("green")], "images": ["missing.png"]},
        {"messages": [_user("<image>colour?"), _answer("green")], "images": ["broken.png"]},
        {"messages": [_user("<image><image>colour?"), _answer("green")], "images": ["good.png"]},
        {"messages": [_user("colour?"), _answer("green")], "images": ["good.png"]},
        {"messages": [_user("<image>colour?"), _answer("green")], "images": ["https://example.com/a.png"]},
        {
            "messages": [_user("<image>colour?"), _answer([{"type": "image"}])],
            "images": ["good.png", "good.png"],
        },
    ]
    data = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError) as raised:
        train(vlm_config(vlms["idefics3"], data, tmp_path))
    message = str(raised.value)
    expected = {
        2: "missing.png does not exist",
        3: "broken.png cannot be read as an image",
        4: "2 image placeholders",
        5: "0 image placeholders",
        6: "is a URL",
        7: "holds an image",
    }
    for row, words in expected.items():
        line = next((x for x in message.splitlines() if f"bad.jsonl row {row}:" in x), "")
        assert words in line, (row, message)
    assert "bad.jsonl row 1:" not in message


@pytest.mark.parametrize("arch", ["idefics3", *QWEN])
def test_sft_trains_the_language_model_and_leaves_the_frozen_parts(
    vlms: dict[str, Path], colour_data: Path, tmp_path: Path, arch: str
) -> None:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    before = AutoModelForImageTextToText.from_pretrained(vlms[arch]).state_dict()
    export = tmp_path / "export"
    config = vlm_config(
        vlms[arch],
        colour_data,
        tmp_path,
        train_iters=4,
        checkpoint=[{"type": "huggingface", "output_dir": str(export), "save_end_of_training": True}],
    )
    result = train(config)
    lines = metrics(config)
    assert len(lines) == 4 and all(np.isfinite(line["loss"]) for line in lines)
    after = {name: p.detach() for name, p in result.model.named_parameters()}
    changed = {part_of(name) for name, value in after.items() if not torch.equal(value, before[name])}
    assert changed == {"language"}, changed  # tower and projector frozen (the defaults)

    loaded = AutoModelForImageTextToText.from_pretrained(export / "final")
    processor = AutoProcessor.from_pretrained(export / "final")
    assert type(processor) is type(AutoProcessor.from_pretrained(vlms[arch]))
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, after[name]) if name in after else True

    # the export answers with an image from `posttrain chat`
    from io import StringIO

    from posttrain.inference.chat import Sampling, chat

    out = StringIO()
    image = next(colour_data.parent.glob("images/*.png"))
    assert chat(export / "final", prompt=QUESTION, images=(image,), sampling=Sampling(3, 0.0), out=out) == 0
    assert out.getvalue().strip()

    # the projector and tower train when asked (LLaMA-Factory's keys)
    config = merge(
        config, model={"freeze_vision_tower": False, "freeze_multi_modal_projector": False}, checkpoint=[]
    )
    config["logger"]["output_dir"] = str(tmp_path / "run2")
    result = train(config)
    changed = {
        part_of(n) for n, p in result.model.named_parameters() if not torch.equal(p.detach(), before[n])
    }
    assert changed == {"language", "tower", "projector"}, changed


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_and_padding_free_rows_give_the_padded_loss(
    vlms: dict[str, Path], colour_data: Path, tmp_path: Path, arch: str
) -> None:
    """All 16 rows in one optimizer step: the padded batch, one packed sequence, one padding-free row."""
    losses = {}
    setups = {
        "padded": {"micro_batch_size": 16},
        "packed": {"micro_batch_size": 1, "data": {"pack_samples": True, "max_length": 1024}},
        "padding_free": {"micro_batch_size": 16, "data": {"padding_free": True}},
    }
    for name, changes in setups.items():
        config = vlm_config(vlms[arch], colour_data, tmp_path / name, train_iters=1, **changes)
        train(config)
        losses[name] = metrics(config)[0]["loss"]
    assert losses["packed"] == pytest.approx(losses["padded"], abs=1e-6, rel=0)
    assert losses["padding_free"] == pytest.approx(losses["padded"], abs=1e-6, rel=0)


def test_image_rows_in_parquet_as_datasets_writes_them(vlms: dict[str, Path], tmp_path: Path) -> None:
    """``datasets.Image`` columns in Parquet hold ``{bytes, path}``: the rows train as the path rows do."""
    rows = colour_rows(tmp_path, 8, seed=2, layout="bytes")
    frame = pd.DataFrame(
        {"messages": [json.dumps(r["messages"]) for r in rows], "images": [r["images"] for r in rows]}
    )
    frame["messages"] = frame["messages"].map(json.loads)
    frame.to_parquet(tmp_path / "train.parquet")
    config = vlm_config(vlms["llava"], tmp_path / "train.parquet", tmp_path, train_iters=2)
    train(config)
    assert len(metrics(config)) == 2


def test_part_names_of_the_families() -> None:
    assert part_of("model.vision_model.encoder.layers.0.mlp.fc1.weight") == "tower"
    assert part_of("model.connector.modality_projection.proj.weight") == "projector"
    assert part_of("model.visual.merger.mlp.0.weight") == "projector"
    assert part_of("model.visual.blocks.0.attn.qkv.weight") == "tower"
    # Qwen3-VL's deepstack mergers go with the tower, as LLaMA-Factory's freeze_vision_tower takes them
    assert part_of("model.visual.deepstack_merger_list.0.linear_fc1.weight") == "tower"
    assert part_of("model.visual.pos_embed.weight") == "tower"
    assert part_of("model.language_model.layers.0.self_attn.q_proj.weight") == "language"
    assert part_of("model.vision_tower.encoder.layers.0.self_attn.q_proj.weight") == "tower"  # Gemma 3
    assert part_of("model.multi_modal_projector.mm_input_projection_weight") == "projector"
    assert part_of("lm_head.weight") == "language"


class _Config:
    mask_inputs = True
    check_end_of_turn = True


def _user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


def _answer(content: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": content}


def _text(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}


@pytest.mark.parametrize("arch", ["llava", *QWEN[1:2]])
def test_lora_adapts_the_language_model_and_merges_into_a_vlm_export(
    vlms: dict[str, Path], colour_data: Path, tmp_path: Path, arch: str
) -> None:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    family = type(AutoModelForImageTextToText.from_pretrained(vlms[arch])).__name__
    export = tmp_path / "export"
    config = vlm_config(
        vlms[arch],
        colour_data,
        tmp_path,
        train_iters=2,
        model={"peft_config": {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}},
        checkpoint=[
            {
                "type": "huggingface",
                "output_dir": str(export),
                "save_end_of_training": True,
                "save_merged": True,
            }
        ],
    )
    result = train(config)
    adapted = {name.split(".lora_A")[0] for name, _ in result.model.named_parameters() if ".lora_A" in name}
    assert adapted and {part_of(name) for name in adapted} == {"language"}
    merged = AutoModelForImageTextToText.from_pretrained(export / "final-merged")
    assert type(merged).__name__ == family
    from posttrain.inference.merge import merge_adapter

    merge_adapter(export / "final", tmp_path / "merged")
    assert type(AutoModelForImageTextToText.from_pretrained(tmp_path / "merged")).__name__ == family
    assert type(AutoProcessor.from_pretrained(tmp_path / "merged")) is type(
        AutoProcessor.from_pretrained(vlms[arch])
    )


def test_the_memory_plan_counts_what_trains_and_the_report_counts_images(
    vlms: dict[str, Path], colour_data: Path, tmp_path: Path
) -> None:
    from posttrain.config.model import ModelConfig
    from posttrain.memory.shape import model_shape

    frozen = model_shape(ModelConfig(name_or_path=str(vlms["idefics3"])))
    trained = model_shape(
        ModelConfig(
            name_or_path=str(vlms["idefics3"]), freeze_vision_tower=False, freeze_multi_modal_projector=False
        )
    )
    assert frozen.params == trained.params == trained.trainable > frozen.trainable
    # the tiny Idefics3's encoder: 2 layers of width 32 (MLP 64), 2x2 patches merged into an image token
    assert frozen.vision is not None and trained.vision is not None
    assert (frozen.vision.layers, frozen.vision.hidden, frozen.vision.intermediate) == (2, 32, 64)
    assert frozen.vision.patches_per_token == 4.0
    assert (
        not frozen.vision.tower_trained and trained.vision.tower_trained and trained.vision.projector_trained
    )

    from posttrain.config import load_config
    from posttrain.memory.machine import Machine
    from posttrain.preflight import memory_report, preflight, report_text

    config = load_config(data=vlm_config(vlms["idefics3"], colour_data, tmp_path))
    flight = preflight(config, 1)
    text = report_text(flight, config)
    assert "16 images (64 image tokens)" in text, text
    machine = Machine("cpu", None, 64 * 2**30, 1)
    # one image (4 image tokens, 16 encoder positions) a row; the frozen tower keeps nothing for backward
    rows = flight.sizes.micro_batch_size
    _, plan = memory_report(flight, machine)
    assert plan is not None
    items = {item["part"]: item for item in plan["items"]}
    assert items["image encoder (frozen)"]["phase"] == "forward"
    assert items["image encoder (frozen)"]["bytes"] == rows * 16 * (4 * 32 + 64) * 4
    assert "image encoder activations" not in items
    config = load_config(
        data=vlm_config(vlms["idefics3"], colour_data, tmp_path, model={"freeze_vision_tower": False})
    )
    _, plan = memory_report(preflight(config, 1), machine)
    assert plan is not None
    items = {item["part"]: item for item in plan["items"]}
    per_layer = rows * 16 * (8 * 32 + 2 * 64) * 4
    assert items["image encoder activations"]["bytes"] == 2 * per_layer  # not checkpointed: both layers


@pytest.mark.parametrize("arch", QWEN)
def test_the_memory_plan_reads_the_qwen_vl_towers(vlms: dict[str, Path], arch: str) -> None:
    """Qwen2-VL's tower is ``embed_dim`` wide with an MLP ``mlp_ratio`` times that; its successors name them
    as the others do; 2x2 patches merged into each image token."""
    from posttrain.config.model import ModelConfig
    from posttrain.memory.shape import model_shape

    shape = model_shape(ModelConfig(name_or_path=str(vlms[arch])))
    assert shape.vision is not None
    assert (shape.vision.layers, shape.vision.hidden, shape.vision.intermediate) == (2, 32, 64)
    assert shape.vision.patches_per_token == 4.0 and not shape.vision.tower_trained


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["idefics3", "gemma3", *QWEN[1:2]])
def test_two_processes_under_zero3_give_one_processs_numbers_and_a_killed_run_resumes_exactly(
    vlms: dict[str, Path], colour_data: Path, tmp_path: Path, arch: str
) -> None:
    """ZeRO-3 over 2 processes (the frozen tower partitioned with the rest) trains as one process does, and
    a run SIGKILLed after its checkpoint at step 2 and resumed with ``auto_resume`` ends where the
    uninterrupted one does. Gemma 3's and Qwen2.5-VL's rows are packed (two rows a sequence): per-document
    attention with Gemma 3's image blocks, and Qwen's M-RoPE positions per document, on every process."""
    from tests.resume_helpers import assert_same_continuation, kill_and_resume

    rows = {"micro_batch_size": 2}
    if arch != "idefics3":
        rows = {"micro_batch_size": 1, "data": {"pack_samples": True, "max_length": 96}}
    base = vlm_config(
        vlms[arch], colour_data, tmp_path, deepspeed={"zero_optimization": {"stage": 3}}, **rows
    )
    (tmp_path / "two").mkdir()
    results = kill_and_resume(base, tmp_path / "two", nproc=2, kill_at=2, total=4)
    assert_same_continuation(results, kill_at=2, total=4)

    from safetensors.torch import load_file

    from tests.resume_helpers import cli

    exports = {}
    for name, nproc, stage in (("one", 1, 0), ("pair", 2, 3)):
        # eps=1: Adam's step ~ lr * g, so float noise in gradients near eps is not blown up to ~lr (seen: 2e-5
        # in Gemma 3 at eps=1e-8), and weight decay's term (lr * 0.1 * w) stands out of it
        config = merge(
            base, train_iters=1, optimizer={"eps": 1.0}, deepspeed={"zero_optimization": {"stage": stage}}
        )
        config["gradient_accumulation_steps"] = (3 - nproc) * (
            2 // config["micro_batch_size"]
        )  # 4 micro-batches a step
        config["logger"]["output_dir"] = str(tmp_path / name)
        config["checkpoint"] = [
            {"type": "huggingface", "output_dir": str(tmp_path / name / "x"), "save_end_of_training": True}
        ]
        done = cli(config, tmp_path / f"{name}.yaml", nproc)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        exports[name] = load_file(tmp_path / name / "x" / "final" / "model.safetensors")
    assert exports["one"].keys() == exports["pair"].keys(), set(exports["one"]) ^ set(exports["pair"])
    diff = max(float((exports["one"][k] - exports["pair"][k]).abs().max()) for k in exports["one"])
    assert diff < 1e-6, diff


def test_an_export_writes_the_checkpoints_names_whatever_renamings_the_loader_recorded(
    vlms: dict[str, Path], tmp_path: Path
) -> None:
    """transformers' ZeRO-3 loader records renamings it never used (one is added here by hand) and
    ``save_pretrained`` reverses every recorded one: Gemma 3's export got ``language_model.model.model.*``.
    The export keeps the used ones only and writes the checkpoint's own names."""
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText
    from transformers.core_model_loading import WeightRenaming

    from posttrain.checkpoint.huggingface import keep_used_conversions

    def names(directory: Path) -> set[str]:
        with safe_open(directory / "model.safetensors", "pt") as handle:
            return set(handle.keys())

    model = AutoModelForImageTextToText.from_pretrained(vlms["gemma3"])
    unused = WeightRenaming(
        source_patterns=[r"^model\.language_model\.model", r"^language_model\.model\.model"],
        target_patterns=["model.language_model"],
    )
    model._weight_conversions = [*model._weight_conversions, unused]
    model.save_pretrained(tmp_path / "as-recorded")
    assert names(tmp_path / "as-recorded") != names(vlms["gemma3"])  # the defect, as transformers saves
    keep_used_conversions(model)
    model.save_pretrained(tmp_path / "kept")
    assert names(tmp_path / "kept") == names(vlms["gemma3"])


def test_tokens_joined_across_an_image_edge_keep_their_labels_only_where_the_text_is_the_same(
    vlms: dict[str, Path],
) -> None:
    """Gemma 3's vocabulary has runs of newlines as single tokens: the processor's own ids join the "\n\n"
    it writes around an image with a "\n" beside it. The sample takes the processor's ids; a differing
    stretch must spell the same text and carry no label, or the row is refused."""
    from posttrain.vision.formatting import reconcile

    _, tokenizer = processor_and_tokenizer(vlms["gemma3"])
    one, two, three = (tokenizer.convert_tokens_to_ids("\n" * n) for n in (1, 2, 3))
    expanded, joined = np.array([5, one, two, 7, 8]), np.array([5, three, 7, 8])
    labels = np.array([IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, 8])
    assert reconcile(tokenizer, expanded, joined, labels).tolist() == [IGNORE_INDEX] * 3 + [8]
    assert reconcile(tokenizer, expanded, joined, np.where(expanded == one, one, labels)) is None  # labelled
    assert reconcile(tokenizer, expanded, np.array([5, two, 7, 8]), labels) is None  # another text


def hub_layout(model: Path, out: Path) -> Path:
    """A copy of a tiny VLM's directory with its weights named as the hub's checkpoints of the family were
    saved before transformers 5 (llava-hf's LLaVA, google's Gemma 3: the tower under ``vision_tower.vision_model.``), the names
    vLLM's loader reads; transformers 5 loads them through its renamings."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model, out)
    weights = load_file(out / "model.safetensors")
    renamed = {k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in weights.items()}
    save_file(renamed, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_the_engine_push_names_each_weight_as_the_checkpoint_the_model_was_loaded_from(
    vlms: dict[str, Path], tmp_path: Path
) -> None:
    """A LLaVA checkpoint in the hub's layout: the weights pushed to a vLLM engine carry the file's names
    (transformers 5 holds them as ``model.vision_tower.*``: vLLM refused those), under LoRA too, and a
    checkpoint in transformers 5's own layout under its own."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from posttrain.generation.vllm_engine import named_weights

    hub = hub_layout(vlms["llava"], tmp_path / "hub")
    on_disk = load_file(hub / "model.safetensors")
    model = AutoModelForImageTextToText.from_pretrained(hub)
    pushed = dict(named_weights(model))
    assert pushed.keys() == on_disk.keys(), set(pushed) ^ set(on_disk)
    assert all(torch.equal(pushed[name], on_disk[name]) for name in on_disk)
    adapted = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    assert dict(named_weights(adapted)).keys() == on_disk.keys()

    native = AutoModelForImageTextToText.from_pretrained(vlms["llava"])  # transformers 5's own layout
    assert dict(named_weights(native)).keys() == load_file(vlms["llava"] / "model.safetensors").keys()


def test_a_text_model_refuses_rows_with_images(base_config: dict, tmp_path: Path) -> None:
    """A LLaMA-Factory row's ``<image>`` would otherwise train as text, its image silently dropped."""
    draw_square(tmp_path / "a.png", "red")
    rows = [{"messages": [_user("<image>colour?"), _answer("red")], "images": ["a.png"]}] * 4
    rows += [{"messages": [_user("colour?"), _answer("red")]}] * 4
    base_config["data"]["sources"] = [str(write_jsonl(tmp_path / "rows.jsonl", rows))]
    with pytest.raises(DataError, match="no image processor") as raised:
        train(base_config)
    assert "rows.jsonl row 5" not in str(raised.value)


SMOLVLM_LIKE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def test_a_template_without_generation_marks_labels_by_prefixes(
    vlms: dict[str, Path], tmp_path: Path
) -> None:
    """SmolVLM's kind of template (no ``{% generation %}``, turns closed by ``<end_of_utterance>``): labels from
    token-exact prefix rendering, the end-of-turn token trained."""
    processor, tokenizer = processor_and_tokenizer(vlms["idefics3"])
    processor.chat_template = tokenizer.chat_template = SMOLVLM_LIKE
    draw_square(tmp_path / "a.png", "blue")
    row = {
        "messages": [_user([{"type": "image"}, _text(QUESTION)]), _answer([_text("blue")])],
        "images": ["a.png"],
    }
    [sample] = format_image_rows([{**row, ORIGIN: f"{tmp_path / 'r.jsonl'} row 1"}], tokenizer, _Config())
    assert not isinstance(sample, Exception), sample
    labels = sample["labels"]
    assert tokenizer.decode(labels[labels != IGNORE_INDEX]).strip() == "blue<end_of_utterance>"
    assert (sample["input_ids"] == processor.image_token_id).sum() == 4


def test_a_freeze_key_written_for_a_text_model_is_refused(base_config: dict) -> None:
    from posttrain.errors import UserError

    base_config["model"]["freeze_vision_tower"] = False
    with pytest.raises(UserError, match=r"model.freeze_vision_tower: LlamaForCausalLM is a text model"):
        train(base_config)


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_vlms_from_the_command_line_are_deterministic_and_load_with_their_processors(
    tmp_path: Path, arch: str
) -> None:
    """``posttrain tiny-model --arch ...``: the same bytes twice for a seed, a model and processor that the
    Auto classes load, and a forward on the processor's inputs for an image."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from posttrain.cli import main

    tied = arch == "gemma3"  # its checkpoints' LM head is the input embedding
    arguments = ["--arch", arch, "--seed", "2", "--vocab-size", "512", *(["--tied"] if tied else [])]
    for name in ("a", "b"):
        assert main(["tiny-model", str(tmp_path / name), *arguments]) == 0
    for file in ("model.safetensors", "tokenizer.json", "config.json", "processor_config.json"):
        assert (tmp_path / "a" / file).read_bytes() == (tmp_path / "b" / file).read_bytes(), file
    processor = AutoProcessor.from_pretrained(tmp_path / "a")
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "a").eval()
    head, embedding = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert (head.data_ptr() == embedding.data_ptr()) == tied
    question = [{"role": "user", "content": [{"type": "image"}, _text(QUESTION)]}]
    text = processor.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    picture = images.open_image({"path": str(draw_square(tmp_path / "red.png", "red"))})
    inputs = processor(text=[text], images=[[picture]], return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape[:2] == inputs["input_ids"].shape and torch.isfinite(logits).all()


def test_the_qwen_vl_family_without_torchvision_is_one_clear_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys

    from posttrain.cli import main

    monkeypatch.setitem(
        sys.modules, "torchvision", None
    )  # `import torchvision` fails, as where it is missing
    assert main(["tiny-model", str(tmp_path / "q"), "--arch", "qwen2_5_vl"]) == 2
    error = capsys.readouterr().err
    assert "--arch qwen2_5_vl" in error and "torchvision" in error and "make vision-env" in error, error
    assert "Traceback" not in error and not (tmp_path / "q").exists()
