# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Each creates .venv if absent and installs the project (with its dev extra) first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.bayesfl-installed

.PHONY: demo test test-trained lint bench mutation notebooks docs

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
# first, and `make test SEED=N` repeats an order. The `slow` tests are moved to the front of
# that order (tests/conftest.py) and handed out one at a time (--dist load --maxschedchunk 1),
# so both workers start the long tests early and finish together.
SEED := $(or $(SEED),$(shell od -An -N4 -tu4 /dev/urandom | tr -d ' '))
test: $(STAMP)
	$(PY) -m ruff check .
	@echo "test order: pytest-randomly seed $(SEED) ('make test SEED=$(SEED)' repeats it)"
	$(PY) -m pytest -q -n 2 --dist load --maxschedchunk 1 --randomly-seed=$(SEED)

# `make test` also builds the docs site with `mkdocs build --strict` and runs every Python and
# shell block of the README and docs/ (tests/docs/), so a broken docstring reference fails it.

# The tests that assert figures of trained models; .ci/run reruns them under another
# ATEN_CPU_CAPABILITY (README, Development) to catch a figure that holds on one CPU only.
test-trained: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist worksteal -m trained

lint: $(STAMP)
	$(PY) -m ruff check .

bench: $(STAMP)
	for b in bench/*.py; do $(PY) $$b || exit 1; done

# Mutation testing of one module with its covering tests (tools/mutation.py; mutmut, one worker;
# tens of minutes, so not part of `test`): make mutation MODULE=bayesfl/strategies/bayes/fedpa.py
mutation: $(STAMP)
	$(PY) tools/mutation.py $(MODULE)

# Execute every notebook in examples/ headless (nbconvert, a fresh kernel each), in a copy under
# NOTEBOOKS_OUT (default: a new temporary folder), so outputs and figures never land in the
# repository; `make notebooks NOTEBOOKS_OUT=nb-out` keeps them in nb-out/. To open them
# instead: .venv/bin/jupyter lab examples/ (or jupyter notebook).
NOTEBOOKS_OUT ?=
notebooks: $(STAMP)
	@out="$(NOTEBOOKS_OUT)"; [ -n "$$out" ] || out=$$(mktemp -d); mkdir -p "$$out"; \
	cp examples/*.ipynb "$$out"/ && cd "$$out" && \
	for nb in *.ipynb; do \
	  echo "executing $$nb"; \
	  "$(CURDIR)/$(VENV)/bin/jupyter" nbconvert --to notebook --execute --inplace \
	    --ExecutePreprocessor.timeout=1200 "$$nb" || exit 1; \
	done; echo "executed notebooks (with outputs and figures/) in $$out"

# The docs site in build/site/ (`make test` builds it too); .venv/bin/mkdocs serve shows it live.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --site-dir build/site
