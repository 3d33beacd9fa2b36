# `make demo` and `make test` do all the set-up on a fresh machine: they create .venv when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dynpipe-installed

.PHONY: demo test test-fast typecheck lint format bench clean

$(STAMP): setup.cfg pyproject.toml requirements/cpu-constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c requirements/cpu-constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c requirements/cpu-constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/mnist_demo.py

test: $(STAMP)
	$(PY) -m pytest -q --durations=25 tests

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests

typecheck: $(STAMP)
	$(PY) -m mypy

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(STAMP)
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

bench: $(STAMP)
	$(PY) benchmarks/throughput.py

clean:
	rm -rf $(VENV) build *.egg-info
