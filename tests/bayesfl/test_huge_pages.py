"""The ``bayesfl`` command asks PyTorch for transparent huge pages (bayesfl.cli.use_huge_pages).

The switch is PyTorch's own (``THP_MEM_ALLOC_ENABLE``, read at the first allocation): the command
sets it unless the environment already does, and a fresh process that set it this way gets
huge pages for a large tensor (read from the kernel's own
accounting, ``AnonHugePages``), where the kernel offers them at all.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bayesfl.cli import HUGE_PAGES_VARIABLE, use_huge_pages

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")

# 256 MB written once, then the kernel's count of this process's anonymous huge pages (kB)
PROBE = """
import sys
from bayesfl.cli import use_huge_pages
if sys.argv[1] == "set":
    use_huge_pages()
import torch
t = torch.ones(64 * 2**20)
rollup = open("/proc/self/smaps_rollup").read().splitlines()
print(next(int(line.split()[1]) for line in rollup if line.startswith("AnonHugePages:")))
"""


def run_probe(mode: str, env: dict[str, str]) -> int:
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                          check=True, env=env, timeout=120)
    return int(done.stdout.strip().splitlines()[-1])


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != HUGE_PAGES_VARIABLE}


@pytest.mark.parametrize(("given", "expected"), [(None, "1"), ("0", "0"), ("1", "1")])
def test_the_command_sets_the_switch_and_leaves_a_users_choice_alone(monkeypatch, given,
                                                                      expected):
    if given is None:
        monkeypatch.delenv(HUGE_PAGES_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(HUGE_PAGES_VARIABLE, given)
    use_huge_pages()
    assert os.environ[HUGE_PAGES_VARIABLE] == expected


@pytest.mark.skipif(not THP_SETTING.exists() or "[never]" in THP_SETTING.read_text()
                    or not Path("/proc/self/smaps_rollup").exists(),
                    reason="the kernel offers no transparent huge pages here")
def test_a_process_that_sets_it_gets_huge_pages_for_a_large_tensor():
    with_switch = run_probe("set", clean_env())
    # 256 MB asked for in 2 MiB pages: a fragmented machine may give fewer than 128 of them,
    # but not none (the kernel compacts memory for madvised regions on a fault)
    assert with_switch >= 2048
    if "[madvise]" in THP_SETTING.read_text():  # here only madvised memory gets them
        assert run_probe("off", {**clean_env(), HUGE_PAGES_VARIABLE: "0"}) < with_switch
