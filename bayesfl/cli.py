"""The ``bayesfl`` command line.

``bayesfl run --strategy fedlog --dataset digits --clients 20 --partition shards:2 --rounds 30
--seed 0 --out runs/demo`` runs `bayesfl.simulate.simulate`. ``bayesfl strategies`` lists
the strategies (each one's first sentence and options with their defaults); ``bayesfl strategies
NAME`` shows one in full, each option's meaning as the strategy declares it (`option_docs`,
from the registry `bayesfl.strategies.registry`).
``bayesfl flower`` runs the same experiment on a local Flower deployment
(`bayesfl.flower.command`). ``bayesfl evaluate RUN_DIR --shift rotate:15,30 --ood
unseen-labels`` evaluates a finished run on shifted and out-of-distribution rows
(`bayesfl.evaluate_command`).

The settings themselves (names, kinds, help, the TOML and flag readers) are
`bayesfl.settings`, which the Flower command and protocol read too. One vocabulary: every
setting of ``bayesfl run`` is a flag, and the same names are the keys of a TOML file given with
``--config FILE.toml`` (dashes or underscores alike: ``feature-dim`` or ``feature_dim``). A flag
that takes KEY=VALUE pairs (``--option``, ``--dataset-option``) is a table in TOML
(``[option]``) or a list of ``"KEY=VALUE"`` strings; an on/off flag is a boolean
(``no-progress = true``). Some settings have a second name, the keyword of
[`simulate`][bayesfl.simulate.simulate], accepted both as a flag and as a key: ``--bins`` /
``--n-bins``, ``--option`` / ``--strategy-options``, ``--dataset-option`` /
``--dataset-options``, ``--no-batched`` / ``batched = false``.
Flags given on the command line override the file (options tables are merged key by key). An
unknown key, or a value of the wrong type, is an error that names the file, the key and the
valid choices.

Exit codes: 0 success; 2 bad usage, configuration or input (one line on stderr that says what
was wrong and what to do, argparse's usage errors included; advice the library words for Python
callers, such as ``download=True``, is given in the flags' spelling); 130 interrupted (Ctrl-C:
one line with the exact command that resumes the run).
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import os
import re
import shlex
import sys
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from bayesfl.errors import BayesFLError, ConfigError
from bayesfl.evaluate_command import add_parser as add_evaluate_parser
from bayesfl.evaluate_command import run_evaluate
from bayesfl.flower.command import NOT_ON_FLOWER, run_flower
from bayesfl.flower.command import add_parser as add_flower_parser
from bayesfl.run_directory import CHECKPOINT_NAME
from bayesfl.settings import (  # noqa: F401 - SETTINGS, Setting, ... were this module's API
    MAX_CONFIG_BYTES,
    RUN_KEYWORDS,
    SETTINGS,
    Setting,
    add_settings,
    parse_options,
    read_config,
    settings_from_flags,
    settings_from_mapping,
)

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for a process stopped by Ctrl-C

RUN_EXAMPLES = (
    "bayesfl run --strategy fedlog --clients 10 --partition dirichlet:0.5 --rounds 5",
    "bayesfl run --strategy fedlog-c --option alpha=0.01 --partition labels:3 --rounds 5",
    "bayesfl run --strategy fedavg --dataset gaussian_mixture --dataset-option n=600 "
    "--dataset-option num_classes=4 --clients 4 --partition shards:2",
    "bayesfl run --config run.toml --rounds 10",
)
"""The examples of ``bayesfl run --help`` (each one runs: tests/bayesfl/test_cli_help.py)."""

RUN_TOML_EXAMPLE = """\
strategy = "fedlog"
feature-dim = 50
bins = 15
no-progress = true
[option]
mc_samples = 512
"""
"""The ``run.toml`` of ``bayesfl run --help``."""

RUN_EPILOG = (
    "examples:\n" + "".join(f"  {line}\n" for line in RUN_EXAMPLES)
    + "\nA TOML file (--config) takes the flag names as keys, - or _ alike; run.toml:\n"
    + "".join(f"  {line}\n" for line in RUN_TOML_EXAMPLE.splitlines())
    + "Flags given on the command line override the file. `bayesfl strategies NAME` lists a\n"
    "strategy's options (for --option). Ctrl-C stops a run and prints the command that\n"
    "resumes it.")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: every usage error is one line on stderr (what was wrong
    and where the help is), exit code 2, instead of argparse's usage dump."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def strategies_help() -> str:
    """The strategies of the registry by family, as ``bayesfl run --help`` lists them (a
    strategy registered before the parser is built, such as a user's module, is listed too)."""
    from bayesfl.strategies import FAMILIES, STRATEGIES

    lines = ["strategies (--strategy NAME; `bayesfl strategies NAME` for its options):"]
    for key, family in FAMILIES.items():
        names = [n for n, cls in STRATEGIES.items()
                 if getattr(cls, "registration", None) is not None
                 and cls.registration.family == key]
        if names:
            lines.append(textwrap.fill(f"{family.label}: {', '.join(names)}", 100,
                                       initial_indent="  ", subsequent_indent="    ",
                                       break_on_hyphens=False))
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="bayesfl", description="Bayesian federated "
                                     "classification: run experiments in the embedded simulator.",
                                     allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "run", help="run a federated experiment", allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a federated experiment; writes metrics.jsonl, summary.json,\n"
        "manifest.json, a checkpoint and plots into --out.",
        epilog=RUN_EPILOG + "\n\n" + strategies_help())
    run.add_argument("--config", type=Path, metavar="FILE.toml",
                     help="TOML file with settings (keys: the flag names below)")
    add_settings(run)
    listing = commands.add_parser(
        "strategies", help="list strategies and their options", allow_abbrev=False,
        description="List the strategies: each one's summary and options with their defaults; "
        "with names, those strategies in full (each option's meaning).")
    listing.add_argument("names", nargs="*", metavar="NAME", help="strategies to show in full")
    add_flower_parser(commands)
    add_evaluate_parser(commands)
    return parser


HUGE_PAGES_VARIABLE = "THP_MEM_ALLOC_ENABLE"
"""PyTorch's switch (since 2.2) for backing CPU tensors of 2 MiB and more with transparent huge
pages (``madvise``): read once, at the process's first tensor allocation."""


def use_huge_pages() -> None:
    """Ask PyTorch to back large CPU tensors with transparent huge pages (sets
    `HUGE_PAGES_VARIABLE` to 1 unless the environment sets it; ``THP_MEM_ALLOC_ENABLE=0``
    opts out). Takes effect only before the process allocates its first tensor: the command
    line calls it first thing.

    Why: a simulator round allocates and frees tensors of hundreds of MB (the stacked bodies
    of every client, their gradients, the checkpoint's stacks), and with 4 KiB pages every
    fresh one costs a page fault per 4 KiB on first touch: a 256 MB clone took 0.165 s with
    them and 0.054 s with 2 MiB pages. In a whole 16,000-client FedLog round
    (bench/simulate_scale.py) the gain stayed inside the 2-core test machine's run-to-run
    spread (8.5 s a round without, 6.9-10.0 s with), at the same peak memory (2.75-2.84 GB).
    On a kernel whose THP setting is ``never`` the switch changes nothing."""
    os.environ.setdefault(HUGE_PAGES_VARIABLE, "1")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``bayesfl`` console script; returns the exit code."""
    use_huge_pages()
    from calibration.errors import CalibrationError
    from inference.errors import InferenceError

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["flower"]:  # a flag of `bayesfl run` that Flower does not take: say why
        for word in argv[1:]:
            name = word.partition("=")[0].removeprefix("--").removeprefix("no-")
            if word.startswith("--") and name in NOT_ON_FLOWER:
                print(f"bayesfl flower: error: {word.partition('=')[0]} is not offered on "
                      f"Flower: {NOT_ON_FLOWER[name]}", file=sys.stderr)
                return EXIT_USAGE
    try:
        args = _parser().parse_args(argv)
    except SystemExit:  # --help (or a usage error): its text is flushed while we can still
        _flush_stdout()  # tell a reader that left from an error
        raise
    try:
        if args.command == "strategies":
            code = _list_strategies(args.names)
        elif args.command == "flower":
            code = run_flower(args)
        elif args.command == "evaluate":
            code = run_evaluate(args)
        else:
            code = _run(args, argv)
        # a listing shorter than the pipe's buffer is written here, not in the interpreter's
        # final flush, where a closed pipe could only be reported ("Exception ignored", 120)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        return _reader_left()
    except (BayesFLError, InferenceError, CalibrationError, OSError) as err:
        print(f"bayesfl: error: {_one_line(err)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("bayesfl: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _reader_left() -> int:
    """stdout's reader went away (``bayesfl strategies | head``): that is how a pipe ends, not
    an error. As the Python docs advise (``signal`` module, "Note on SIGPIPE"), point stdout at
    devnull so that the interpreter's final flush does not raise again; exit code 0."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 0


def _flush_stdout() -> None:
    """Flush stdout now; a reader that went away is `_reader_left`."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        _reader_left()


CLI_SPELLINGS = {"pass download=True": "pass --download", "use download=True": "use --download"}
"""Advice the library words for Python callers -> the same advice in ``bayesfl run``'s flags."""


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    for python, flag in CLI_SPELLINGS.items():
        text = text.replace(python, flag)
    return text


def _list_strategies(names: Sequence[str] = ()) -> int:
    """``bayesfl strategies``: each strategy's summary and options; with names, those in full."""
    from bayesfl.strategies import STRATEGIES, options_of

    if not names:
        for name, cls in STRATEGIES.items():
            options = ", ".join(f"{k}={_shown(d)}" for k, (d, _) in option_docs(name).items())
            print(f"{name:18s} {strategy_summary(cls)}")
            if options:
                print(textwrap.fill(f"options: {options}", 100, initial_indent=" " * 19,
                                    subsequent_indent=" " * 28, break_on_hyphens=False))
        print("\nEach option's meaning: bayesfl strategies NAME (e.g. bayesfl strategies fedlog). "
              "Set options with --option KEY=VALUE.")
        return 0
    for name in names:
        if name not in STRATEGIES:
            raise ConfigError(_unknown_strategy(name, STRATEGIES))
    for i, name in enumerate(names):
        print(("\n" if i else "") + f"{name}  {strategy_summary(STRATEGIES[name])}")
        docs = option_docs(name)
        if not docs:
            print("  no options")
        declared = options_of(STRATEGIES[name])
        for option, (default, meaning) in docs.items():
            print(f"  {option} (default {_shown(default)}; {_accepts(declared[option])})")
            print(textwrap.fill(meaning, 100, initial_indent=" " * 6,
                                subsequent_indent=" " * 6, break_on_hyphens=False))
    return 0


def _accepts(option: Any) -> str:
    """What a declared option accepts, in words: its kinds, choices and bounds."""
    if option.choices is not None:
        words = "one of " + ", ".join(_shown(c) for c in option.choices)
        return words + (" or none" if option.nullable or option.default is None else "")
    words = option.type_words()
    if option.minimum is not None and option.maximum is not None:
        words += f" in [{option.minimum:g}, {option.maximum:g}]"
    elif option.minimum is not None:
        words += f" >= {option.minimum:g}"
    elif option.maximum is not None:
        words += f" <= {option.maximum:g}"
    return words


def _unknown_strategy(name: str, known: Mapping[str, Any]) -> str:
    near = difflib.get_close_matches(name, list(known), n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return f"unknown strategy {name!r}{hint}; valid: {', '.join(known)}"


def _shown(value: Any) -> str:
    """An option value as it is typed after ``--option KEY=``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return value if isinstance(value, str) else repr(value)


_ABBREVIATIONS = ("e.g", "i.e", "et al", "cf", "vs", "resp", "approx", "Eq", "Fig", "No")


def strategy_summary(cls: type) -> str:
    """The first sentence, whole, of a strategy class's docstring (RST markup dropped; a
    pointer to the module docstring left out)."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    paragraph = " ".join(doc.split("\n\n")[0].split())
    depth, end = 0, len(paragraph)
    for i, char in enumerate(paragraph):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "." and depth == 0 and paragraph[i + 1:i + 2] in ("", " ") \
                and not paragraph[:i].endswith(_ABBREVIATIONS):
            end = i + 1
            break
    sentence = re.sub(r"\s*\((see )?(the )?module doc(string)?\)", "", paragraph[:end])
    return sentence.replace("``", "`")


def option_docs(name: str) -> dict[str, tuple[Any, str]]:
    """Strategy ``name``'s options: option -> (default as shown, meaning), from its declaration
    (`bayesfl.strategies.registry.options_of`; a None default that stands for a value is
    shown as that value, e.g. FedSI's ``posterior``)."""
    from bayesfl.strategies import lookup, options_of

    return {option.name: (option.shown_default, option.help.replace("``", "`"))
            for option in options_of(lookup(name)).values()}


def _run(args: argparse.Namespace, argv: list[str]) -> int:
    from bayesfl.simulate import simulate

    settings = read_config(args.config) if args.config is not None else {}
    flags = settings_from_flags(args)
    if flags.get("resume") and not flags.get("force"):
        settings.pop("force", None)  # --resume on the command line wins over the file's force
    if flags.get("force") and not flags.get("resume"):
        settings.pop("resume", None)
    for target in ("strategy_options", "dataset_options"):
        if target in flags:
            flags[target] = {**settings.get(target, {}), **flags[target]}
    settings.update(flags)
    run = {k: settings.pop(k) for k in RUN_KEYWORDS if k in settings}
    out = Path(run.pop("out", None) or _default_out(settings))
    if run.get("resume") and not run.get("force") and not (out / CHECKPOINT_NAME).exists():
        # a mistyped --out must not start a long run unnoticed
        print(f"bayesfl: no checkpoint in {out} yet; starting the run from its first round",
              file=sys.stderr)
    try:
        result = simulate(out=out, **run, **settings)
    except KeyboardInterrupt:
        print(f"bayesfl: interrupted; continue the run with: {resume_command(argv, out)}",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    s = result.summary
    print(f"{s['strategy']} on {s['dataset']} ({s['clients']} clients, {s['partition']}, "
          f"{s['rounds']} round{'' if s['rounds'] == 1 else 's'}): accuracy "
          f"{s['accuracy']:.4f} (pooled "
          f"{s['accuracy_pooled']:.4f}), ECE {s['ece']:.4f}, NLL {s['nll']:.4f}, "
          f"bytes up {s['bytes_up']:,}, down {s['bytes_down']:,}, "
          f"rejected uploads {s['rejected_uploads']}, {s['seconds']:.1f} s")
    calibration = s.get("calibration") or {}
    if calibration.get("calibrated"):
        after = calibration["calibrated"]
        print(f"temperature scaling: T = {calibration['temperature']:.4g}, ECE "
              f"{after['ece']:.4f}, NLL {after['nll']:.4f} (uncalibrated above), "
              f"bytes up {calibration['bytes_up']:,}, down {calibration['bytes_down']:,}")
    for key, f in (s.get("conformal") or {}).get("predictives", {}).items():
        c = s["conformal"]
        print(f"conformal sets ({c['score']}, alpha {c['alpha']:g}, {c['method']}), {key}: "
              f"coverage {f['coverage']:.4f} (client min {f['coverage_client_min']:.4f}), "
              f"mean set size {f['mean_set_size']:.3f}, bytes up {c['bytes_up']:,}")
    if s["rounds"] == 0:
        print("0 rounds: nothing was trained; the figures are the initial model's (for FedLog "
              "the head of its round 0 statistics on the initial bodies)")
    shifted = s.get("shift_evaluation")
    if shifted and shifted.get("report"):
        print(f"shift evaluation: {result.run_dir / shifted['report']} (bayesfl evaluate "
              f"{result.run_dir} shows it)")
    print(f"results in {result.run_dir}")
    return 0


def _default_out(settings: Mapping[str, Any]) -> Path:
    return Path("runs") / (f"{settings.get('strategy', 'fedlog')}_"
                           f"{settings.get('dataset', 'digits')}_seed{settings.get('seed', 0)}")


def resume_command(argv: Sequence[str], out: Path) -> str:
    """The command that continues an interrupted ``bayesfl run`` ``argv``: the same arguments
    without ``--force``, with ``--resume`` (and ``--out`` where the default was used)."""
    words = [w for w in argv if w not in ("--force", "--no-force")]
    if not any(w == "--out" or w.startswith("--out=") for w in words):
        words += ["--out", str(out)]
    if "--resume" not in words:
        words.append("--resume")
    return shlex.join(["bayesfl", *words])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())


__all__ = ["SETTINGS", "Setting", "main", "parse_options", "read_config", "resume_command",
           "settings_from_mapping"]
