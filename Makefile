# The whole set-up: `make demo` runs the main job, `make test` runs the tests.
# Each creates or updates the local virtual environment (.venv) by itself.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test venv clean

venv: $(STAMP)

# torch==2.13.0 is installed first: on these machines it resolves to a local CPU build,
# so a fresh machine never downloads a multi-GB CUDA build for the unpinned range.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m musespark.kernels
	touch $(STAMP)

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest

# The main job: stream a completion from the bundled model.
demo: $(STAMP)
	$(VENV)/bin/musespark generate --max-tokens 64 "def fibonacci(n):"


clean:
	rm -rf $(VENV) build src/*.egg-info
