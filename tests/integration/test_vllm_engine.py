"""grpo on vLLM's CPU build, as a user runs it (``make test-vllm``; skipped where vLLM is not installed). Every
run is a ``posttrain`` command in its own process: an engine in a process changes it for good (thread
binding, seeds). One shared set of runs: a reference run, the same run SIGKILLed and resumed, the trained
weights evaluated by transformers, the same config on two processes and through a server.

Eval prompts are longer than a KV block (32 tokens), so an engine that kept its prefix cache across a weight
push would evaluate later steps with the old weights' keys and values."""

from __future__ import annotations

import copy
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from posttrain.dist import free_port
from posttrain.testing.env import child_env
from posttrain.testing.served import vllm_server
from tests.grpo_helpers import DIGITS, engine_grpo_config
from tests.resume_helpers import assert_same_continuation, cli, kill_and_resume, last_metrics

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

KILL_AT, TOTAL = 3, 6
#: the runs sample as users set it: truncated (the trainer's log-probabilities replay it: ratio 1 every step)
TRUNCATED = {"top_k": 20, "top_p": 0.9, "min_p": 0.02}
#: read by the engine's choices: what a user on a CPU would otherwise have to set
VLLM_VARIABLES = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")


#: a reward of weight 0 that tells completions apart: equal means over the same prompts are equal completions
FINGERPRINT = """
def fingerprint(completion_ids, **kwargs):
    return [float(sum((i + 1) * t for i, t in enumerate(ids)) % 1000003) for ids in completion_ids]
"""


def write_long_prompts(path: Path, count: int) -> Path:
    rng = random.Random(7)
    with path.open("w") as out:
        for _ in range(count):
            number = "".join(rng.choice("0123456789") for _ in range(6))
            text = (
                "Read the number at the end of this message carefully, then write its digits in reverse order, "
                f"one after another, with nothing before or after them: {number}"
            )
            out.write(
                json.dumps({"prompt": [{"role": "user", "content": text}], "answer": number[::-1]}) + "\n"
            )
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from posttrain.tiny_model import write_tiny_model

    root = tmp_path_factory.mktemp("vllm")
    (root / "digits.py").write_text(DIGITS + FINGERPRINT)
    model = write_tiny_model(root / "model", seed=0, hidden_size=64, layers=2, vocab_size=1024, heads=2)
    config = engine_grpo_config(
        root,
        model,
        [
            f"{root / 'digits.py'}:digit_share",
            {"function": f"{root / 'digits.py'}:fingerprint", "weight": 0.0},
        ],
        data={"eval_sources": [str(write_long_prompts(root / "eval.jsonl", 8))]},
        eval_interval=2,
        use_vllm=True,
        **TRUNCATED,
    )
    for name in VLLM_VARIABLES:
        assert name not in child_env(), f"{name} is set: the test would not show posttrain picks it"
    return {
        "root": root,
        "config": config,
        **kill_and_resume(config, root, nproc=1, kill_at=KILL_AT, total=TOTAL),
    }


def test_the_engine_picks_its_cpu_settings_and_a_resumed_run_is_exact(runs: dict[str, Any]) -> None:
    said = runs["reference"].stdout + runs["reference"].stderr
    assert "vLLM on the CPU: eager, in this process, KV cache 64 MiB" in said, said[-3000:]
    assert "no sleep mode" in said
    assert_same_continuation(runs, KILL_AT, TOTAL)
    reference, resumed = runs["reference_metrics"], runs["resumed_metrics"]
    for step in range(1, TOTAL + 1):
        assert reference[step]["reward"] == resumed[step]["reward"], step  # the same completions
        assert reference[step].get("eval_reward") == resumed[step].get("eval_reward"), step
    # TRL's importance-sampling correction: engine and trainer agree on float32 weights pushed after each update,
    # under truncated sampling too (the trainer replays top_k, top_p and min_p)
    for step in range(1, TOTAL + 1):
        record = reference[step]
        assert abs(record["sampling/importance_sampling_ratio/mean"] - 1) < 1e-4, record
        assert record["sampling/sampling_logp_difference/max"] < 1e-4, record


def test_the_last_evaluation_is_what_the_trained_weights_generate(
    runs: dict[str, Any], tmp_path: Path
) -> None:
    """The final weights, exported, evaluated by transformers' greedy decoding: the same rewards as the run's
    last evaluation through vLLM (which differs from the first: the weights moved)."""
    reference = runs["reference_metrics"]
    config = copy.deepcopy(runs["config"])
    config["model"]["name_or_path"] = str(runs["root"] / "reference" / "export" / "final")
    config.update(use_vllm=False, skip_train=True, logger={"output_dir": str(tmp_path / "eval")})
    done = cli(config, tmp_path / "eval.yaml")
    assert done.returncode == 0, done.stderr[-3000:]
    evaluated = [
        json.loads(line) for line in (tmp_path / "eval" / "train-log-metrics.jsonl").read_text().splitlines()
    ]
    for key in ("eval_reward", "eval_rewards/fingerprint"):
        assert evaluated[-1][key] == pytest.approx(reference[TOTAL][key], abs=1e-9), key
    assert reference[2]["eval_rewards/fingerprint"] != reference[TOTAL]["eval_rewards/fingerprint"]


PUSH = Path(__file__).parents[1] / "resources" / "vllm_push.py"


@pytest.mark.parametrize(("reset", "tied"), [(True, False), (False, False), (True, True)])
def test_a_push_reaches_prompts_longer_than_a_kv_block(tmp_path: Path, reset: bool, tied: bool) -> None:
    """Greedy completions of 48-token prompts after the engine took another model's weights equal
    transformers' on those weights; without emptying the prefix cache after the push they do not (the
    prompts' first block would keep the old weights' keys and values). A model whose LM head is its input
    embedding (tied) gets its head too: the engine's log-probabilities of its samples are the trained
    weights' (before the fix its CPU head kept the first weights: 0.14-0.27 nats apart in a run)."""
    command = [sys.executable, str(PUSH), str(tmp_path)] + ([] if reset else ["--no-reset"])
    done = subprocess.run(
        command + (["--tied"] if tied else []), capture_output=True, text=True, timeout=300, env=child_env()
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Failed to load weights" not in done.stderr  # vLLM's warning for a layer that took no weight
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["before"] == result["expected_before"]  # the engine started from the training weights
    if not tied:  # a random tied model repeats its last token whatever its weights
        assert result["after"] != result["before"]
    assert (result["after"] == result["expected_after"]) is reset
    if reset:
        assert result["logp_gap"] < 1e-4, result["logp_gap"]


def test_a_tied_model_samples_from_its_trained_head_in_the_engine_and_thevllm_server(
    runs: dict[str, Any], tmp_path: Path
) -> None:
    """GRPO on a tied model: at every step the engine's log-probabilities of its samples are the trainer's
    (under 1e-3), colocated and through ``posttrain vllm-serve``, and both draw the same completions."""
    import yaml

    from posttrain.tiny_model import write_tiny_model

    model = write_tiny_model(
        tmp_path / "tied", seed=0, hidden_size=64, layers=2, vocab_size=1024, heads=2, tied=True
    )
    config = copy.deepcopy(runs["config"])
    config["model"]["name_or_path"] = str(model)
    config["data"].pop("eval_sources")
    config.pop("eval_interval")
    config.update(train_iters=3, logger={"output_dir": str(tmp_path / "colocated")})
    done = cli(config, tmp_path / "colocated.yaml")
    assert done.returncode == 0, done.stderr[-3000:]
    colocated = last_metrics(tmp_path / "colocated")
    port = free_port()
    served_config = copy.deepcopy(config)
    served_config.update(
        vllm_mode="server", vllm_server_host="127.0.0.1", vllm_server_port=port,
        logger={"output_dir": str(tmp_path / "served")},
    )  # fmt: skip
    path = tmp_path / "served.yaml"
    path.write_text(yaml.safe_dump(served_config))
    with vllm_server(path, tmp_path / "server.log", port):
        done = cli(served_config, path)
    assert done.returncode == 0, done.stderr[-3000:]
    served = last_metrics(tmp_path / "served")
    for step in range(1, 4):
        for records in (colocated, served):
            assert records[step]["sampling/sampling_logp_difference/max"] < 1e-3, records[step]
        assert served[step]["reward"] == colocated[step]["reward"], step


def test_two_processes_draw_and_learn_as_one(runs: dict[str, Any], tmp_path: Path) -> None:
    """Per-request seeds are the completions' keys: two engines (one per process) draw what one draws for the
    same slots, so the records of the same global batch on two processes are the one-process run's."""
    config = copy.deepcopy(runs["config"])
    config.update(
        gradient_accumulation_steps=1, train_iters=TOTAL, logger={"output_dir": str(tmp_path / "two")}
    )
    done = cli(config, tmp_path / "two.yaml", nproc=2, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    two, one = last_metrics(tmp_path / "two"), runs["reference_metrics"]
    for step in range(1, TOTAL + 1):
        assert two[step]["reward"] == pytest.approx(one[step]["reward"], abs=1e-12), step
        assert two[step]["loss"] == pytest.approx(one[step]["loss"], abs=1e-6), step


def test_lora_under_zero3_reaches_the_engine_and_the_server_as_the_adapter_alone(
    runs: dict[str, Any], tmp_path: Path
) -> None:
    """A LoRA run under ZeRO-3 pushes its gathered adapter alone through vLLM's LoRA loading (colocated, and to
    a server started for the config), or merged into the weights (``vllm_push_adapter: false``): either way the
    engine's log-probabilities of its own samples stay the trainer's while the adapters learn; the server gives
    the colocated engine's rewards."""
    import yaml

    config = copy.deepcopy(runs["config"])
    config["model"]["peft_config"] = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}
    config.update(deepspeed={"zero_optimization": {"stage": 3}}, optimizer={"lr": 1e-2}, train_iters=4)
    found, said = {}, {}
    for name, changes in (("adapter", {}), ("merged", {"vllm_push_adapter": False})):
        done = cli(
            {**config, **changes, "logger": {"output_dir": str(tmp_path / name)}}, tmp_path / f"{name}.yaml"
        )
        assert done.returncode == 0, done.stderr[-3000:]
        found[name], said[name] = last_metrics(tmp_path / name), done.stdout + done.stderr
        for step in range(1, 5):
            assert found[name][step]["sampling/sampling_logp_difference/max"] < 1e-4, (
                name,
                found[name][step],
            )
    assert "the LoRA adapter alone pushed after each update" in said["adapter"]
    assert "pushed merged into the base (vllm_push_adapter: false)" in said["merged"]
    assert found["adapter"][1]["reward"] == found["merged"][1]["reward"]  # the same weights before any update
    port = free_port()
    served = {**config, "vllm_mode": "server", "vllm_server_base_url": f"http://127.0.0.1:{port}"}
    served["logger"] = {"output_dir": str(tmp_path / "served")}
    path = tmp_path / "served.yaml"
    path.write_text(yaml.safe_dump(served))
    with vllm_server(path, tmp_path / "server.log", port):
        done = cli(served, path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--enable-lora" in (tmp_path / "server.log").read_text()
    records = last_metrics(tmp_path / "served")
    for step in range(1, 5):
        assert records[step]["reward"] == found["adapter"][step]["reward"], step
        assert records[step]["sampling/sampling_logp_difference/max"] < 1e-4, records[step]


def test_heads_the_cpu_build_cannot_run_are_refused_in_one_line(runs: dict[str, Any], tmp_path: Path) -> None:
    from posttrain.tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path / "model", seed=0, hidden_size=64, layers=2, vocab_size=1024, heads=4)
    config = copy.deepcopy(runs["config"])
    config["model"]["name_or_path"] = str(model)
    config.update(train_iters=1, logger={"output_dir": str(tmp_path / "run")})
    done = cli(config, tmp_path / "heads.yaml")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "attention heads of 16 dimensions: vLLM's CPU build runs heads of 32, 64" in done.stderr


def test_server_mode_generates_what_the_colocated_engine_does(runs: dict[str, Any], tmp_path: Path) -> None:
    """``posttrain vllm-serve`` for the config, the run on localhost: the weights reloaded through the server's
    endpoints after every update give the colocated run's rewards and losses; a server that is not there or
    serves another model stops the run in one line."""
    port = free_port()
    config = copy.deepcopy(runs["config"])
    config.update(
        vllm_mode="server",
        vllm_server_host="127.0.0.1",
        vllm_server_port=port,
        train_iters=TOTAL,
        logger={"output_dir": str(tmp_path / "served")},
    )
    path = tmp_path / "served.yaml"
    import yaml

    path.write_text(yaml.safe_dump(config))
    with vllm_server(path, tmp_path / "server.log", port):
        done = cli(config, path)
        assert done.returncode == 0, done.stderr[-3000:]
        served, one = last_metrics(tmp_path / "served"), runs["reference_metrics"]
        for step in range(1, TOTAL + 1):
            assert served[step]["reward"] == one[step]["reward"], step
            assert served[step]["loss"] == pytest.approx(one[step]["loss"], abs=1e-6), step
            assert served[step].get("eval_reward") == one[step].get("eval_reward"), step
        other = copy.deepcopy(config)
        other["model"]["name_or_path"] = str(runs["root"] / "reference" / "export" / "final")
        refused = cli(other, tmp_path / "other.yaml")
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
        assert f"serves {config['model']['name_or_path']}, not the run's model.name_or_path" in refused.stderr
    config.update(vllm_server_port=free_port(), vllm_server_timeout=2)
    absent = cli(config, tmp_path / "absent.yaml")
    assert absent.returncode == 2 and "no vLLM server answered" in absent.stderr, absent.stderr[-3000:]


def test_distillation_samples_through_the_engine(runs: dict[str, Any], tmp_path: Path) -> None:
    """distill's student completions come from the same colocated engine (the shared online feed): the run
    trains on them and says what the engine picked."""
    from posttrain.tiny_model import write_tiny_model

    teacher = write_tiny_model(
        tmp_path / "teacher", seed=0, hidden_size=128, layers=3, vocab_size=1024, heads=4
    )
    config = copy.deepcopy(runs["config"])
    for key in ("rewards", "num_generations", "eval_interval"):
        config.pop(key)
    config["data"].pop("eval_sources")
    config.update(
        type="distill",
        teacher_model_name_or_path=str(teacher),
        beta=0.5,
        train_iters=4,
        optimizer={"lr": 1e-2},
        logger={"output_dir": str(tmp_path / "distill")},
    )
    done = cli(config, tmp_path / "distill.yaml")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "vLLM on the CPU: eager, in this process" in done.stdout + done.stderr
    records = last_metrics(tmp_path / "distill")
    for step in range(1, 5):
        record = records[step]
        assert 0 < record["loss"] < 10 and record["teacher_entropy"] > 0, record
        assert record["completions/mean_length"] > 0 and record["time_generation"] > 0, record


def test_tool_rollouts_through_the_engine(tmp_path: Path) -> None:
    """Multi-turn rollouts with a tool generate every turn through the colocated engine: the tool runs, its
    tokens stay out of the loss and of TRL's correction (the engine's and the trainer's log-probabilities of
    the model's tokens agree); so do an agent's own loop's calls (``agent_function``)."""
    from posttrain.tiny_model import write_tiny_model
    from tests.agent_helpers import agent_config, teach_tool_calls, tool_prompts

    base = write_tiny_model(tmp_path / "model", seed=0, hidden_size=64, layers=2, vocab_size=1024, heads=2)
    model = teach_tool_calls(base, tmp_path)
    config = agent_config(model, tool_prompts(tmp_path), tmp_path / "run", train_iters=3, use_vllm=True)
    done = cli(config, tmp_path / "tools.yaml")
    assert done.returncode == 0, done.stderr[-3000:]
    records = last_metrics(tmp_path / "run")
    assert any(records[step]["tools/call_frequency"] > 0 for step in (1, 2, 3)), records
    for step in (1, 2, 3):
        assert records[step]["sampling/sampling_logp_difference/max"] < 1e-4, records[step]
    lines = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert any(m["role"] == "tool" for line in lines for m in line["messages"])
    # an agent that owns its loop, its calls through the same colocated engine: the engine's log-probabilities
    # of the sampled tokens are the trainer's, what the agent added between its calls left out
    from tests.agent_endpoint_helpers import write_agent

    files = write_agent(tmp_path)
    config.update(
        agent_function=files["agent_function"],
        rewards=[files["reward"]],
        tools=[],
        environment_factory=None,
        max_completion_length=48,
        logger={"output_dir": str(tmp_path / "agent")},
    )
    done = cli(config, tmp_path / "agent.yaml")
    assert done.returncode == 0, done.stderr[-3000:]
    records = last_metrics(tmp_path / "agent")
    for step in (1, 2, 3):
        assert records[step]["agent/calls"] == 2 and records[step]["agent/crashed"] == 0, records[step]
        assert records[step]["sampling/sampling_logp_difference/max"] < 1e-4, records[step]


#: a generation task whose score moves with every character generated (chrF against the prompt's own text,
#: which even a random model's output shares some characters with)
CHRF_TASK = """
task: reverse_chrf
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt[0].content}}}}"
doc_to_target: "{{{{prompt[0].content}}}}"
generation_kwargs:
  until: ["\\n"]
  do_sample: false
  max_gen_toks: 8
metric_list:
  - {{metric: chrf, aggregation: chrf, higher_is_better: true}}
metadata:
  version: 1.0
"""


def test_harness_tasks_during_training_generate_through_the_runs_engine(
    runs: dict[str, Any], tmp_path: Path
) -> None:
    """A ``harness:`` generation task in a run with vLLM goes through the run's engine (given the current
    weights first) and scores what transformers' generate scores on the run's export."""
    pytest.importorskip("lm_eval")
    data = Path(__file__).resolve().parents[2] / "examples" / "data" / "reverse-prompts-eval.jsonl"
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "reverse_chrf.yaml").write_text(CHRF_TASK.format(data=data))
    config = copy.deepcopy(runs["config"])
    harness = {
        "tasks": ["reverse_chrf"],
        "include_path": str(tmp_path / "tasks"),
        "limit": 8,
        "batch_size": 4,
    }
    export = {"type": "huggingface", "output_dir": str(tmp_path / "export"), "save_end_of_training": True}
    config.update(
        train_iters=2, harness=harness, checkpoint=[export], logger={"output_dir": str(tmp_path / "run")}
    )
    done = cli(config, tmp_path / "harness.yaml")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (
        "reverse_chrf at the end, on rank 0, generating through the run's vLLM engine"
        in done.stdout + done.stderr
    )
    during = last_metrics(tmp_path / "run")[2]["eval/reverse_chrf/chrf"]
    final = next((tmp_path / "export").glob("*"))
    command = [sys.executable, "-m", "posttrain", "eval", str(final), "--tasks", "reverse_chrf"]
    command += ["--include-path", str(tmp_path / "tasks"), "--limit", "8", "--batch-size", "4", "--json"]
    evaluated = subprocess.run(command, capture_output=True, text=True, timeout=300, env=child_env())
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert 0 < during == json.loads(evaluated.stdout)["results"]["reverse_chrf"]["chrf,none"]
