"""Vision-language models beyond SFT: DPO on preference pairs whose prompt holds images (TRL's layout), the
processor's own tokens and images in both rows of a pair, scored as the model scores the processor's own
inputs; and the rows a method does not read yet refused with the reason."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from posttrain.config.dpo import DPODataConfig
from posttrain.data.samples import IGNORE_INDEX
from posttrain.errors import DataError
from posttrain.testing.data import write_jsonl
from posttrain.testing.vision import colour_pairs, draw_square
from posttrain.vision import images
from posttrain.vision.formatting import ORIGIN
from posttrain.vision.preferences import PROMPT_LENGTH, fit_image_pair, format_image_pairs
from tests.integration.helpers import metrics, train
from tests.integration.test_vision import ARCHS, processor_and_tokenizer, vlm_config
from tests.integration.test_vision import vlms as vlms

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("arch", ARCHS)
def test_dpo_pairs_on_images_read_the_processors_tokens_and_images_in_both_rows(
    vlms: dict[str, Path], tmp_path: Path, arch: str
) -> None:
    """Every pair in one micro-batch, one step: the logged chosen and rejected log-probabilities (the policy
    before its first update) equal the model's on the processor's own inputs for each row, computed here."""
    from transformers import AutoModelForImageTextToText

    processor, tokenizer = processor_and_tokenizer(vlms[arch])
    rows = colour_pairs(tmp_path, 6, seed=4)
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    origin = [{**row, ORIGIN: f"{data} row {i + 1}"} for i, row in enumerate(rows)]
    pairs = format_image_pairs(origin, tokenizer, DPODataConfig.model_construct())
    assert not [p for p in pairs if isinstance(p, Exception)], pairs

    model = AutoModelForImageTextToText.from_pretrained(vlms[arch], dtype=torch.float32).eval()
    expected: dict[str, list[float]] = {"chosen": [], "rejected": []}
    for row, pair in zip(rows, pairs, strict=True):
        image = images.open_image(images.reference(row["images"][0], tmp_path))
        for side in expected:
            text = processor.apply_chat_template(row["prompt"] + row[side], tokenize=False)
            own = processor(text=[text], images=[[image]], return_tensors="pt", add_special_tokens=False)
            ids, labels = pair[f"{side}_input_ids"], pair[f"{side}_labels"]
            assert own["input_ids"][0].tolist() == ids.tolist()  # the processor's tokens, each image once
            answer = row[side][0]["content"]
            assert tokenizer.decode(labels[labels != IGNORE_INDEX]) == f"{answer}<|im_end|>"
            assert not np.any(labels == processor.image_token_id)
            with torch.no_grad():
                logits = model(**own).logits[0, :-1].double()
            targets = torch.as_tensor(labels[1:])
            kept = targets != IGNORE_INDEX
            logps = torch.log_softmax(logits, -1)[kept].gather(1, targets[kept][:, None])
            expected[side].append(float(logps.sum()))
        prompt = processor.apply_chat_template(row["prompt"], tokenize=False)
        own = processor(text=[prompt], images=[[image]], add_special_tokens=False)
        assert pair[PROMPT_LENGTH][0] == len(own["input_ids"][0])
        assert len(images.decode(pair[images.IMAGES_COLUMN])) == 1

    config = vlm_config(vlms[arch], data, tmp_path / "run", type="dpo", train_iters=1, micro_batch_size=6)
    train(config)
    [logged] = metrics(config)
    for side, values in expected.items():
        assert logged[f"logps/{side}"] == pytest.approx(np.mean(values), abs=1e-4, rel=0)
    assert logged["loss"] == pytest.approx(np.log(2), abs=1e-9)  # the policy is its reference at step 1


def test_image_pairs_that_cannot_be_placed_are_reported_and_long_prompts_dropped(
    vlms: dict[str, Path], tmp_path: Path
) -> None:
    _, tokenizer = processor_and_tokenizer(vlms["idefics3"])
    draw_square(tmp_path / "a.png", "red")
    good = {
        "prompt": [{"role": "user", "content": "<image>What colour?"}],
        "chosen": "red",
        "rejected": "blue",
        "images": ["a.png"],
        ORIGIN: f"{tmp_path / 'pairs.jsonl'} row 1",
    }
    bad = [
        {**good, "chosen": [{"role": "assistant", "content": [{"type": "image", "image": "a.png"}]}]},
        {**good, "images": ["a.png", "a.png"]},
        {**good, "images": ["missing.png"]},
    ]
    config = DPODataConfig.model_construct(max_prompt_length=8)
    first, *errors = format_image_pairs([good, *bad], tokenizer, config)
    messages = [str(e) for e in errors]
    assert "holds an image" in messages[0]
    assert "1 image placeholders" in messages[1] and "2 images" in messages[1]
    assert "missing.png does not exist" in messages[2]
    kept, reason, cut = fit_image_pair(first, 512, config)
    assert kept is None and not cut and "prompt longer than max_prompt_length=8" in reason
    kept, reason, _ = fit_image_pair(first, 20, config.model_copy(update={"max_prompt_length": 0}))
    assert kept is None and "never cut" in reason
    assert fit_image_pair(first, 512, config.model_copy(update={"max_prompt_length": 0}))[0] is not None


def test_rows_with_images_are_refused_by_methods_that_do_not_read_them_yet(
    vlms: dict[str, Path], tmp_path: Path
) -> None:
    draw_square(tmp_path / "a.png", "red")
    row: dict[str, Any] = {
        "prompt": [{"role": "user", "content": "<image>colour?"}],
        "completion": [{"role": "assistant", "content": "red"}],
        "label": True,
        "images": ["a.png"],
    }
    data = write_jsonl(tmp_path / "rows.jsonl", [row] * 4)
    config = vlm_config(vlms["idefics3"], data, tmp_path, type="kto")
    with pytest.raises(DataError, match="images train with types sft and dpo so far"):
        train(config)
