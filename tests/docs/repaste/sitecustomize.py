"""Records every run directory a docs page's block opens (tests/docs/test_code_blocks.py).

Python imports ``sitecustomize`` at start-up from the first folder on ``sys.path`` that holds
one; the docs test puts this folder first on ``PYTHONPATH`` for a page's block driver, so every
Python process the page starts (the driver, ``bayesfl`` commands, Flower's ``flwr-serverapp``
under a ``bayesfl flower`` command) loads it. With ``BAYESFL_DOCS_RUN_DIRS`` set, it wraps
`bayesfl.run_directory.prepare_run_directory` (through which every run, simulated or on
Flower, claims its directory, and which refuses a directory that holds a run unless resume or
force is given) so that each call appends one JSON line to that file first: the block (page
line, ``BAYESFL_DOCS_BLOCK``), the path, ``resume``, ``force`` and what the path was before
(absent, an empty directory, or a directory that holds files). Then it runs the sitecustomize
it shadows, if any.
"""

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys

_LOG = os.environ.get("BAYESFL_DOCS_RUN_DIRS")
_NAME = "bayesfl.run_directory"


def _wrap(module):
    original = module.prepare_run_directory

    def prepare_run_directory(path, *, resume, force):
        p = os.path.realpath(os.fspath(path))
        state = ("absent" if not os.path.lexists(p) else
                 "empty" if os.path.isdir(p) and not os.listdir(p) else "holds files")
        line = json.dumps({"block": os.environ.get("BAYESFL_DOCS_BLOCK"), "path": p,
                           "resume": resume, "force": force, "state": state})
        with open(_LOG, "a", encoding="utf-8") as f:  # one short append: whole lines
            f.write(line + "\n")
        return original(path, resume=resume, force=force)

    prepare_run_directory.__doc__ = original.__doc__
    module.prepare_run_directory = prepare_run_directory


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _NAME:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module):
            exec_module(module)
            _wrap(module)  # before any importer binds the name (from ... import)

        spec.loader.exec_module = exec_and_wrap
        return spec


if _LOG:
    sys.meta_path.insert(0, _Finder())

# the sitecustomize this one shadows (a system one, e.g. Debian's), run as it would have been
_HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _HERE])
if _spec is not None and _spec.loader is not None:
    # as site.py does: a broken sitecustomize does not stop Python
    with contextlib.suppress(Exception):
        _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
