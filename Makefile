# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Each creates .venv if absent and installs the project (with its dev extra) first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.bayesfl-installed

.PHONY: demo test test-trained lint bench mutation

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
# The tests run in a random order (pytest-randomly), a new one each time: the seed is printed
# first, and `make test SEED=N` repeats an order.
SEED := $(or $(SEED),$(shell od -An -N4 -tu4 /dev/urandom | tr -d ' '))
test: $(STAMP)
	$(PY) -m ruff check .
	@echo "test order: pytest-randomly seed $(SEED) ('make test SEED=$(SEED)' repeats it)"
	$(PY) -m pytest -q -n 2 --dist worksteal --randomly-seed=$(SEED)

# The tests that assert figures of trained models; .ci/run reruns them under another
# ATEN_CPU_CAPABILITY (README, Development) to catch a figure that holds on one CPU only.
test-trained: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist worksteal -m trained

lint: $(STAMP)
	$(PY) -m ruff check .

bench: $(STAMP)
	for b in bench/*.py; do $(PY) $$b || exit 1; done

# Mutation testing of one module with its covering tests (tools/mutation.py; mutmut, one worker;
# tens of minutes, so not part of `test`): make mutation MODULE=bayesfl/strategies/fedpa.py
mutation: $(STAMP)
	$(PY) tools/mutation.py $(MODULE)
