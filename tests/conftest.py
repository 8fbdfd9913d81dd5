"""Shared fixtures: the tiny model and tokenizer are built once per test session, never downloaded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from posttrain.testing.data import chat_rows, write_jsonl

# DeepSpeed's accelerator follows the machine, so `pytest -m gpu tests/gpu` runs as is on a GPU machine.
os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Under pytest-xdist (make test: one worker per core) each worker and the runs it starts take one thread:
# two workers of two threads each on two cores would wait on one another at every operator.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    # each worker (and what it starts) hands out ports of its own, below the system's ephemeral ones: a port a
    # test chose for a server still starting is never one the other worker's engines or servers take
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    if 20000 + 1500 * (worker + 1) <= 32768:  # Linux's ephemeral ports start at 32768
        os.environ.setdefault("POSTTRAIN_PORT_RANGE", f"{20000 + 1500 * worker}-{21499 + 1500 * worker}")
    # make test-vllm: each worker, and the runs and engines it starts, on cores of its own (an engine binds its
    # OpenMP threads to the cores its process may use; two engines spinning on the same cores would crawl)
    if os.environ.get("POSTTRAIN_TEST_PIN_WORKERS") == "1" and hasattr(os, "sched_setaffinity"):
        from posttrain.testing.env import worker_cores

        os.sched_setaffinity(0, worker_cores())


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from posttrain.tiny_model import write_tiny_model

    return write_tiny_model(
        tmp_path_factory.mktemp("tiny") / "model", seed=0, hidden_size=64, layers=2, vocab_size=1024
    )


@pytest.fixture(scope="session")
def tiny_moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny mixture-of-experts models (8 experts, 2 per token), one per architecture, written on first use."""
    from posttrain.tiny_model import ARCHITECTURES, write_tiny_model

    root = tmp_path_factory.mktemp("tiny-moe")
    return {
        arch: write_tiny_model(root / arch, seed=0, hidden_size=64, layers=2, vocab_size=1024, arch=arch)
        for arch in ARCHITECTURES
        if arch != "llama"
    }


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path):  # -> PreTrainedTokenizerFast
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def chat_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("data") / "chat.jsonl", chat_rows(64))


@pytest.fixture
def base_config(tiny_model_dir: Path, chat_file: Path, tmp_path: Path) -> dict:
    """A small, fast SFT config dict writing everything under tmp_path."""
    return make_base_config(tiny_model_dir, chat_file, tmp_path)


def make_base_config(tiny_model_dir: Path, chat_file: Path, tmp_path: Path) -> dict:
    """``base_config`` for fixtures of a wider scope (a module's shared run)."""
    return {
        "type": "sft",
        "model": {
            "name_or_path": str(tiny_model_dir),
            "dtype": "float32",
            "disable_activation_checkpoint": True,
        },
        "data": {"sources": [str(chat_file)], "max_length": 64, "dl_num_workers": 0},
        "micro_batch_size": 4,
        "optimizer": {"lr": 1e-3},
        "scheduler": {"name": "constant", "warmup_ratio": 0},
        "logger": {"output_dir": str(tmp_path / "run")},
        "loss_log_interval": 0,
    }


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``gpu`` tests skip cleanly on machines without CUDA, ``vllm`` tests where vLLM is not installed (its
    CPU build runs them: ``make test-vllm``), ``torchvision`` tests where torchvision does not import (the
    vision tier's venv has it: ``make test-vision``)."""
    import importlib.util

    from posttrain.vision.tiny import torchvision_missing

    skips = {
        "gpu": None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA GPU"),
        "vllm": None
        if importlib.util.find_spec("vllm") is not None
        else pytest.mark.skip(reason="needs vLLM (make test-vllm installs its CPU build)"),
        "torchvision": None
        if (missing := torchvision_missing()) is None
        else pytest.mark.skip(reason=f"needs torchvision ({missing}; make test-vision)"),
    }
    for item in items:
        for marker, skip in skips.items():
            if skip is not None and marker in item.keywords:
                item.add_marker(skip)
        if (group := _shared_set_up(item)) is not None:
            item.add_marker(pytest.mark.xdist_group(group))


def _shared_set_up(item: pytest.Item) -> str | None:
    """The module whose set-up ``item`` shares with other tests (a fixture of module or class scope: a
    training run, a server), so that pytest-xdist's ``--dist loadgroup`` gives that module's tests to one
    worker and the set-up is made once; None for a test that shares nothing, which goes to any worker."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None or item.get_closest_marker("xdist_group") is not None:  # a group of its own already
        return None
    shared = any(
        definitions and definitions[-1].scope in ("module", "class", "package")
        for definitions in info.name2fixturedefs.values()
    )
    return item.nodeid.split("::", 1)[0] if shared else None


# the suite's guard on its own time: its hooks (tests/suite_time.py)
from tests.suite_time import pytest_runtest_logreport, pytest_sessionfinish  # noqa: E402, F401
