"""Image rows for tests, the demo and the benchmarks: coloured squares drawn with Pillow, asked about in
each of the row layouts users have (TRL's image parts, LLaMA-Factory's ``<image>`` placeholders, OpenAI's
``image_url`` parts, images as bytes), so a model can only answer from the image."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

#: the colours the rows ask about, and their RGB values
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220)}
QUESTION = "What colour is the square?"
LAYOUTS = ("trl", "llama-factory", "openai", "bytes")


def draw_square(path: Path, colour: str, side: int = 32, seed: int = 0) -> Path:
    """A ``side`` x ``side`` PNG: a square of ``colour`` on a grey ground, at a place drawn from ``seed``."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    image = Image.new("RGB", (side, side), (128, 128, 128))
    size = side // 2
    left, top = rng.randint(0, side - size), rng.randint(0, side - size)
    ImageDraw.Draw(image).rectangle([left, top, left + size - 1, top + size - 1], fill=COLOURS[colour])
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path


def colour_row(image: str | bytes, colour: str, layout: str = "trl") -> dict[str, Any]:
    """A chat row asking the colour of ``image`` (a path relative to the data file, or PNG bytes), in
    ``layout``."""
    if layout == "trl":
        user = [{"type": "image"}, {"type": "text", "text": QUESTION}]
        return {
            "messages": [
                {"role": "user", "content": user},
                {"role": "assistant", "content": [{"type": "text", "text": colour}]},
            ],
            "images": [image],
        }
    if layout == "llama-factory":
        return {
            "messages": [
                {"role": "user", "content": f"<image>{QUESTION}"},
                {"role": "assistant", "content": colour},
            ],
            "images": [image],
        }
    if layout == "openai":
        part = {"type": "image_url", "image_url": {"url": image}}
        return {
            "messages": [
                {"role": "user", "content": [part, {"type": "text", "text": QUESTION}]},
                {"role": "assistant", "content": colour},
            ]
        }
    if layout == "bytes":
        row = colour_row(image, colour, "trl")
        return {**row, "images": [{"bytes": image, "path": None}]}
    raise ValueError(f"layout {layout!r} is not one of {', '.join(LAYOUTS)}")


def colour_rows(directory: Path, count: int, seed: int = 0, layout: str = "trl") -> list[dict[str, Any]]:
    """``count`` rows, each a square of a colour drawn from ``seed`` written under ``directory/images``, with
    its path relative to ``directory`` (where the data file goes)."""
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        colour = rng.choice(sorted(COLOURS))
        name = f"images/{seed}-{index}.png"
        draw_square(directory / name, colour, seed=seed * 100003 + index)
        image: str | bytes = (directory / name).read_bytes() if layout == "bytes" else name
        rows.append(colour_row(image, colour, layout))
    return rows


def colour_pairs(directory: Path, count: int, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` preference rows in TRL's layout (``prompt`` with an image part, ``chosen``: the square's
    colour, ``rejected``: another, ``images``), the images written as ``colour_rows`` writes them."""
    rng = random.Random(seed + 1)
    pairs = []
    for row in colour_rows(directory, count, seed):
        prompt, answer = row["messages"]
        truth = answer["content"][0]["text"]
        wrong = rng.choice([c for c in sorted(COLOURS) if c != truth])
        pairs.append(
            {
                "prompt": [prompt],
                "chosen": [{"role": "assistant", "content": truth}],
                "rejected": [{"role": "assistant", "content": wrong}],
                "images": row["images"],
            }
        )
    return pairs


def colour_prompts(directory: Path, count: int, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` prompt rows in TRL's GRPO layout (``prompt`` with an image part, ``images``) with the
    square's colour in ``answer`` for a reward, the images written as ``colour_rows`` writes them."""
    return [
        {
            "prompt": row["messages"][:1],
            "images": row["images"],
            "answer": row["messages"][1]["content"][0]["text"],
        }
        for row in colour_rows(directory, count, seed)
    ]


def colour_accuracy(
    model_dir: Path, rows: list[dict[str, Any]], directory: Path, swap: bool = False
) -> float:
    """Held-out accuracy of a VLM export on colour rows (``trl`` layout, images relative to ``directory``):
    the answer is the colour whose reply the model finds likeliest. ``swap``: each row is asked about the
    next row's image instead (the control: a model that reads the image falls to chance)."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from posttrain.vision.images import open_image, reference

    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    colours = sorted(COLOURS)
    correct = 0
    for index, row in enumerate(rows):
        shown = rows[(index + 1) % len(rows)] if swap else row
        image = open_image(reference(shown["images"][0], directory))
        question = row["messages"][:1]
        prompt = processor.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
        start = len(processor(text=[prompt], images=[[image]], add_special_tokens=False)["input_ids"][0])
        scores = []
        for colour in colours:
            answer = {"role": "assistant", "content": [{"type": "text", "text": colour}]}
            text = processor.apply_chat_template([*question, answer], tokenize=False)
            inputs = processor(text=[text], images=[[image]], return_tensors="pt", add_special_tokens=False)
            with torch.no_grad():
                logits = model(**inputs).logits[0, :-1].float()
            targets = inputs["input_ids"][0, 1:]
            logps = torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]
            scores.append(float(logps[start - 1 :].sum()))
        truth = row["messages"][1]["content"][0]["text"]
        correct += colours[scores.index(max(scores))] == truth
    return correct / len(rows)


def colour_sampled_accuracy(
    model_dir: Path, rows: list[dict[str, Any]], directory: Path, swap: bool = False, samples: int = 4
) -> float:
    """The share of answers sampled at temperature 1 (``samples`` per held-out row, seeded) that name the
    square's colour exactly: what GRPO's reward asks of the model. ``swap``: as for ``colour_accuracy``."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from posttrain.vision.images import open_image, reference

    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(0)
    correct = 0
    for index, row in enumerate(rows):
        shown = rows[(index + 1) % len(rows)] if swap else row
        image = open_image(reference(shown["images"][0], directory))
        prompt = processor.apply_chat_template(
            row["messages"][:1], tokenize=False, add_generation_prompt=True
        )
        inputs = processor(text=[prompt] * samples, images=[[image]] * samples, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=4)
        answers = processor.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        truth = row["messages"][1]["content"][0]["text"]
        correct += sum(answer.strip() == truth for answer in answers)
    return correct / (len(rows) * samples)


#: a local lm-evaluation-harness task on coloured squares (``write_colour_task``): the harness's
#: ``hf-multimodal`` model answers each image's question, scored by exact match
COLOUR_TASK = """task: colour_squares
dataset_path: parquet
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_image: [image]
doc_to_text: "<image>What colour is the square?"
doc_to_target: answer
generation_kwargs:
  until: ["<|im_end|>"]
  max_gen_toks: 4
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
"""


def write_colour_task(directory: Path, count: int, seed: int = 0) -> Path:
    """A harness task directory (``--include-path``): ``count`` squares in a Parquet file with a
    ``datasets.Image`` column, as image datasets are published, and the task's YAML."""
    import datasets

    rows = colour_rows(directory, count, seed)
    records = [
        {"image": str(directory / row["images"][0]), "answer": row["messages"][1]["content"][0]["text"]}
        for row in rows
    ]
    table = datasets.Dataset.from_list(records).cast_column("image", datasets.Image())
    table.to_parquet(str(directory / "colours.parquet"))
    (directory / "colour_squares.yaml").write_text(COLOUR_TASK.format(data=directory / "colours.parquet"))
    return directory
