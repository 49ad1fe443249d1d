# The whole set-up: `make demo` runs the main job, `make test` runs the tests.
# Each creates or updates the local virtual environment (.venv) by itself.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo serve test venv clean

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

# The main job: the bundled model answers a question with a tool: its call, the demo calculator's
# result, its answer (`generate --chat --run-tools`; read_file would read inside this directory).
demo: $(STAMP)
	$(VENV)/bin/musespark generate --chat --run-tools . "What is 4817 * 23?"

# A one-command server: the bundled model on loopback (127.0.0.1:8000, OpenAI-compatible), the
# Muse reasoning and tool parsers on (the bundled chat template is the Muse one, so they are the
# default). Progress shows while the kernels build on a first run. PORT=8001 make serve to move it.
PORT ?= 8000
serve: $(STAMP)
	$(VENV)/bin/musespark serve --host 127.0.0.1 --port $(PORT)

clean:
	rm -rf $(VENV) build src/*.egg-info
