# KunServe developer entry points. `make demo` and `make test` are the two README commands:
# each creates the virtual environment and installs the project first when needed.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kunserve-installed
PYTEST_ARGS ?=

.PHONY: setup demo up test lint protos bench clean

$(STAMP): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "KunServe needs Python >= 3.11")'
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev]"
	@touch $(STAMP)

setup: $(STAMP)

## Start the local cluster (embedded tiny model, 2 workers), stream one generation, serve until Ctrl-C.
demo: $(STAMP)
	$(BIN)/kunserve up --demo

up: $(STAMP)
	$(BIN)/kunserve up

## The whole test suite (what CI runs): the lint and type gates, then every test.
test: lint
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

## ruff (style, likely bugs, import order) and mypy (strict on shared/policy/, normal elsewhere).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python scripts/typecheck.py

protos: $(STAMP)
	$(BIN)/python scripts/gen_protos.py

bench: $(STAMP)
	$(BIN)/python bench/engine.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .mypy_cache .ruff_cache build *.egg-info

## Containers for real (not part of `make test`): build the images, compose up, stream a generation and check
## it against the reference engine, compose down. Needs Docker, or root to start a private dockerd.
.PHONY: compose-test
compose-test: $(STAMP)
	$(BIN)/python scripts/compose_test.py
