"""Mutation testing of one module with its covering tests (mutmut 3), and its score.

    python tools/mutation.py bayesfl/strategies/bayes/fedpa.py    # or: make mutation MODULE=...
    python tools/mutation.py bayesfl/calibrate.py --tests tests/bayesfl/test_calibrate.py
    python tools/mutation.py bayesfl/strategies/bayes/fedpa.py --retest  # after writing tests
    python tools/mutation.py bayesfl/simulate.py --sample 80 --seed 0  # a random sample

What it does, for MODULE:

1. Picks the covering tests: ``tests/<mirror path>/test_<name>.py`` by convention, or the
   files listed for MODULE in ``COVERING_TESTS`` below (for modules whose tests live
   elsewhere, or whose only fast tests are a subset); ``--tests`` overrides both.
2. Runs ``mutmut run --max-children 1`` in a work directory of its own,
   ``.mutation/<dotted module>/`` (git-ignored; the leading dot keeps it out of pytest's and
   ruff's way). The directory holds symbolic links to the packages, ``tests/``, the root
   ``conftest.py`` and ``pyproject.toml``, and a generated ``setup.cfg`` with the ``[mutmut]``
   section (mutmut reads its configuration from the working directory; pyproject.toml has no
   ``[tool.mutmut]`` so that each module gets its own). mutmut copies the tree into
   ``.mutation/<module>/mutants/``, mutates every function of MODULE there (module-level
   code, class bodies and ``@property`` methods are not mutated), records which of the
   selected tests call each function, and runs, per mutant, only those tests, in a process
   forked from a fork server that has pytest and torch already imported: one mutant at a
   time, one torch thread (``OMP_NUM_THREADS=1`` unless set), pytest-xdist and
   pytest-randomly off.
3. Prints the score, killed / (total - equivalent), and every surviving mutant as
   ``file:line`` with the changed lines, so that a test can be written for each. A timeout
   (the mutant made the tests run past mutmut's CPU limit) and a crash count as killed;
   "no tests" (a function none of the selected tests calls) counts as survived.
   The summary is also written to ``.mutation/<module>/report.json``.

Known-equivalent mutants (no test can tell them from the original) are listed per module in
``tools/mutation_equivalents.toml`` with a one-line reason and the mutated line; they leave
the denominator. mutmut numbers a function's mutants in order, so editing a function can
renumber them: an entry whose mutated line no longer matches is reported as stale and not
excluded.

Each run starts afresh (mutmut would otherwise keep the verdicts of unchanged functions even
when the tests changed). ``--resume`` continues an interrupted run; ``--retest`` reruns only
the mutants the last run did not kill, against the current tests.

``--sample N`` tests N mutants drawn uniformly at random without replacement (``--seed``)
from the module's mutants less the listed equivalents, for modules too large to run whole: the
report gives killed / N and a 95% Wilson interval for the module's score. The sample is kept
in the work directory (``sample.json``), so ``--retest``, ``--resume`` and ``--report`` apply
to it; a run without ``--sample`` forgets it.

Every finished run (a full run, a sample, a retest; ``--resume`` too, marked so) appends one
JSON line to ``bench/results/mutation.jsonl`` (`run_record`: the counts, the score and its
interval, the tests, the wall time, commit, date and machine), the source of
docs/development.md's table (``bench/published_tables.py``); ``--no-record`` skips it (a trial
run). Commit the code a run measures before starting it, so that its commit is that code's.

Not part of ``make test``: a module takes tens of minutes (the stored runs are in
docs/development.md, section "Mutation testing").
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import math
import os
import platform
import random
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".mutation"
EQUIVALENTS = ROOT / "tools" / "mutation_equivalents.toml"
RECORDS = ROOT / "bench" / "results" / "mutation.jsonl"
PACKAGES = ("bayesfl", "inference", "calibration")
LINKED = (*PACKAGES, "tests", "conftest.py", "pyproject.toml", "examples")  # examples: the
# Flower app whose run-config keys test_flower.py checks

# Modules whose covering tests are not (only) tests/<mirror path>/test_<name>.py: pytest
# arguments (files, node ids, or options such as -m "not slow" as two items).
_SPLITS = ["tests/bayesfl/strategies/averaging/test_layer_splits.py"]
COVERING_TESTS: dict[str, list[str]] = {
    # the fit's option errors are specified with fit_head's, in the scales file
    "inference/variational_gaussian.py":
        ["tests/inference/test_variational_gaussian.py",
         "tests/inference/test_laplace_head_scales.py"],
    "inference/subnet/lowrank.py":
        ["tests/inference/subnet/test_subnet_lowrank.py",
         "tests/bayesfl/strategies/fedsi/test_fedsi_lowrank.py"],
    "bayesfl/strategies/averaging/fedpart_schedule.py":
        ["tests/bayesfl/strategies/averaging/test_fedpart.py"],
    "bayesfl/strategies/averaging/fedavg.py":
        ["tests/bayesfl/strategies/averaging/test_parameter_averaging.py",
         "tests/bayesfl/strategies/averaging/test_local_baselines.py"],
    "bayesfl/strategies/averaging/local_only.py":
        ["tests/bayesfl/strategies/averaging/test_local_baselines.py"],
    "bayesfl/strategies/averaging/fedper.py": _SPLITS,
    "bayesfl/strategies/averaging/fedrep.py": _SPLITS,
    "bayesfl/strategies/averaging/lg_fedavg.py": _SPLITS,
    "bayesfl/strategies/averaging/fedbabu.py": _SPLITS,
    # the round loop and, in a file of its own, resuming from a checkpoint
    "bayesfl/simulate.py": ["tests/bayesfl/test_simulate.py",
                            "tests/bayesfl/test_simulate_novel.py",
                            "tests/bayesfl/test_resume.py"],
    # the ServerApp's round over an in-process grid; the real deployments take minutes each
    "bayesfl/flower/server_app.py": ["tests/bayesfl/test_flower.py", "-m", "not flower"],
    "bayesfl/flower/channel.py": ["tests/bayesfl/test_flower.py", "-m", "not flower"],
    # the run around the rounds, once for both transports
    "bayesfl/engine/run.py": ["tests/bayesfl/test_simulate.py", "tests/bayesfl/test_resume.py",
                              "tests/bayesfl/test_flower.py", "-m", "not flower"],
}

# A mutant's CPU limit is (its tests' clean time + 1 s) x this x 2 (mutmut's default 15 let a
# mutant that loops forever in bayesfl/calibrate.py's search hold the core for 15 minutes).
TIMEOUT_MULTIPLIER = 3

# mutmut exit-code verdicts, grouped for the score.
KILLED = {"killed", "caught by type check"}
TIMEOUT = {"timeout"}
CRASHED = {"segfault"}
SURVIVED = {"survived"}
NO_TESTS = {"no tests"}


def sample_names(names: list[str], size: int, seed: int) -> list[str]:
    """``size`` of ``names`` drawn uniformly without replacement, the same for the same seed
    whatever the order of ``names``; in mutmut's order (function, then number)."""
    population = sorted(set(names), key=natural)
    chosen = random.Random(seed).sample(population, min(size, len(population)))
    return sorted(chosen, key=natural)


def wilson_interval(successes: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval for a binomial proportion (95% for z = 1.96)."""
    if trials <= 0:
        return (0.0, 1.0)
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    spread = math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials))
    half = z * spread / (1 + z * z / trials)
    return (max(0.0, centre - half), min(1.0, centre + half))


def module_mutants(workdir: Path, module: str) -> list[str]:
    """Every mutant mutmut makes of MODULE, by full name, from mutmut's own generator (it
    reads setup.cfg from the cwd, hence the work directory)."""
    from mutmut.mutation.file_mutation import mutate_file_contents

    prefix = module[: -len(".py")].replace("/", ".") + "."
    cwd = Path.cwd()
    os.chdir(workdir)
    try:
        names = mutate_file_contents(module, (ROOT / module).read_text()).mutant_names
    finally:
        os.chdir(cwd)
    return [prefix + n for n in names]


def covering_tests(module: str) -> list[str]:
    if module in COVERING_TESTS:
        return COVERING_TESTS[module]
    path = Path(module)
    return [str(Path("tests", *path.parts[:-1], f"test_{path.stem}.py"))]


def setup_cfg(module: str, tests: list[str]) -> str:
    def lines(values):
        return "".join(f"\n    {v}" for v in values)

    return f"""# generated by tools/mutation.py for {module}; rewritten on every run
[mutmut]
source_paths ={lines(PACKAGES)}
only_mutate = {module}
also_copy =
    conftest.py
    examples
pytest_add_cli_args_test_selection ={lines(tests)}
pytest_add_cli_args ={lines(["-p", "no:xdist", "-p", "no:randomly", "-p", "no:cacheprovider"])}
process_isolation = forkserver
use_git_change_detection = false
timeout_multiplier = {TIMEOUT_MULTIPLIER}
"""


def prepare(workdir: Path, module: str, tests: list[str], keep: bool) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    if not keep:
        shutil.rmtree(workdir / "mutants", ignore_errors=True)
    for name in LINKED:
        link = workdir / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(ROOT / name)
    (workdir / "setup.cfg").write_text(setup_cfg(module, tests))
    if not keep:  # the report's line numbers refer to the source that was mutated
        shutil.copy2(ROOT / module, workdir / "source.py")


def run_mutmut(workdir: Path, names: list[str]) -> None:
    mutmut = Path(sys.executable).with_name("mutmut")
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env.setdefault(var, "1")
    cmd = [str(mutmut) if mutmut.exists() else "mutmut", "run", "--max-children", "1", *names]
    subprocess.run(cmd, cwd=workdir, env=env, check=True)


def function_lines(source: str) -> dict[tuple[str | None, str], int]:
    """(class or None, function) -> line of its ``def``, for what mutmut mutates: top-level
    functions and the methods of top-level classes."""
    out: dict[tuple[str | None, str], int] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            out[(None, node.name)] = node.lineno
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    out[(node.name, item.name)] = item.lineno
    return out


def mutant_changes(name: str, module: str, def_lines) -> list[tuple[int, list[str], list[str]]]:
    """[(line in MODULE, original lines, mutated lines)] for one mutant (cwd: its workdir)."""
    import libcst as cst
    from mutmut.mutation.diff_apply import (
        read_functions_from_index,
        read_mutant_function,
        read_mutants_module,
        read_original_function,
    )
    from mutmut.utils.format_utils import orig_function_and_class_names_from_key

    functions = read_functions_from_index(name, module)
    if functions is None:
        tree = read_mutants_module(module)
        functions = read_original_function(tree, name), read_mutant_function(tree, name)
    orig, mutated = (cst.Module([f]).code.strip().split("\n") for f in functions)
    function, klass = orig_function_and_class_names_from_key(name)
    # The function's text may start with the comments above its def: anchor on the def line.
    first = next(i for i, t in enumerate(orig) if t.lstrip().startswith(("def ", "async def ")))
    start = def_lines.get((klass, function), 0)
    matcher = difflib.SequenceMatcher(a=orig, b=mutated, autojunk=False)
    return [
        (start + i1 - first, orig[i1:i2], mutated[j1:j2])
        for tag, i1, i2, j1, j2 in matcher.get_opcodes()
        if tag != "equal"
    ]


def load_equivalents(module: str) -> dict[str, dict[str, str]]:
    if not EQUIVALENTS.exists():
        return {}
    table = tomllib.loads(EQUIVALENTS.read_text()).get(module, {})
    for key, entry in table.items():
        if not (isinstance(entry, dict) and {"reason", "mutated"} <= entry.keys()):
            raise SystemExit(f"{EQUIVALENTS}: [{module!r}] {key}: needs reason and mutated")
    return table


def report(workdir: Path, module: str, tests: list[str], wall_s: float | None,
           sample: dict | None = None) -> dict:
    meta_path = Path("mutants") / f"{module}.meta"
    if not (workdir / meta_path).exists():
        raise SystemExit(f"no results in {workdir / meta_path}: run without --report first")
    os.chdir(workdir)  # mutmut's helpers read setup.cfg and mutants/ from the cwd
    from mutmut.stats import status_by_exit_code

    exit_codes = json.loads(meta_path.read_text())["exit_code_by_key"]
    if sample is not None:
        exit_codes = {k: exit_codes.get(k) for k in sample["names"]}
    source = workdir / "source.py"
    def_lines = function_lines((source if source.exists() else ROOT / module).read_text())
    prefix = module[: -len(".py")].replace("/", ".") + "."
    equivalents = load_equivalents(module)
    previous = workdir / "report.json"
    if wall_s is None and previous.exists():  # --report: the wall time of the run it reports
        wall_s = json.loads(previous.read_text()).get("wall_s")

    counts: dict[str, int] = {}
    survivors, equivalent, stale, missing = [], [], [], []
    for name, code in sorted(exit_codes.items(), key=lambda kv: natural(kv[0])):
        status = status_by_exit_code[code]
        counts[status] = counts.get(status, 0) + 1
        short = name.removeprefix(prefix)
        if status not in SURVIVED | NO_TESTS:
            continue
        changes = mutant_changes(name, module, def_lines)
        entry = equivalents.get(short)
        if entry is not None:
            mutated_text = " ".join(t.strip() for _, _, new in changes for t in new)
            if entry["mutated"].strip() in mutated_text:
                equivalent.append((short, entry["reason"]))
                continue
            stale.append(short)
        survivors.append((short, status, changes))
    missing = [] if sample else [k for k in equivalents if prefix + k not in exit_codes]
    killed_listed = [
        k for k in equivalents
        if prefix + k in exit_codes
        and status_by_exit_code[exit_codes[prefix + k]] not in SURVIVED | NO_TESTS
    ]

    total = len(exit_codes)
    detected = sum(counts.get(s, 0) for s in KILLED | TIMEOUT | CRASHED)
    unknown = counts.get("not checked", 0)
    skipped = counts.get("skipped", 0)
    denominator = total - len(equivalent) - skipped - unknown
    score = detected / denominator if denominator else float("nan")
    interval = wilson_interval(detected, denominator) if sample else None

    print()
    print(f"Mutation score of {module} with {' '.join(tests)}")
    if sample:
        print(f"  a random sample: {total} of {sample['population']} mutants (less listed "
              f"equivalents), seed {sample['seed']}")
    print(f"  killed {detected} / (total {total} - equivalent {len(equivalent)}"
          + (f" - skipped {skipped}" if skipped else "")
          + (f" - not checked {unknown}" if unknown else "")
          + f") = {100 * score:.1f}%"
          + (f", 95% interval {100 * interval[0]:.1f}-{100 * interval[1]:.1f}%"
             if interval else ""))
    detail = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    print(f"  verdicts: {detail}; equivalent (listed) {len(equivalent)}"
          + (f"; wall time {wall_s / 60:.1f} min" if wall_s is not None else ""))
    if unknown:
        print(f"  {unknown} mutants not checked (interrupted?): --resume finishes them")
    for short in stale:
        print(f"  STALE equivalent entry {short}: its mutated line no longer matches")
    for short in missing:
        print(f"  STALE equivalent entry {short}: no such mutant any more")
    for short in killed_listed:
        print(f"  equivalent entry {short} was killed: it is not equivalent, remove it")
    print()
    print(f"Surviving mutants ({len(survivors)}):" if survivors else "No surviving mutants.")
    for short, status, changes in survivors:
        line = changes[0][0] if changes else 0
        note = "" if status == "survived" else f" ({status}: no selected test calls it)"
        print(f"{module}:{line}  {short}{note}")
        for _, old, new in changes:
            for t in old:
                print(f"    - {t.strip()}")
            for t in new:
                print(f"    + {t.strip()}")

    summary = {
        "module": module,
        "tests": tests,
        "killed": counts.get("killed", 0),
        "timeout": counts.get("timeout", 0),
        "crashed": counts.get("segfault", 0),
        "survived": counts.get("survived", 0),
        "no_tests": counts.get("no tests", 0),
        "equivalent": len(equivalent),
        "not_checked": unknown,
        "total": total,
        "detected": detected,
        "scored": denominator,
        "score": score,
        "sample": None if sample is None else {
            "size": total, "seed": sample["seed"], "population": sample["population"],
            "ci95": interval},
        "wall_s": wall_s,
        "survivors": [
            {"mutant": s, "status": st, "line": ch[0][0] if ch else None,
             "changes": [{"line": ln, "old": old, "new": new} for ln, old, new in ch]}
            for s, st, ch in survivors
        ],
    }
    (workdir / "report.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def provenance(threads: str) -> dict[str, str]:
    """``commit`` (short hash of HEAD) and ``date`` (UTC) as every bench/results record
    has them (`bench.run_cache.provenance`), ``machine`` (platform, torch's CPU kernel level
    and the threads mutmut runs with) and ``worktree`` (`bench.run_cache.worktree_state`:
    ``clean``, or how many tracked files differ from HEAD: in a shared checkout the code run
    may not be quite the commit's). Taken as a run starts."""
    import torch

    if str(ROOT) not in sys.path:  # `python tools/mutation.py` puts tools/ first, not the root
        sys.path.insert(0, str(ROOT))
    from bench.run_cache import provenance as bench_provenance
    from bench.run_cache import worktree_state

    where = bench_provenance()
    return {"commit": where["commit"], "date": where["date"],
            "machine": f"{platform.machine()} {torch.backends.cpu.get_cpu_capability()}, "
                       f"{threads} thread" + ("" if threads == "1" else "s"),
            "worktree": worktree_state()}


def run_record(summary: dict, kind: str, resumed: bool, where: dict[str, str]) -> dict:
    """One run's line of ``bench/results/mutation.jsonl``, from `report`'s summary.

    ``kind``: ``full`` (every mutant), ``sample`` or ``retest`` (the last run's survivors
    rerun; the counts are then the whole run's or sample's verdicts after the rerun). ``killed``
    counts mutmut's kills, ``detected`` adds the timeouts and crashes (the score counts them as
    killed), ``scored`` is the denominator (total less equivalents, skipped and unchecked).
    ``ci95`` is the 95% Wilson interval of a sample's score (of a retest of a sample too, though
    that figure is an upper estimate); a full run's score is the module's own, with none.
    ``wall_s`` is this invocation's (a ``resumed`` run's: the resumed part only)."""
    sample = summary["sample"]
    return {
        "module": summary["module"], "kind": kind, "resumed": resumed,
        "sample_size": sample["size"] if sample else None,
        "seed": sample["seed"] if sample else None,
        "population": sample["population"] if sample else None,
        "tests": summary["tests"],
        "killed": summary["killed"], "timeout": summary["timeout"],
        "crashed": summary["crashed"], "detected": summary["detected"],
        "survived": summary["survived"], "no_tests": summary["no_tests"],
        "equivalent": summary["equivalent"], "not_checked": summary["not_checked"],
        "total": summary["total"], "scored": summary["scored"], "score": summary["score"],
        "ci95": list(wilson_interval(summary["detected"], summary["scored"])) if sample else None,
        "survivors": [s["mutant"] for s in summary["survivors"]],
        "wall_s": summary["wall_s"],
        **where,
    }


def append_record(path: Path, record: dict) -> None:
    """``record`` as one JSON line at the end of ``path`` (created with its folder)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        handle.write(json.dumps(record) + "\n")


def natural(name: str):
    head, _, number = name.rpartition("__mutmut_")
    return (head, int(number) if number.isdigit() else 0)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("module", help="path of the module to mutate, e.g. bayesfl/calibrate.py")
    parser.add_argument("--tests", nargs="+", help="test files to run (default: the mapping)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true", help="keep earlier verdicts")
    mode.add_argument("--retest", action="store_true",
                      help="rerun only the mutants the last run did not kill")
    mode.add_argument("--report", action="store_true", help="only print the last run's results")
    parser.add_argument("--sample", type=int, metavar="N",
                        help="test N mutants drawn at random (less listed equivalents)")
    parser.add_argument("--seed", type=int, default=0, help="seed of --sample (default 0)")
    parser.add_argument("--no-record", action="store_true",
                        help=f"do not append the run to {RECORDS.relative_to(ROOT)}")
    args = parser.parse_args(argv)

    module = Path(args.module).resolve().relative_to(ROOT).as_posix()
    if not (module.endswith(".py") and module.split("/")[0] in PACKAGES
            and (ROOT / module).is_file()):
        parser.error(f"{args.module}: not a module of {', '.join(PACKAGES)}")
    tests = args.tests or covering_tests(module)
    files = [t.split("::")[0] for t in tests if t.startswith("tests/")]
    absent = [t for t in files if not (ROOT / t).exists()]
    if not files or absent:
        parser.error(f"covering tests {absent or tests} do not exist: pass --tests, or add "
                     f"{module} to COVERING_TESTS in tools/mutation.py")
    workdir = WORK / module[: -len(".py")].replace("/", ".")
    fresh = not (args.resume or args.retest or args.report)
    if args.sample is not None and (not fresh or args.sample < 1):
        parser.error("--sample N (N >= 1) starts a fresh run; --retest/--resume/--report "
                     "reuse the last run's sample")
    sample_path = workdir / "sample.json"
    if fresh:
        sample_path.unlink(missing_ok=True)
    sample = json.loads(sample_path.read_text()) if sample_path.exists() else None

    wall_s, where = None, None
    if not args.report:
        names: list[str] = []  # none: every mutant (without --resume: every unchecked one)
        if args.retest or (args.resume and sample):
            meta = workdir / "mutants" / f"{module}.meta"
            if not meta.exists():
                parser.error("--retest/--resume: no earlier run of this module")
            codes = json.loads(meta.read_text())["exit_code_by_key"]
            wanted = (0, 33) if args.retest else (None,)  # survived, no tests / not checked
            names = [k for k in (sample["names"] if sample else codes) if codes.get(k) in wanted]
            if not names:
                print("no mutants to " + ("retest" if args.retest else "resume"))
        snapshot = workdir / "source.py"
        if not fresh and snapshot.exists() and snapshot.read_text() != (ROOT / module).read_text():
            print(f"WARNING: {module} changed since the run: mutmut mutates the changed functions "
                  "afresh, so their mutant names may now name other mutants (compare "
                  f"{snapshot}; a worktree at the mutated version avoids this)")
        prepare(workdir, module, tests, keep=not fresh)
        if args.sample is not None:
            prefix = module[: -len(".py")].replace("/", ".") + "."
            population = [n for n in module_mutants(workdir, module)
                          if n.removeprefix(prefix) not in load_equivalents(module)]
            names = sample_names(population, args.sample, args.seed)
            sample = {"seed": args.seed, "population": len(population), "names": names}
            sample_path.write_text(json.dumps(sample, indent=1) + "\n")
        if names or fresh or (args.resume and not sample):  # else: nothing left to run
            # taken before the run: the commit and worktree whose code mutmut copies (another
            # engineer may commit or edit the shared checkout while it runs)
            where = provenance(os.environ.get("OMP_NUM_THREADS", "1"))  # run_mutmut's default
            start = time.monotonic()
            run_mutmut(workdir, names)
            wall_s = time.monotonic() - start
    summary = report(workdir, module, tests, wall_s, sample)
    if where is not None and not args.no_record:  # a run happened (not --report)
        kind = "retest" if args.retest else "sample" if sample else "full"
        append_record(RECORDS, run_record(summary, kind, args.resume, where))
        print(f"\nrecorded in {RECORDS.relative_to(ROOT)} (commit {where['commit']}, "
              f"worktree {where['worktree']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
