"""Import a user's object named ``package.module:attribute`` (a body factory, a data loader).

The spelling is the one uvicorn and setuptools entry points use. Only modules importable from the
running interpreter's ``sys.path`` are loaded — the user's own installed or local code, named by
the user on the command line or in a config file they wrote; nothing is fetched or unpickled.
"""

from __future__ import annotations

import importlib
import os
import re
import sys

from bayesfl.errors import ConfigError

_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def is_import_spec(text: str) -> bool:
    """True when ``text`` has the ``package.module:attribute`` shape (one colon, dotted names)."""
    return bool(_SPEC.match(text))


def import_object(spec: str, what: str) -> object:
    """Return the object ``spec`` (``"package.module:attribute"``) names.

    ``what`` says in errors what the object is for (e.g. ``"body factory"``). Raises
    `ConfigError` with the reason when the spelling is wrong, the module
    cannot be imported or it has no such attribute.
    """
    if not isinstance(spec, str) or not is_import_spec(spec):
        raise ConfigError(
            f"{what} {spec!r} is not of the form 'package.module:attribute' "
            "(e.g. 'mypackage.models:make_body')"
        )
    module_name, attribute = spec.split(":")
    try:
        module = _import_module(module_name)
    except ImportError as error:
        raise ConfigError(
            f"{what} {spec!r}: cannot import module {module_name!r} ({error}); "
            "install it or run from the folder that contains it"
        ) from error
    target: object = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ConfigError(
                f"{what} {spec!r}: module {module_name!r} has no attribute {attribute!r}"
            )
        target = getattr(target, part)
    return target


def _import_module(name: str) -> object:
    """Import ``name``; if its top package is not found, once more with the working directory
    on ``sys.path`` (appended: installed packages keep precedence). A console script such as
    ``bayesfl`` runs without the working directory on its path, so "run from the folder that
    contains it" needs this, as uvicorn's ``--app-dir .`` does."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        cwd = os.getcwd()
        if error.name != name.split(".")[0] or cwd in sys.path or "" in sys.path:
            raise
        sys.path.append(cwd)
        return importlib.import_module(name)
