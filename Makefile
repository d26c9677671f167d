# One obvious command per action. Every target creates .venv and installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-fast lint interop bench bench-smoke bench-instructions compose-test clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/mcp-broker serve --demo

test: $(STAMP)
	@echo "make test: the whole suite, about 12 minutes on two cores (make test-fast: about 40 s)"
	$(BIN)/pytest -q

# The tests that start no process and no server (markers set by tests/tiers.py): the loop while editing.
test-fast: $(STAMP)
	$(BIN)/pytest -q -m "not process and not redis"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

interop: $(STAMP)
	./interop/run.sh

bench: $(STAMP)
	$(BIN)/python -m bench.run --full

bench-smoke: $(STAMP)
	$(BIN)/python -m bench.run --smoke

# Instructions per delivered frame (callgrind), memory and Redis: deterministic, one run each.
bench-instructions: $(STAMP)
	$(BIN)/python -m bench.instructions

# The compose stack for real (Docker, root): see deploy/compose/README.md.
compose-test: $(STAMP)
	./deploy/compose/test.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
