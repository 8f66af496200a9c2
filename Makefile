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

.PHONY: setup train test data clean constraints

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_PIP_ARGS) torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

data: $(STAMP)
	$(BIN)/python examples/make_data.py

train: $(STAMP)
	$(BIN)/python examples/quickstart.py $(RECIPE)

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=25 $(PYTEST_ARGS)

# After a deliberate upgrade in .venv: record the versions for the next setup (and CI) to use.
constraints: $(STAMP)
	{ sed -n '1,3p' constraints.txt; $(BIN)/python -m pip freeze --exclude-editable | grep -v '^torch=='; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

clean:
	rm -rf runs .pytest_cache
