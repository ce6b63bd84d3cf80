"""examples/calibration_cli.md shows real output: its own-model section, re-run here, prints
what the page says (numbers to 5e-4: the page was made with one scikit-learn build, a solver
update may move the last digit; words, labels and counts exactly)."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[2] / "examples" / "calibration_cli.md"
NUMBER = re.compile(r"^-?\d+\.\d+$")


def blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", PAGE.read_text(), flags=re.S)


def console_runs() -> list[tuple[str, list[str]]]:
    """(command, expected output lines) of every ``$ bayesfl-calibrate`` on the page's own
    files (the federated run's section needs its run directory and is left to the CLI tests)."""
    runs = []
    for block in blocks("console"):
        command, lines = None, []
        for line in block.splitlines():
            if line.startswith("$ "):
                if command is not None:
                    runs.append((command, lines))
                command, lines = line[2:], []
            else:
                lines.append(line)
        runs.append((command, lines))
    return [(c, out) for c, out in runs if c.startswith("bayesfl-calibrate")
            and "runs/" not in c]


def same_line(actual: str, expected: str) -> bool:
    a, e = actual.split(), expected.split()
    if len(a) != len(e):
        return False
    for x, y in zip(a, e, strict=True):
        if NUMBER.match(y):
            if not NUMBER.match(x) or abs(float(x) - float(y)) > 5e-4:
                return False
        elif x != y:
            return False
    return True


def test_the_page_shows_own_model_and_error_examples():
    commands = [c for c, _ in console_runs()]
    assert "bayesfl-calibrate my_predictions.npz" in commands
    assert any("missing.npz" in c for c in commands)


@pytest.fixture(scope="module")
def page_files(tmp_path_factory):
    """The directory where the page's Python block has written its files (run once: each
    interpreter that imports scikit-learn and torch costs seconds)."""
    where = tmp_path_factory.mktemp("page")
    subprocess.run([sys.executable, "-c", blocks("python")[0]], cwd=where, check=True)
    return where


@pytest.mark.parametrize(("command", "expected"), console_runs(), ids=lambda v: str(v)[:40])
def test_command_on_the_page_prints_what_the_page_shows(page_files, command, expected):
    args = shlex.split(command)[1:]
    done = subprocess.run([sys.executable, "-m", "calibration", *args], cwd=page_files,
                          capture_output=True, text=True, timeout=120)
    actual = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert len(actual) == len(expected), actual
    for a, e in zip(actual, expected, strict=True):
        assert same_line(a, e), f"{a!r} != {e!r}"
    assert done.returncode == (1 if "error:" in "\n".join(expected) else 0)
