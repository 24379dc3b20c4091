# `make demo` and `make test` do all the set-up on a fresh machine: they create .venv
# when it is missing, install the project with the pins of constraints.txt (a stamp
# file makes this a no-op when nothing changed), then run.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
EXTRAS := spark,petastorm,ray,tensorflow,lightning,mlflow,mpi,notebooks,dev
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo test bench lint install clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, pinned: the CPU build on local disk (a looser spec pulls a CUDA build).
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e ".[$(EXTRAS)]"
	$(PY) -m ringcore._stackcheck
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m estimators.demo

test: $(STAMP)
	$(PY) -m pytest -p no:cacheprovider tests

bench: $(STAMP)
	$(PY) bench/collectives.py
	$(PY) bench/training.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) build *.egg-info
