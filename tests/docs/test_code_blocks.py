"""Every Python and shell block of the README and of docs/ runs as written.

One test per page (each marked ``slow``: a page starts Python, imports torch and runs small
federated runs, which takes longer than 20 s on a busy 2-core machine). A page's blocks run in
page order in one fresh Python process whose working directory is a temporary folder: Python
blocks share one namespace (a later block may use what an earlier one defined, as a reader
does), shell blocks (``bash``, ``sh``, ``shell``; and the ``$ ``-prefixed lines of ``console``
blocks) run with ``bash -euo pipefail`` in the same folder, with this interpreter's ``bin``
first on ``PATH`` (so ``bayesfl`` and ``python`` are the project's). A block fails the test with
its page, line and error.

Markers, an HTML comment on the line right before a block (invisible on GitHub and the site):

- ``<!-- not-run: REASON -->``: the block is not run; the reason is required and reported
  (``-rA`` or ``test_not_run_blocks_say_why``).
- ``<!-- file: NAME -->``: the block (any language, e.g. ``toml``) is written to NAME in the
  page's folder, for the blocks after it.

Pages in ``RUN_TWICE`` run their blocks twice in a row, in the same process and folder, as a
reader who pastes a block again does: a block that writes a fixed run directory (``out=``)
fails the second time (issue 43).

``KNOWN_PENDING`` lists blocks that fail for a reason being fixed elsewhere: they run, their
failure is reported and does not fail the page, and the test fails as soon as one passes (so
the entry is removed the day it is fixed).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RUN_LANGUAGES = {"python", "py", "bash", "sh", "shell", "console"}
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
                   re.M | re.S)
MARKER = re.compile(r"<!--\s*(?P<kind>not-run|file)\s*(?::\s*(?P<arg>.*?))?\s*-->\s*$")

# (page relative to the repository root, a substring of the block): blocks that fail today for a
# reason another change is fixing. Remove the entry when the test says the block passes.
# (Empty: the last entry, docs/inference.md's combine with the default Laplace head on plain
# digits pixels, passes since the diagonal fit's fix of issue 26.)
KNOWN_PENDING: set[tuple[str, str]] = set()

# Pages whose blocks run twice in a row (module docstring): the pages a reader pastes runs
# from (each writes its run folders with force / --force, or a fresh folder).
RUN_TWICE = {"docs/getting-started.md", "README.md", "docs/cli.md", "docs/flower.md",
             "docs/shifts.md", "docs/strategies/fedsi.md"}

# A page's blocks are small by rule (1-2 rounds, a few clients); this bounds a hung one.
PAGE_TIMEOUT_S = 900


@dataclass
class Block:
    language: str
    source: str
    line: int
    marker: str | None = None  # not-run | file
    argument: str | None = None
    pending: bool = False


def page_blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page`` with their markers, in page order."""
    text = page.read_text(encoding="utf-8")
    rel = page.relative_to(ROOT).as_posix()
    blocks = []
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.search(before)
        indent = len(match.group("indent"))
        body = "\n".join(row[indent:] for row in match.group("body").splitlines()) + "\n"
        block = Block(match.group("lang").lower(), body, line,
                      marker.group("kind") if marker else None,
                      marker.group("arg") if marker else None)
        block.pending = any(rel == p and s in body for p, s in KNOWN_PENDING)
        blocks.append(block)
    return blocks


def runnable(block: Block) -> bool:
    return block.language in RUN_LANGUAGES or block.marker == "file"


DRIVER = r'''
import json, os, subprocess, sys, traceback
blocks = json.load(open(sys.argv[1]))
sys.path.insert(0, os.getcwd())  # as in an interactive session: the folder's modules import
namespace = {"__name__": "__main__"}
results = []
for b in blocks:
    where = f"line {b['line']} ({b['language']})"
    try:
        if b["marker"] == "file":
            with open(b["argument"], "w") as f:
                f.write(b["source"])
        elif b["language"] in ("python", "py"):
            exec(compile(b["source"], f"<block at line {b['line']}>", "exec"), namespace)
        else:
            lines = b["source"].splitlines()
            if b["language"] == "console":
                lines = [ln[2:] for ln in lines if ln.startswith("$ ")]
            script = "set -euo pipefail\n" + "\n".join(lines) + "\n"
            done = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"exit code {done.returncode}\n--- stdout\n"
                                   f"{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}")
        results.append({"line": b["line"], "ok": True})
    except BaseException:
        results.append({"line": b["line"], "ok": False, "error": traceback.format_exc()[-4000:]})
        if not b["pending"]:
            break
json.dump(results, open(sys.argv[2], "w"))
'''


def run_page(page: Path, workdir: Path) -> tuple[list[Block], list[dict]]:
    blocks = [b for b in page_blocks(page) if runnable(b) and b.marker != "not-run"]
    if page.relative_to(ROOT).as_posix() in RUN_TWICE:
        blocks = blocks + blocks  # pasted again: the same blocks, the same folder
    (workdir / "blocks.json").write_text(json.dumps([asdict(b) for b in blocks]))
    (workdir / "driver.py").write_text(DRIVER)
    cwd = workdir / "page"
    cwd.mkdir()
    env = dict(os.environ, MPLBACKEND="Agg", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    done = subprocess.run([sys.executable, str(workdir / "driver.py"), str(workdir / "blocks.json"),
                           str(workdir / "results.json")], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=PAGE_TIMEOUT_S)
    assert done.returncode == 0, f"the block driver crashed:\n{done.stderr[-3000:]}"
    return blocks, json.loads((workdir / "results.json").read_text())


RUN_PAGES = [p for p in PAGES if any(runnable(b) and b.marker != "not-run"
                                     for b in page_blocks(p))]


@pytest.mark.slow
@pytest.mark.parametrize("page", RUN_PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_block_of_the_page_runs(page, tmp_path):
    blocks, results = run_page(page, tmp_path)
    by_line = {b.line: b for b in blocks}
    rel = page.relative_to(ROOT).as_posix()
    failures = [r for r in results if not r["ok"] and not by_line[r["line"]].pending]
    if failures:
        again = rel in RUN_TWICE and results.index(failures[0]) >= len(blocks) // 2
        pytest.fail(f"{rel}, block at line {failures[0]['line']} failed"
                    f"{' when run a second time' if again else ''}:\n{failures[0]['error']}")
    assert len(results) == len(blocks), f"{rel}: only {len(results)} of {len(blocks)} blocks ran"
    fixed = [r["line"] for r in results if r["ok"] and by_line[r["line"]].pending]
    assert not fixed, f"{rel}: the known-pending block(s) at line(s) {fixed} now pass: " \
                      "remove them from KNOWN_PENDING"
    for r in results:
        if not r["ok"]:
            print(f"{rel}:{r['line']}: known pending, still fails:\n{r['error'][-600:]}")


def test_not_run_blocks_say_why():
    """A block left out names its reason; the list is printed (pytest -rA shows it)."""
    left_out = []
    for page in PAGES:
        for b in page_blocks(page):
            if b.marker == "not-run":
                assert b.argument, f"{page.name}:{b.line}: not-run without a reason"
                left_out.append(f"{page.relative_to(ROOT)}:{b.line}: {b.argument}")
            if b.marker == "file":
                assert b.argument and "/" not in b.argument, \
                    f"{page.name}:{b.line}: file marker needs a plain file name"
    print("\n".join(["blocks not run:", *left_out]))


def test_every_python_and_shell_block_is_run_or_says_why():
    """No unlabelled or mislabelled code: a fenced block that looks like a command or Python
    code but is not labelled as such would escape the run."""
    suspicious = re.compile(r"^(\$ )?((bayesfl|bayesfl-calibrate|python|make) |import \w|"
                            r"from \w+ import )", re.M)
    for page in PAGES:
        for b in page_blocks(page):
            if b.language in ("", "text") and suspicious.search(b.source):
                pytest.fail(f"{page.relative_to(ROOT)}:{b.line}: a command or code in a block "
                            "without a language; label it (python, bash, console) so it runs")


def test_the_collector_sees_markers_and_blocks(tmp_path):
    """The parser itself: a marker applies to the next block only, indentation is removed."""
    page = tmp_path / "page.md"
    page.write_text("text\n<!-- not-run: needs a GPU -->\n```python\nimport torch\n```\n\n"
                    "```bash\necho hi\n```\n- item\n\n  ```python\n  x = 1\n  ```\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        blocks = page_blocks(page)
    finally:
        ROOT = saved
    assert [(b.language, b.marker) for b in blocks] == [("python", "not-run"), ("bash", None),
                                                         ("python", None)]
    assert blocks[0].argument == "needs a GPU" and blocks[2].source == "x = 1\n"
