"""An mkdocs hook: the example notebooks and scripts of ``examples/`` are files of the docs site.

The Examples page links each one (``[fedlog_vs_fedavg.ipynb](examples/fedlog_vs_fedavg.ipynb)``);
``examples/`` is outside ``docs_dir``, so without this the links would point nowhere and
``mkdocs build --strict`` would refuse them. The files are served as they are in the
repository (notebooks without outputs: ``make notebooks`` executes them). Loaded by
``mkdocs.yml`` (``hooks:``); tests/docs/test_site.py checks that every file is linked and
copied.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
#: what the site serves: the notebooks and the Python scripts beside them (the Flower app and
#: calibration_cli.md stay in the repository: a folder, and a page of its own format)
PATTERNS = ("*.ipynb", "*.py")


def example_files() -> list[Path]:
    """The files of ``examples/`` the site serves, sorted."""
    return sorted(p for pattern in PATTERNS for p in EXAMPLES.glob(pattern) if p.is_file())


def on_files(files: Files, config: Any) -> Files:
    """Adds each example as ``examples/<name>`` of the site (mkdocs calls this)."""
    for path in example_files():
        files.append(File.generated(config, f"examples/{path.name}", abs_src_path=str(path)))
    return files
