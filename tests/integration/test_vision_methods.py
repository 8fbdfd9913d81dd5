"""Vision-language models beyond SFT: DPO on preference pairs whose prompt holds images (TRL's layout), the
processor's own tokens and images in both rows of a pair, scored as the model scores the processor's own
inputs; GRPO on image prompts: generation and the trainer's log-probabilities on the processor's own inputs,
the rewards given the images; lm-evaluation-harness's multimodal model on an export; and what is not read yet
refused with the reason."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from posttrain.config.dpo import DPODataConfig
from posttrain.data.samples import IGNORE_INDEX
from posttrain.errors import UserError
from posttrain.testing.data import write_jsonl
from posttrain.testing.vision import COLOURS, colour_pairs, colour_prompts, draw_square, write_colour_task
from posttrain.vision import images
from posttrain.vision.formatting import ORIGIN
from posttrain.vision.preferences import PROMPT_LENGTH, fit_image_pair, format_image_pairs
from tests.integration.helpers import merge, metrics, train
from tests.integration.test_vision import ARCHS, QWEN, processor_and_tokenizer, vlm_config
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


@pytest.mark.parametrize("arch", ["idefics3", *QWEN[1:2]])
def test_kto_rows_on_images_score_the_processors_tokens_and_their_kl_sequences_keep_their_prompts_images(
    vlms: dict[str, Path], tmp_path: Path, arch: str
) -> None:
    """TRL's unpaired rows (``prompt``, ``completion``, ``label``, ``images``): each completion and each KL
    sequence (the prompt with the next row's completion) is what the processor makes of it with the prompt's
    image; the logged log-probabilities equal the model's on the processor's own inputs."""
    from transformers import AutoModelForImageTextToText

    from posttrain.config.kto import KTODataConfig
    from posttrain.vision.preferences import format_image_kto_rows

    processor, tokenizer = processor_and_tokenizer(vlms[arch])
    rows = [
        {"prompt": p["prompt"], "completion": p[side], "label": side == "chosen", "images": p["images"]}
        for p, side in zip(colour_pairs(tmp_path, 6, seed=10), ["chosen", "rejected"] * 3, strict=True)
    ]
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    origin = [{**row, ORIGIN: f"{data} row {i + 1}"} for i, row in enumerate(rows)]
    samples = format_image_kto_rows(origin, tokenizer, KTODataConfig.model_construct())
    assert not [s for s in samples if isinstance(s, Exception)], samples

    model = AutoModelForImageTextToText.from_pretrained(vlms[arch], dtype=torch.float32).eval()
    pictures = [images.open_image(images.reference(row["images"][0], tmp_path)) for row in rows]
    logps: dict[bool, list[float]] = {True: [], False: []}
    for index, (row, sample) in enumerate(zip(rows, samples, strict=True)):
        kind = "desirable" if row["label"] else "undesirable"
        nxt = rows[(index + 1) % len(rows)]
        for ids, answer in (
            (sample[f"{kind}_input_ids"], row["completion"]),
            (sample["kl_input_ids"], nxt["completion"]),
        ):
            text = processor.apply_chat_template(row["prompt"] + answer, tokenize=False)
            own = processor(
                text=[text], images=[[pictures[index]]], return_tensors="pt", add_special_tokens=False
            )
            assert own["input_ids"][0].tolist() == ids.tolist()  # the KL row reads its own prompt's image
        labels = torch.as_tensor(sample[f"{kind}_labels"])
        text = processor.apply_chat_template(row["prompt"] + row["completion"], tokenize=False)
        own = processor(
            text=[text], images=[[pictures[index]]], return_tensors="pt", add_special_tokens=False
        )
        with torch.no_grad():
            logits = model(**own).logits[0, :-1].double()
        kept = labels[1:] != IGNORE_INDEX
        logps[row["label"]].append(
            float(torch.log_softmax(logits, -1)[kept].gather(1, labels[1:][kept][:, None]).sum())
        )

    config = vlm_config(vlms[arch], data, tmp_path / "run", type="kto", train_iters=1, micro_batch_size=6)
    train(config)
    [logged] = metrics(config)
    assert logged["logps/chosen"] == pytest.approx(np.mean(logps[True]), abs=1e-4, rel=0)
    assert logged["logps/rejected"] == pytest.approx(np.mean(logps[False]), abs=1e-4, rel=0)
    assert np.isfinite(logged["loss"]) and logged["grad_norm"] > 0


def test_a_reward_model_on_a_vision_language_model_is_refused_in_one_line(
    vlms: dict[str, Path], tmp_path: Path
) -> None:
    draw_square(tmp_path / "a.png", "red")
    row: dict[str, Any] = {
        "prompt": [{"role": "user", "content": "<image>colour?"}],
        "chosen": [{"role": "assistant", "content": "red"}],
        "rejected": [{"role": "assistant", "content": "blue"}],
        "images": ["a.png"],
    }
    data = write_jsonl(tmp_path / "rows.jsonl", [row] * 4)
    config = vlm_config(vlms["idefics3"], data, tmp_path, type="reward")
    with pytest.raises(UserError, match="reward models with an image encoder are not supported yet"):
        train(config)


#: a reward that reads the images (TRL's ``images`` column, Pillow): 1 where the square drawn in the prompt's
#: image has the colour of the row's ``answer``
SEES_COLOUR = f"""
COLOURS = {COLOURS!r}

def square_matches(completions, images, answer, **kwargs):
    out = []
    for pictures, colour in zip(images, answer):
        [picture] = pictures
        out.append(float(COLOURS[colour] in [rgb for _, rgb in picture.getcolors()]))
    return out

def length(completions, **kwargs):
    return [len(c[0]["content"]) / 10 for c in completions]
"""


@pytest.mark.parametrize("arch", ARCHS)
def test_grpo_prompts_with_images_generate_and_score_on_the_processors_inputs(
    vlms: dict[str, Path], tmp_path: Path, arch: str
) -> None:
    """The prompts' ids are the processor's; a left-padded batch's greedy completions are those of each
    prompt generated alone from the processor's own inputs; the trainer's log-probabilities of them equal the
    model's on the processor's own inputs."""
    from transformers import AutoModelForImageTextToText

    from posttrain.config.prompts import PromptsDataConfig
    from posttrain.generation.transformers_engine import TransformersEngine, split_completions
    from posttrain.generation.types import Sampling
    from posttrain.models.token_logps import token_logps
    from posttrain.rollout.feed import training_micro_batches
    from posttrain.rollout.sampler import stop_ids
    from posttrain.vision.collate import attach_images
    from posttrain.vision.prompts import format_image_prompts

    processor, tokenizer = processor_and_tokenizer(vlms[arch])
    rows = colour_prompts(tmp_path, 4, seed=5)
    rows[1]["prompt"] = [
        {
            "role": "user",
            "content": [*rows[1]["prompt"][0]["content"], {"type": "text", "text": " Say it twice."}],
        }
    ]
    origin = [{**row, ORIGIN: f"{tmp_path / 'prompts.jsonl'} row {i + 1}"} for i, row in enumerate(rows)]
    samples = format_image_prompts(origin, tokenizer, PromptsDataConfig.model_construct())
    assert not [s for s in samples if isinstance(s, Exception)], samples
    pictures = [[images.open_image(images.reference(row["images"][0], tmp_path))] for row in rows]
    own = []
    for row, picture in zip(rows, pictures, strict=True):
        text = processor.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        own.append(processor(text=[text], images=[picture], return_tensors="pt", add_special_tokens=False))
    prompts = [sample["input_ids"].tolist() for sample in samples]
    assert prompts == [inputs["input_ids"][0].tolist() for inputs in own]
    assert len({len(p) for p in prompts}) == 2  # the batch is left-padded

    model = AutoModelForImageTextToText.from_pretrained(vlms[arch], dtype=torch.float32).eval()
    stops = stop_ids(tokenizer, model)
    pad = tokenizer.pad_token_id
    backend = TransformersEngine(stops, pad, processor)
    completions = backend.generate(model, prompts, Sampling(max_new_tokens=6), None, images=pictures)
    for inputs, ids in zip(own, completions.ids, strict=True):
        with torch.no_grad():
            alone = model.generate(
                **inputs, max_new_tokens=6, do_sample=False, eos_token_id=stops, pad_token_id=pad
            )
        assert split_completions(alone[:, inputs["input_ids"].shape[1] :], stops, pad).ids[0] == ids

    [batch] = attach_images(
        training_micro_batches(prompts, completions, {}, 4, pad, False), pictures, processor
    )
    with torch.no_grad():
        logps, _ = token_logps(model, batch)
        for index, (inputs, ids) in enumerate(zip(own, completions.ids, strict=True)):
            whole = {**inputs, "input_ids": torch.cat([inputs["input_ids"], torch.tensor([ids])], 1)}
            whole["attention_mask"] = torch.ones_like(whole["input_ids"])
            for types in ("token_type_ids", "mm_token_type_ids"):  # the completion is text
                if types in inputs:
                    whole[types] = torch.cat([inputs[types], torch.zeros(1, len(ids), dtype=torch.long)], 1)
            logits = model(**whole).logits[0, :-1].double()
            expected = torch.log_softmax(logits, -1)[-len(ids) :].gather(1, torch.tensor(ids)[:, None])[:, 0]
            mask = batch["completion_mask"][index].bool()
            assert torch.allclose(logps[index][mask].double(), expected, atol=1e-5, rtol=0)


def test_grpo_on_image_prompts_trains_with_rewards_that_read_the_images(
    vlms: dict[str, Path], tmp_path: Path
) -> None:
    data = write_jsonl(tmp_path / "prompts.jsonl", colour_prompts(tmp_path, 8, seed=6))
    held_out = write_jsonl(tmp_path / "held_out.jsonl", colour_prompts(tmp_path, 4, seed=8))
    (tmp_path / "sees.py").write_text(SEES_COLOUR)
    config = vlm_config(vlms["idefics3"], data, tmp_path / "run", type="grpo", train_iters=2, beta=0.04)
    config = {k: v for k, v in config.items() if k != "data"}
    config.update(
        data={"sources": [str(data)], "eval_sources": [str(held_out)], "max_length": 96, "dl_num_workers": 0},
        eval_on_start=True,
        rewards=[f"{tmp_path / 'sees.py'}:square_matches", f"{tmp_path / 'sees.py'}:length"],
        num_generations=4,
        max_completion_length=6,
        micro_batch_size=4,
        gradient_accumulation_steps=2,
    )
    train(config)
    records = metrics(config)
    evaluations = [r["eval_rewards/square_matches"] for r in records if "eval_reward" in r]
    assert evaluations == [1.0, 1.0]  # the held-out prompts' images reach the rewards, at the start and end
    first, second = (r for r in records if "reward" in r)
    assert first["rewards/square_matches/mean"] == second["rewards/square_matches/mean"] == 1.0
    assert first["kl"] == 0.0 and second["kl"] > 0  # the reference reads the images as the policy does
    assert np.isfinite(second["loss"]) and second["grad_norm"] > 0


def test_online_runs_that_do_not_read_images_yet_say_so(vlms: dict[str, Path], tmp_path: Path) -> None:
    from types import SimpleNamespace

    from posttrain.generation.types import EngineInputs
    from posttrain.generation.vllm_engine import colocated_engine
    from posttrain.generation.vllm_server import server_engine

    processor, _ = processor_and_tokenizer(vlms["idefics3"])
    inputs = EngineInputs(torch.nn.Linear(1, 1), [0], 0, None, 1, None, lambda: False, processor)
    with pytest.raises(UserError, match="vllm_mode: server does not yet"):
        server_engine(SimpleNamespace(use_vllm=True, vllm_mode="server"), inputs)
    with pytest.raises(UserError, match="and LoRA: the engine takes pushes of the whole weights"):
        colocated_engine(SimpleNamespace(model=SimpleNamespace(peft_config={"r": 8})), inputs)
    from posttrain.tiny_model import write_tiny_model

    data = write_jsonl(tmp_path / "prompts.jsonl", colour_prompts(tmp_path, 4, seed=7))
    config = vlm_config(vlms["idefics3"], data, tmp_path / "run", type="distill", train_iters=1)
    config = {k: v for k, v in config.items() if k != "data"}
    text = write_tiny_model(tmp_path / "text", seed=0, hidden_size=64, layers=2, vocab_size=1024, heads=2)
    config.update(
        data={"sources": [str(data)], "max_length": 96, "dl_num_workers": 0},
        teacher_model_name_or_path=str(text),
        max_completion_length=4,
        micro_batch_size=4,
    )
    with pytest.raises(UserError, match="teacher_model_name_or_path: "):  # its tokenizer, or its images
        train(config)


@pytest.mark.parametrize("arch", ["idefics3", *QWEN[2:]])
def test_distill_on_image_prompts_from_a_vision_language_teacher(
    vlms: dict[str, Path], tmp_path: Path, arch: str
) -> None:
    """On-policy distillation of a tiny VLM from a wider one of its family on image prompts: the teacher samples
    (``seq_kd``, ``lmbda: 0``) and scores with the images, the held-out prompts too."""
    from posttrain.vision.tiny import write_tiny_vlm

    teacher = write_tiny_vlm(tmp_path / "teacher", arch, vocab_size=1024, hidden_size=128, heads=4)
    data = write_jsonl(tmp_path / "prompts.jsonl", colour_prompts(tmp_path, 8, seed=13))
    held_out = write_jsonl(tmp_path / "held_out.jsonl", colour_prompts(tmp_path, 4, seed=14))
    config = vlm_config(vlms[arch], data, tmp_path / "run", type="distill", train_iters=2)
    config = {k: v for k, v in config.items() if k != "data"}
    config.update(
        data={"sources": [str(data)], "eval_sources": [str(held_out)], "max_length": 96, "dl_num_workers": 0},
        teacher_model_name_or_path=str(teacher),
        lmbda=0.0,
        seq_kd=True,
        max_completion_length=6,
        micro_batch_size=4,
        eval_interval=2,
    )
    train(config)
    records = metrics(config)
    steps = [r for r in records if "grad_norm" in r]
    assert len(steps) == 2 and all(np.isfinite(r["loss"]) and r["loss"] > 0 for r in steps)
    assert steps[-1]["grad_norm"] > 0
    assert [r for r in records if "eval_divergence" in r]


@pytest.mark.slow
def test_grpo_on_images_gives_one_processs_numbers_on_two_and_resumes_exactly_after_a_kill(
    vlms: dict[str, Path], tmp_path: Path
) -> None:
    """GRPO on image prompts under ZeRO-2: two processes log the rewards and losses one process logs, and a
    run SIGKILLed after its checkpoint at step 2 and resumed with ``auto_resume`` ends where the
    uninterrupted one does (the images travel with the rows and the kept micro-batches)."""
    from tests.resume_helpers import assert_same_continuation, cli, kill_and_resume, last_metrics

    data = write_jsonl(tmp_path / "prompts.jsonl", colour_prompts(tmp_path, 16, seed=9))
    (tmp_path / "sees.py").write_text(SEES_COLOUR)
    base = vlm_config(vlms["idefics3"], data, tmp_path / "unused", type="grpo", beta=0.04)
    base = {k: v for k, v in base.items() if k != "data"}
    base.update(
        data={"sources": [str(data)], "max_length": 96, "dl_num_workers": 0},
        rewards=[f"{tmp_path / 'sees.py'}:square_matches", f"{tmp_path / 'sees.py'}:length"],
        num_generations=4,
        max_completion_length=6,
        micro_batch_size=2,
        gradient_accumulation_steps=2,
        num_iterations=2,
        deepspeed={"zero_optimization": {"stage": 2}},
    )
    (tmp_path / "two").mkdir()
    results = kill_and_resume(base, tmp_path / "two", nproc=2, kill_at=2, total=4)
    assert_same_continuation(results, kill_at=2, total=4)

    one = merge(
        base, train_iters=4, gradient_accumulation_steps=4, logger={"output_dir": str(tmp_path / "one")}
    )
    done = cli(one, tmp_path / "one.yaml", 1)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    single, pair = last_metrics(tmp_path / "one"), results["reference_metrics"]
    for step in range(1, 5):
        for key in ("loss", "reward", "kl"):
            assert single[step][key] == pytest.approx(pair[step][key], abs=1e-5), (step, key)


@pytest.mark.parametrize("arch", ["idefics3", *QWEN[2:]])
def test_eval_runs_the_harnesss_multimodal_model_on_a_local_image_task(
    vlms: dict[str, Path], tmp_path: Path, arch: str
) -> None:
    """``posttrain eval`` on a VLM: lm-evaluation-harness's ``hf-multimodal`` model, each response what the
    model answers greedily about the document's image under its chat template (computed here)."""
    from transformers import AutoModelForImageTextToText

    from posttrain.inference.harness import Evaluation, evaluate

    tasks = write_colour_task(tmp_path / "tasks", 6, seed=11)
    evaluation = Evaluation(
        model=vlms[arch],
        tasks=("colour_squares",),
        include_path=tasks,
        batch_size=3,
        apply_chat_template=True,
        device="cpu",
        log_samples=True,
    )
    results = evaluate(evaluation)
    assert results["config"]["model"] == "hf-multimodal"
    assert "exact_match,none" in results["results"]["colour_squares"]
    samples = results["samples"]["colour_squares"]
    assert len(samples) == 6
    assert len({sample["resps"][0][0] for sample in samples}) > 1  # the answers follow the images

    processor, _ = processor_and_tokenizer(vlms[arch])
    model = AutoModelForImageTextToText.from_pretrained(vlms[arch], dtype=torch.float32).eval()
    question = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "What colour is the square?"}],
        }
    ]
    prompt = processor.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    for sample in sorted(samples, key=lambda s: s["doc_id"]):
        image = images.open_image({"path": str(tasks / "images" / f"11-{sample['doc_id']}.png")})
        inputs = processor(text=[prompt], images=[[image]], return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
        text = processor.decode(out[0, inputs["input_ids"].shape[1] :])
        assert sample["resps"][0][0] == text.split("<|im_end|>")[0], sample["doc_id"]


@pytest.mark.parametrize("arch", ARCHS)
def test_collapse_undoes_the_processors_expansion_for_an_engine_that_expands_itself(
    vlms: dict[str, Path], tmp_path: Path, arch: str
) -> None:
    from posttrain.vision.formatting import collapse, expand

    processor, tokenizer = processor_and_tokenizer(vlms[arch])
    rows = colour_prompts(tmp_path, 2, seed=12)
    pictures = [images.open_image(images.reference(row["images"][0], tmp_path)) for row in rows]
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]}
    ]
    ids = np.asarray(tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])
    expanded, _ = expand(processor, ids, pictures)
    assert collapse(processor, expanded.tolist(), pictures) == ids.tolist()
    # the processor's own call: Gemma 3's "\n\n" around each image joins the template's "\n" before it
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    own = processor(text=[text], images=[pictures], add_special_tokens=False)["input_ids"][0]
    assert (list(own) != expanded.tolist()) == (arch == "gemma3")
    assert collapse(processor, list(own), pictures) == ids.tolist()
    with pytest.raises(ValueError, match="do not hold its image's expansion"):
        collapse(processor, ids.tolist(), pictures)  # the ids were never expanded


@pytest.mark.slow
def test_dpo_and_kto_on_images_give_one_processs_numbers_on_two_under_zero3(
    vlms: dict[str, Path], tmp_path: Path
) -> None:
    """The reference pass and the steps of DPO and KTO on image rows, partitioned by ZeRO-3 over two
    processes, log what one process logs (the same global batch)."""
    from tests.resume_helpers import cli, last_metrics

    pairs = colour_pairs(tmp_path, 16, seed=15)
    unpaired = [
        {"prompt": p["prompt"], "completion": p[side], "label": side == "chosen", "images": p["images"]}
        for p in pairs
        for side in ("chosen", "rejected")
    ]
    sources = {
        "dpo": write_jsonl(tmp_path / "pairs.jsonl", pairs),
        "kto": write_jsonl(tmp_path / "kto.jsonl", unpaired),
    }
    for method, data in sources.items():
        logged = {}
        for nproc, stage in ((1, 0), (2, 3)):
            out = tmp_path / f"{method}-{nproc}"
            config = vlm_config(vlms["idefics3"], data, out, type=method, train_iters=3, micro_batch_size=2)
            config.update(
                gradient_accumulation_steps=3 - nproc, deepspeed={"zero_optimization": {"stage": stage}}
            )
            config["logger"] = {"output_dir": str(out)}
            done = cli(config, tmp_path / f"{method}-{nproc}.yaml", nproc)
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
            logged[nproc] = last_metrics(out)
        for step in (1, 2, 3):
            # step 1: the reference pass and the first forward; after it, float32 updates whose gradients were
            # all-reduced in another order (1.8e-5 of 0.59 seen at step 3)
            close = 1e-6 if step == 1 else 1e-4
            for key in ("loss", "logps/chosen", "logps/rejected"):
                assert logged[1][step][key] == pytest.approx(logged[2][step][key], rel=close, abs=1e-7), (
                    method,
                    step,
                    key,
                )
