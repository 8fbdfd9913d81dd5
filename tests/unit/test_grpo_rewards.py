"""Reward functions: the built-ins, the TRL calling convention, and the errors a bad reward stops the run with;
and the reproducible draw behind every completion (generation/keyed.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from posttrain.config import ConfigError, load_config
from posttrain.config.rewards import ExactMatchReward, FunctionReward, LengthPenaltyReward, RegexReward
from posttrain.generation.keyed import MASK, KeyedSampler, _mix, _mix_int, completion_key, keyed_draw
from posttrain.rewards.calls import RewardError
from posttrain.rewards.functions import build_rewards, last_boxed, same_answer
from posttrain.rewards.guard import score_all


def _one(config) -> object:
    return build_rewards([config], max_completion_length=10)[0]


def _score(config, completions, **columns):
    reward = _one(config)
    ids = [[1] * n for n in columns.pop("lengths", [3] * len(completions))]
    origins = [f"data.jsonl row {i + 1}" for i in range(len(completions))]
    return score_all([reward], ["q"] * len(completions), completions, ids, columns, origins)[0]


def test_exact_match_extracts_and_compares_numbers_as_numbers() -> None:
    last = ExactMatchReward(column="answer")
    assert _score(last, ["so 40, then 1,000", "it is 12", "none"], answer=["1000.0", "13", "1"]) == [
        1.0,
        0.0,
        0.0,
    ]
    boxed = ExactMatchReward(column="answer", extract="boxed")
    assert _score(
        boxed, ["\\boxed{\\frac{1}{2}}", "\\boxed{3} then \\boxed{4}"], answer=["\\frac{1}{2}", "4"]
    ) == [
        1.0,
        1.0,
    ]
    regex = ExactMatchReward(column="y", extract="regex", pattern=r"Answer: (\w+)")
    assert _score(regex, ["Answer: no. Answer: yes", "yes"], y=["yes", "yes"]) == [1.0, 0.0]
    whole = ExactMatchReward(column="answer", extract="none")
    chat = [[{"role": "assistant", "content": " 321 "}], [{"role": "assistant", "content": "32"}]]
    assert _score(whole, chat, answer=["321", "321"]) == [1.0, 0.0]
    assert (
        same_answer("1e3", "1000")
        and not same_answer("abc", "abd")
        and last_boxed("\\boxed{a{b}c}") == "a{b}c"
    )


def test_regex_and_the_length_penalty() -> None:
    assert _score(RegexReward(pattern=r"^\d+$", match="full"), ["123", "12a"]) == [1.0, 0.0]
    assert _score(RegexReward(pattern=r"<think>"), ["a <think> b", "b"]) == [1.0, 0.0]
    # DAPO's soft overlong punishment with max_completion_length 10 and a cache of 4: 0 up to 6 tokens,
    # (6 - n) / 4 from 7 to 10, -1 beyond
    penalty = LengthPenaltyReward(soft_punish_cache=4)
    lengths = [5, 6, 8, 10, 11]
    assert _score(penalty, ["x"] * 5, lengths=lengths) == [0.0, 0.0, -0.5, -1.0, -1.0]


def _user_reward(tmp_path: Path, body: str) -> FunctionReward:
    path = tmp_path / f"reward_{abs(hash(body))}.py"
    path.write_text(body)
    return FunctionReward(function=f"{path}:reward")


def test_a_trl_reward_function_gets_trls_arguments(tmp_path: Path) -> None:
    seen = {}
    body = "SEEN = {}\ndef reward(prompts, completions, completion_ids, **kwargs):\n"
    body += "    SEEN.update(prompts=prompts, completions=completions, ids=completion_ids, **kwargs)\n"
    body += "    return [float(len(c)) if k == 'a' else None for c, k in zip(completions, kwargs['kind'])]\n"
    config = _user_reward(tmp_path, body)
    values = _score(config, ["ab", "abc"], kind=["a", "b"], answer=["1", "2"])
    assert values[0] == 2.0 and math.isnan(values[1])  # None: this reward has nothing to say
    from posttrain.config.user_code import import_user_module

    seen = import_user_module(Path(config.function.rpartition(":")[0])).SEEN
    assert (
        seen["prompts"] == ["q", "q"]
        and seen["completions"] == ["ab", "abc"]
        and seen["answer"] == ["1", "2"]
    )
    assert seen["ids"] == [[1, 1, 1], [1, 1, 1]]


@pytest.mark.parametrize(
    "returned",
    [
        "[True, None, np.float32(0.25), np.int64(3)]",
        "np.array([1.0, np.nan, 0.25, 3.0])",
        "torch.tensor([1.0, float('nan'), 0.25, 3.0])",
        "[torch.tensor(True), None, torch.tensor(0.25, dtype=torch.float64), np.bool_(True) + 2]",
    ],
)
def test_rewards_may_return_what_trl_takes(tmp_path: Path, returned: str) -> None:
    """Bools, NumPy scalars and arrays, 0-d tensors and tensors, None: as TRL turns them into a tensor."""
    body = f"import numpy as np\nimport torch\ndef reward(completions, **kw):\n    return {returned}\n"
    values = _score(_user_reward(tmp_path, body), ["a", "b", "c", "d"])
    assert values[0] == 1.0 and math.isnan(values[1]) and values[2] == 0.25 and values[3] == 3.0


def test_async_rewards_are_awaited_together(tmp_path: Path) -> None:
    """``async def`` rewards (TRL gathers them on an event loop): two that each wait for the other finish only
    when they run at once."""
    body = (
        "import asyncio\nSTARTED = []\n"
        "async def first(completions, **kw):\n    STARTED.append(1)\n    await _both()\n    return [1.0] * len(completions)\n"
        "async def second(completions, **kw):\n    STARTED.append(2)\n    await _both()\n    return [2.0] * len(completions)\n"
        "async def _both():\n    while len(STARTED) < 2:\n        await asyncio.sleep(0.001)\n"
        "async def broken(completions, **kw):\n    await asyncio.sleep(0)\n    raise KeyError('answer')\n"
    )
    path = tmp_path / "async_rewards.py"
    path.write_text(body)
    rewards = build_rewards(
        [FunctionReward(function=f"{path}:first"), FunctionReward(function=f"{path}:second")], 10
    )
    values = score_all(
        rewards, ["q", "q"], ["a", "b"], [[1], [1]], {}, ["data.jsonl row 1", "data.jsonl row 2"]
    )
    assert values == [[1.0, 1.0], [2.0, 2.0]]
    broken = build_rewards([FunctionReward(function=f"{path}:broken")], 10)
    with pytest.raises(RewardError, match=rf"reward 'broken' .* raised KeyError: 'answer' at {path}:16"):
        score_all(broken, ["q"], ["a"], [[1]], {}, ["data.jsonl row 1"])


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            "def reward(completions, **kw):\n    return [1 / 0 for _ in completions]\n",
            "raised ZeroDivisionError",
        ),
        ("def reward(completions, **kw):\n    return [1.0]\n", "returned 1 values for 2 completions"),
        ("def reward(completions, **kw):\n    return ['1', 2.0]\n", "returned '1' (str)"),
    ],
)
def test_a_reward_that_fails_names_itself_its_line_and_the_row(
    tmp_path: Path, body: str, expected: str
) -> None:
    config = _user_reward(tmp_path, body)
    with pytest.raises(RewardError) as error:
        _score(config, ["a", "b"])
    message = str(error.value)
    assert "reward 'reward'" in message and expected in message and "data.jsonl row 1" in message
    assert f"{config.function.rpartition(':')[0]}:1" in message  # the function's file and line


def test_a_missing_exact_match_column_is_named() -> None:
    with pytest.raises(RewardError, match="reads the column 'answer'"):
        _score(ExactMatchReward(column="answer"), ["1"], other=["1"])


def _grpo(tmp_path: Path, **extra) -> dict:
    return {
        "type": "grpo",
        "model": {"name_or_path": "m"},
        "data": {"sources": ["p.jsonl"]},
        "rewards": [{"type": "exact_match"}],
        **extra,
    }


@pytest.mark.parametrize(
    ("extra", "key", "text"),
    [
        ({"num_generations": 1}, "num_generations", "a group of one completion has no baseline"),
        ({"loss_type": "reinforce", "num_iterations": 2}, "num_iterations", "no importance ratio"),
        ({"beta": 0.1, "model": {"name_or_path": "m", "peft_pretrained": "a"}}, "ref_model", "adapter"),
        ({"rewards": ["nowhere.py:f"]}, "rewards[0].function", "no such file"),
        ({"rewards": [{"type": "exact_match", "extract": "regex"}]}, "rewards[0].pattern", "needs a pattern"),
        (
            {"rewards": [{"type": "regex", "pattern": "("}]},
            "rewards[0].pattern",
            "is not a regular expression",
        ),
        ({"rewards": []}, "rewards", "name at least one reward function"),
        (
            {"dynamic_sampling": True, "dynamic_filtering_range": [1, 0]},
            "dynamic_filtering_range",
            "the low end is not below the high end",
        ),
        ({"dynamic_sampling": True, "tools": ["python"]}, "dynamic_sampling", "multi-turn"),
        (
            {"dynamic_sampling": True, "max_num_gen_batches": 0},
            "max_num_gen_batches",
            "greater than or equal",
        ),
        (
            {"use_vllm": True, "vllm_importance_sampling_clip_max": None},
            "vllm_importance_sampling_clip_max",
            "a bound",
        ),
        (
            {"use_vllm": True, "vllm_importance_sampling_clip_min": 4.0},
            "vllm_importance_sampling_clip_min",
            "not below",
        ),
        (
            {"sequence_parallel_size": 2, "importance_sampling_level": "sequence"},
            "importance_sampling_level",
            "GSPO",
        ),
        (
            {"sequence_parallel_size": 2, "micro_batch_size": 3, "gradient_accumulation_steps": 1},
            "sequence_parallel_size",
            "equal share",
        ),
    ],
)
def test_bad_settings_are_config_errors_with_their_key(
    tmp_path: Path, extra: dict, key: str, text: str
) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(data=_grpo(tmp_path, **extra), base_dir=tmp_path)
    issues = [(issue.path, issue.message) for issue in error.value.issues]
    assert any(path == key and text in message for path, message in issues), issues


def test_sequence_parallelism_validates_for_token_level_grpo(tmp_path: Path) -> None:
    config = load_config(
        data=_grpo(tmp_path, sequence_parallel_size=2, micro_batch_size=2), base_dir=tmp_path
    )
    assert config.sequence_parallel_size == 2 and config.padding_free
    distill = {
        "type": "distill",
        "model": {"name_or_path": "m"},
        "teacher_model_name_or_path": "t",
        "data": {"sources": ["p.jsonl"]},
        "sequence_parallel_size": 2,
        "micro_batch_size": 2,
    }
    assert load_config(data=distill, base_dir=tmp_path).sequence_parallel_size == 2


def test_trl_names_and_defaults_carry_over(tmp_path: Path) -> None:
    config = load_config(data=_grpo(tmp_path, scale_rewards=False, epsilon_high=0.28), base_dir=tmp_path)
    assert config.scale_rewards == "none" and config.clip_high == 0.28 and config.loss_type == "dapo"
    assert config.num_generations == 8 and config.beta == 0.0 and config.data.reward_columns == ["answer"]


# --------------------------------------------------------------------------------------- reproducible draws


def test_the_tensor_mix_is_the_integer_mix() -> None:
    values = [0, 1, 12345, MASK, (1 << 61) + 17, completion_key(1, 2, 3)]
    mixed = _mix(torch.tensor(values, dtype=torch.int64)).tolist()
    assert mixed == [_mix_int(v) for v in values]
    assert completion_key(1, 2, 3, 4, 5) == completion_key(1, 2, 3, 4, 5) != completion_key(1, 2, 3, 4, 6)


def test_keyed_draws_follow_the_softmax_whatever_the_other_rows() -> None:
    """Over 40,000 keys each token is drawn as often as softmax says (within 4 sigma); a row's draw does
    not depend on the other rows; top-k's excluded tokens are never drawn."""
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5])
    keys = torch.tensor([completion_key(7, 0, 0, i, 0) for i in range(40000)], dtype=torch.int64)
    drawn = keyed_draw(logits.expand(len(keys), 5), keys, step=3)
    frequency = torch.bincount(drawn, minlength=5).double() / len(keys)
    expected = torch.softmax(logits.double(), -1)
    sigma = (expected * (1 - expected) / len(keys)).sqrt()
    assert ((frequency - expected).abs() < 4 * sigma).all(), (frequency, expected)
    other = torch.tensor([[5.0, -3.0, 0.0, 0.0, 1.0]])
    alone = keyed_draw(logits[None], keys[5:6], step=3)
    mixed = keyed_draw(torch.cat([other, logits[None]]), torch.stack([keys[0], keys[5]]), step=3)
    assert alone[0] == drawn[5] == mixed[1]
    top_two = logits.masked_fill(logits < 1.0, -torch.inf)  # what top-k 2 leaves
    assert set(keyed_draw(top_two.expand(2000, 5), keys[:2000], step=3).tolist()) == {0, 3}
    scores = KeyedSampler(keys[:3], prompt_length=4)(torch.zeros(3, 7, dtype=torch.long), logits.expand(3, 5))
    assert (scores == 0).sum(-1).tolist() == [1, 1, 1] and torch.equal(
        scores.argmax(-1), keyed_draw(logits.expand(3, 5), keys[:3], step=3)
    )


def test_text_prompts_carry_the_tokenizers_special_tokens_as_in_trl(tiny_tokenizer) -> None:
    """TRL tokenizes a text prompt with ``processing_class(text=prompts)``: special tokens on. A tokenizer that
    adds its BOS puts it before the prompt; chat prompts go through the template (which writes its own)."""
    import copy

    from tokenizers.processors import TemplateProcessing

    from posttrain.data.prompts import prompt_ids

    tokenizer = copy.deepcopy(tiny_tokenizer)
    bos = tokenizer.bos_token
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tokenizer.bos_token_id)]
    )
    text = "reverse 12345"
    ids = prompt_ids(tokenizer, text)
    assert ids[0] == tokenizer.bos_token_id and ids == tokenizer(text)["input_ids"]
    assert ids[1:] == tokenizer(text, add_special_tokens=False)["input_ids"]
    chat = prompt_ids(tokenizer, [{"role": "user", "content": text}])
    assert chat.count(tokenizer.bos_token_id) == 1  # the template's BOS only


def test_the_models_generation_defaults_never_apply_and_its_eos_stops() -> None:
    """A checkpoint's ``generation_config.json`` (a repetition penalty, n-gram blocking, suppressed tokens)
    does not change what is sampled: completions come from the policy as the run's config says. Its EOS ids
    end a completion as the tokenizer's do (TRL stops at both)."""
    from transformers import GenerationConfig

    from posttrain.generation.keyed import completion_key
    from posttrain.generation.transformers_engine import TransformersEngine
    from posttrain.generation.types import Sampling
    from posttrain.tiny_model import build_model

    model = build_model(256, hidden_size=32, heads=2, seed=5).eval()
    backend = TransformersEngine([255], pad_id=0)
    prompts = [[5, 6, 7, 8], [9, 10]]
    sampling = Sampling(max_new_tokens=12, temperature=1.0)
    keys = [completion_key(0, 0, 0, p, 0) for p in range(2)]
    clean = backend.generate(model, prompts, sampling, keys), backend.generate(model, prompts, sampling, None)
    own = GenerationConfig(
        repetition_penalty=5.0, no_repeat_ngram_size=1, suppress_tokens=list(range(20, 200))
    )
    model.generation_config = own
    dressed = (
        backend.generate(model, prompts, sampling, keys),
        backend.generate(model, prompts, sampling, None),
    )
    assert [c.ids for c in dressed] == [c.ids for c in clean]
    assert model.generation_config is own  # restored after generating
    greedy = clean[1].ids[0]
    assert len(greedy) == 12 and clean[1].truncated[0]
    model.generation_config = GenerationConfig(eos_token_id=greedy[2])
    stopped = backend.generate(model, prompts, sampling, None)
    assert stopped.ids[0] == greedy[: greedy.index(greedy[2]) + 1] and not stopped.truncated[0]


def test_completions_no_reward_scores_are_said(tmp_path: Path, tiny_tokenizer) -> None:
    """Every function returning None for a completion leaves it out (advantage 0, TRL's NaN); the run says so
    in one line naming how many, the rows and the functions (TRL warns too), and says nothing otherwise."""
    from posttrain.data.prompts import ORIGIN_KEY
    from posttrain.dist import DistInfo
    from posttrain.generation.types import Completions
    from posttrain.rewards.scorer import Scorer

    body = "def reward(completions, kind, **kw):\n    return [1.0 if k == 'a' else None for k in kind]\n"
    function = _user_reward(tmp_path, body)
    config = load_config(
        data={
            "type": "grpo",
            "model": {"name_or_path": "m"},
            "data": {"sources": ["d.jsonl"]},
            "rewards": [{"type": "function", "function": function.function}],
        },
        base_dir=tmp_path,
    )
    scorer = Scorer(config, tiny_tokenizer)
    one = DistInfo(0, 0, 1, torch.device("cpu"))
    rows = [{"prompt": "q", "kind": k, ORIGIN_KEY: f"d.jsonl row {i + 1}"} for i, k in enumerate("aab")]
    scores = scorer.score(rows, Completions([[5, 6]] * 3, [False] * 3))
    assert math.isnan(scores.values[2, 0]) and scorer.none_scored_line(scores, one).startswith(
        "every reward function returned None for 1 of the step's 3 completions (among them the completions of "
        "d.jsonl row 3): no reward scores them"
    )
    scores = scorer.score(rows[:2], Completions([[5, 6]] * 2, [False] * 2))
    assert scorer.none_scored_line(scores, one) == ""
