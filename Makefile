# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Each creates .venv if absent and installs the project (with its dev extra) first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.bayesfl-installed

.PHONY: demo test lint bench

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# laplace-torch needs torchvision; this pair loads together on the CPU machines we run on.
	$(PY) -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install -q -e '.[dev,flower]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m bayesfl.demo

# Two pytest workers (pytest-xdist): the Flower deployments and notebook kernels wait on
# other processes much of the time, and the CPU-bound tests take one core each.
test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n 2 --dist worksteal

lint: $(STAMP)
	$(PY) -m ruff check .

bench: $(STAMP)
	for b in bench/*.py; do $(PY) $$b || exit 1; done
