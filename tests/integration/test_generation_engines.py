"""The engine contract (``generation.types.GenerationEngine``, ``generation.engine.EngineCopy``): an engine
of the user's own is one file, registered in ``registry.GENERATION_ENGINES`` by the run's ``code:`` module
and picked by ``generation_engine``; grpo runs on it with no other change. The one here keeps its own copy of
the weights (as vLLM or SGLang would) and samples with transformers' keyed draw from it: given the training
weights at every push, it generates what transformers on the training weights does, so the run's records
are the plain run's."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.grpo_helpers import DIGITS, grpo_config, write_prompts
from tests.integration.helpers import metrics, train

pytestmark = pytest.mark.integration

ENGINE = '''
import copy
from pathlib import Path

from posttrain.config.online import OnlineTrainerConfig
from posttrain.generation.engine import EngineCopy
from posttrain.generation.transformers_engine import TransformersEngine
from posttrain.models.token_logps import unwrap
from posttrain.registry import GENERATION_ENGINES

PUSHES = Path(__file__).with_name("pushes.txt")


class CopyEngine(EngineCopy):
    """Weights of its own: a copy of the model, given the training weights at each push."""

    name = "copy"

    def __init__(self, inputs):
        self.copy = copy.deepcopy(unwrap(inputs.module)).eval()
        self.sampler = TransformersEngine(inputs.stops, inputs.pad_id)

    def push(self, module):
        self.copy.load_state_dict(unwrap(module).state_dict())
        self.stale = False
        with PUSHES.open("a") as out:
            out.write("push\\n")

    def sample(self, prompts, sampling, keys, logprobs):
        return self.sampler.generate(self.copy, prompts, sampling, keys)

    def close(self):
        pass


GENERATION_ENGINES.add(
    "copy", lambda config, inputs: CopyEngine(inputs), config=OnlineTrainerConfig, replace=True
)
'''


def test_an_engine_of_ones_own_is_one_file_and_one_registry_entry(base_config: dict, tmp_path: Path) -> None:
    (tmp_path / "digits.py").write_text(DIGITS)
    (tmp_path / "engine.py").write_text(ENGINE)
    files = {"train": write_prompts(tmp_path / "train.jsonl", 64), "reward": tmp_path / "digits.py"}
    plain = grpo_config(base_config, files, train_iters=3, logger={"output_dir": str(tmp_path / "plain")})
    own = grpo_config(
        base_config,
        files,
        train_iters=3,
        code=str(tmp_path / "engine.py"),
        generation_engine="copy",
        logger={"output_dir": str(tmp_path / "own")},
    )
    train(plain)
    train(own)
    expected, got = ([r for r in metrics(config) if "reward" in r] for config in (plain, own))
    assert len(got) == 3
    for one, other in zip(expected, got, strict=True):
        assert other["reward"] == one["reward"] and other["loss"] == pytest.approx(one["loss"], abs=1e-7)
    # pushed before each generation after an update: the first batch's and each of the next two
    assert (tmp_path / "pushes.txt").read_text().split() == ["push"] * 3


def test_generation_engine_names_a_registered_engine(base_config: dict, tmp_path: Path) -> None:
    from posttrain.config import load_config
    from posttrain.config.errors import ConfigError

    (tmp_path / "digits.py").write_text(DIGITS)
    files = {"train": write_prompts(tmp_path / "train.jsonl", 8), "reward": tmp_path / "digits.py"}
    for name, said in (
        ("sglang", "'sglang' is not a registered generation engine"),
        ("vllm", "'vllm' is a built-in engine, picked by use_vllm and vllm_mode"),
    ):
        with pytest.raises(ConfigError, match=said):
            load_config(data=grpo_config(base_config, files, generation_engine=name))
