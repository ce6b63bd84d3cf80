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

Pages in ``REPASTABLE`` are pages a reader pastes runs from, again and again: each of their
blocks must also work a second time in the same folder, where a block that writes a fixed run
directory (``out=``) is refused unless it says ``force``/``resume`` (issue 43). The page runs
once, and every run directory its blocks claim is recorded (``repaste/sitecustomize.py``, in
every Python process the page starts: ``bayesfl`` commands and Flower's ServerApp too); the
test then proves the second paste would pass (`first_claims_that_a_second_paste_refuses`).
It ran the blocks twice until the second pass cost as much as the first (one to three minutes
a page on the 2-core machine) for what this check proves from the first.

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

# Pages whose blocks must work pasted a second time in the same folder (module docstring): the
# pages a reader pastes runs from (each writes its run folders with force / --force, or a fresh
# folder).
REPASTABLE = {"docs/getting-started.md", "README.md", "docs/cli.md", "docs/flower.md",
              "docs/shifts.md", "docs/strategies/fedsi.md"}
# the recorder of run-directory claims (a sitecustomize, first on the page's PYTHONPATH)
REPASTE_HOOK = Path(__file__).resolve().parent / "repaste"
# a block that certainly claims a run directory: the recorder must have seen it
CLAIMS_A_RUN_DIR = re.compile(r"\bbayesfl (run|flower)\b|\bsimulate\([^)]*\bout=")

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
    os.environ["BAYESFL_DOCS_BLOCK"] = str(b["line"])  # for the run-directory recorder
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
    """Run the page's blocks in ``workdir/page``; every run directory they claim is recorded in
    ``workdir/run_dirs.jsonl`` (`read_claims`), and their temporary folders (``mkdtemp``,
    ``mktemp -d``) are made in ``workdir/tmp``."""
    blocks = [b for b in page_blocks(page) if runnable(b) and b.marker != "not-run"]
    (workdir / "blocks.json").write_text(json.dumps([asdict(b) for b in blocks]))
    (workdir / "driver.py").write_text(DRIVER)
    cwd = workdir / "page"
    cwd.mkdir()
    (workdir / "tmp").mkdir()
    env = dict(os.environ, MPLBACKEND="Agg", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHONPATH=os.pathsep.join([str(REPASTE_HOOK), str(ROOT),
                                           os.environ.get("PYTHONPATH", "")]),
               TMPDIR=str(workdir / "tmp"), BAYESFL_DOCS_RUN_DIRS=str(workdir / "run_dirs.jsonl"))
    done = subprocess.run([sys.executable, str(workdir / "driver.py"), str(workdir / "blocks.json"),
                           str(workdir / "results.json")], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=PAGE_TIMEOUT_S)
    assert done.returncode == 0, f"the block driver crashed:\n{done.stderr[-3000:]}"
    return blocks, json.loads((workdir / "results.json").read_text())


def read_claims(workdir: Path) -> list[dict]:
    """The run directories the page's blocks claimed, in order: one dict per call of
    ``prepare_run_directory`` (block line, real path, resume, force, and the path's state
    before: ``absent``, ``empty`` or ``holds files``)."""
    log = workdir / "run_dirs.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def first_claims_that_a_second_paste_refuses(claims: list[dict], tmpdir: Path) -> list[dict]:
    """The claims that would fail if the page's blocks ran again in the same folder.

    Pasted again, the blocks do what they did the first time, except that the folder holds
    what the first paste left; a run directory's state matters to its first claim only. A
    first claim that passes ``force`` (the run files are deleted: the directory is then as it
    was the first time, up to files no run reads) or claims a new temporary folder (an empty
    directory in ``tmpdir``, named anew by ``mkdtemp`` / ``mktemp -d`` each time) meets the
    directory as it did the first time, and so does every later claim of that directory (its
    ``resume`` continues the same run). Any other first claim meets the run the first paste
    left there and is refused, or resumes it instead of starting it. These are returned.
    """
    seen, refused = set(), []
    for claim in claims:
        if claim["path"] in seen:
            continue
        seen.add(claim["path"])
        fresh = claim["state"] == "empty" and Path(claim["path"]).parent == tmpdir.resolve()
        if not (claim["force"] or fresh):
            refused.append(claim)
    return refused


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
        pytest.fail(f"{rel}, block at line {failures[0]['line']} failed:\n{failures[0]['error']}")
    assert len(results) == len(blocks), f"{rel}: only {len(results)} of {len(blocks)} blocks ran"
    if rel in REPASTABLE:
        claims = read_claims(tmp_path)
        unseen = [b.line for b in blocks if CLAIMS_A_RUN_DIR.search(b.source)
                  and not any(c["block"] == str(b.line) for c in claims)]
        assert not unseen, f"{rel}: no run directory recorded for the block(s) at line(s) " \
                           f"{unseen}: the recorder ({REPASTE_HOOK.name}/) did not reach them"
        refused = first_claims_that_a_second_paste_refuses(claims, tmp_path / "tmp")
        assert not refused, f"{rel}: pasted a second time, these blocks would meet the run " \
            "the first paste left in their run directory (pass force / --force, or write a " \
            "new temporary folder):\n" + "\n".join(
                f"  block at line {c['block']}: {c['path']} (resume={c['resume']})"
                for c in refused)
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


def test_a_second_paste_is_refused_unless_the_first_claim_forces_or_is_a_new_temp_folder(
        tmp_path):
    """The rule that stands in for running a page's blocks twice: only the first claim of each
    run directory decides (a later ``resume`` continues what the same paste started)."""
    temp = tmp_path / "tmp"

    def claim(path, state, *, resume=False, force=False, block="9"):
        return {"block": block, "path": str(path), "resume": resume, "force": force,
                "state": state}

    fixed, forced, fresh = tmp_path / "page/runs/a", tmp_path / "page/runs/b", temp / "run-x1"
    claims = [claim(fixed, "absent"),                       # out="runs/a": refused next time
              claim(forced, "absent", force=True),          # --force: starts again
              claim(forced, "holds files", resume=True),    # then --resume: the same run
              claim(fixed, "holds files", force=True),      # too late: runs/a was refused
              claim(fresh, "empty"),                        # mkdtemp(): a new folder each time
              claim(temp / "x" / "y", "empty"),             # not a new folder of mkdtemp
              claim(tmp_path / "page/runs/c", "empty"),     # an empty folder of the page
              claim(tmp_path / "page/runs/d", "absent", resume=True)]  # resumes the 1st paste
    refused = first_claims_that_a_second_paste_refuses(claims, temp)
    assert [c["path"] for c in refused] == [str(fixed), str(temp / "x" / "y"),
                                            str(tmp_path / "page/runs/c"),
                                            str(tmp_path / "page/runs/d")]
