"""``bayesfl evaluate RUN_DIR``: shift suites on a finished run (`bayesfl.evaluate_shift`).

``bayesfl evaluate runs/demo --shift rotate:15,30,60,90 --shift noise:0.1,0.2 --ood
unseen-labels`` loads the run (`bayesfl.load_run`), rebuilds its clients' data from its
configuration, evaluates every client on its shifted test rows and on the OOD rows, merges the
clients' states, prints the pooled tables and writes ``shift_report.json``,
``shift_report.md``, ``shift_metrics.png`` and ``risk_coverage.png`` into ``--out`` (default
``RUN_DIR/shift``). Exit codes as ``bayesfl run``'s: 0 done, 2 bad usage or input (one line
that says what to do).

A run started with the run keys ``shift``/``ood`` stored its own report
(`bayesfl.shift_protocol`): ``bayesfl evaluate RUN_DIR`` without ``--shift``/``--ood``
shows it and writes it again (plots included) into ``--out``. A **Flower** run directory can
only be shown that way: its clients' states stayed at their sites, so nothing here can predict
for them; asking it other shifts, OOD sets or settings than those its run evaluated is an
error that names them and says to run it again with the run keys (``bayesfl flower --shift
... --ood ...``, or ``shift = "..."`` and ``ood = "..."`` in its run config).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bayesfl.errors import ConfigError

EXAMPLES = (
    "bayesfl evaluate runs/demo --shift rotate:15,30,60,90 --shift noise:0.1,0.2 "
    "--ood unseen-labels",
    "bayesfl evaluate runs/demo --shift contrast:0.5,0.8 --ood novel-clients --out shift/",
    "bayesfl evaluate runs/mnist --shift rotate:30,60 --image-shape 1,28,28",
)


def add_parser(commands: Any) -> None:
    """The ``evaluate`` subcommand on ``commands`` (argparse subparsers)."""
    from bayesfl.shift_evaluation import OOD_KINDS
    from bayesfl.shifts import SHIFT_KINDS

    evaluate = commands.add_parser(
        "evaluate", help="shift suites on a finished run: shifted inputs, OOD rows, "
        "selective prediction", allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Evaluate a finished run (a directory `bayesfl run --out DIR` wrote) on "
        "shifted test rows and\nout-of-distribution rows, per client and pooled, the headline "
        "predictive beside the MAP\nplug-in; writes shift_report.json, shift_report.md and "
        "plots into --out.",
        epilog="shifts (severities):\n"
        "  rotate:DEGREES,...   counter-clockwise rotation, bilinear, corners filled with the "
        "data's minimum\n"
        "  noise:SIGMA,...      clip(x + sigma * (max - min) * N(0, 1), min, max)\n"
        "  contrast:S,...       clip(m + (1 - S) * (x - m), min, max), m the image's mean, S in "
        "[0, 1]\n"
        "ood sets:\n"
        "  unseen-labels        test rows (all clients') of labels a client never trained on\n"
        "  novel-clients        the novel clients' test rows (runs with --novel-fraction)\n"
        "examples:\n" + "".join(f"  {line}\n" for line in EXAMPLES))
    evaluate.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run directory")
    evaluate.add_argument("--shift", action="append", default=[], metavar="KIND:S1,S2",
                          help=f"an input shift and its severities ({', '.join(SHIFT_KINDS)}); "
                          "repeatable")
    evaluate.add_argument("--ood", action="append", default=[], metavar="SET",
                          help=f"out-of-distribution rows ({', '.join(OOD_KINDS)}); repeatable")
    evaluate.add_argument("--out", type=Path, default=None, metavar="DIR",
                          help="where the report goes (default RUN_DIR/shift)")
    evaluate.add_argument("--seed", type=int, default=0,
                          help="seeds the noise and the posterior draws (default 0)")
    evaluate.add_argument("--coverage", type=float, default=0.8,
                          help="coverage of the selective accuracy (default 0.8)")
    evaluate.add_argument("--posterior-samples", type=int, default=32, metavar="N",
                          help="posterior draws for the mutual information (0: none; "
                          "default 32)")
    evaluate.add_argument("--image-shape", default=None, metavar="C,H,W",
                          help="shape of flat image rows of a data set not known to hold "
                          "images (e.g. 1,28,28)")
    evaluate.add_argument("--device", default="cpu", help="where to predict (default cpu)")
    evaluate.add_argument("--no-plots", action="store_true", help="write no plots")
    evaluate.add_argument("--no-progress", action="store_true", help="no progress bar")


def _image_shape(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        shape = tuple(int(w) for w in text.replace("x", ",").split(","))
    except ValueError:
        raise ConfigError(f"--image-shape {text!r}: write C,H,W or H,W with whole numbers "
                          "(e.g. 1,28,28)") from None
    return shape


def run_evaluate(args: argparse.Namespace) -> int:
    """``bayesfl evaluate``: load, evaluate (or read the report the run stored), print the
    tables, write the files."""
    from bayesfl.loaded_run import load_run, run_transport
    from bayesfl.shift_evaluation import evaluate_shift, ood_kinds
    from bayesfl.shift_protocol import REPORT_DIR, STATES_NAME, same_request, stored_shift_report
    from bayesfl.shifts import parse_shift

    shifts = [parse_shift(text) for text in args.shift]  # bad flags fail before the loading
    ood = ood_kinds(args.ood)
    report = None
    if run_transport(args.run_dir) == "flower":
        report = _stored(args, shifts)
    elif not shifts and not ood and (args.run_dir / REPORT_DIR / STATES_NAME).is_file():
        stored = stored_shift_report(args.run_dir)  # the run's own (run keys shift/ood)
        if same_request(stored.settings, (), (), seed=args.seed, coverage=args.coverage,
                        posterior_samples=args.posterior_samples) is None:
            report = stored
        else:  # its shifts again, with other settings
            shifts, ood = list(stored.settings["shifts"].items()), stored.settings["ood"]
    if report is None:
        run = load_run(args.run_dir, device=args.device)
        report = evaluate_shift(run, shifts, ood, seed=args.seed, coverage=args.coverage,
                                posterior_samples=args.posterior_samples,
                                image_shape=_image_shape(args.image_shape),
                                progress=not args.no_progress)
    out = args.out if args.out is not None else args.run_dir / "shift"
    paths = report.write(out, plots=not args.no_plots)
    print(report.to_markdown())
    print("written: " + ", ".join(str(p) for p in paths))
    return 0


def _stored(args: argparse.Namespace, shifts: list[Any]) -> Any:
    """The report the run stored, when it is what ``args`` ask (a Flower run: else a
    ConfigError that names the difference and the run keys to run it again with)."""
    from bayesfl.shift_protocol import same_request, stored_shift_report
    from bayesfl.shifts import format_severity

    report = stored_shift_report(args.run_dir)
    settings = report.settings
    differs = same_request(settings, shifts, args.ood, seed=args.seed,
                           coverage=args.coverage, posterior_samples=args.posterior_samples)
    if differs is not None:
        wanted = " ".join(f"{s.kind}:{','.join(format_severity(v) for v in s.severities)}"
                          for s in shifts) or " ".join(
            f"{k}:{','.join(format_severity(v) for v in vs)}"
            for k, vs in settings["shifts"].items())
        ood = " ".join(args.ood) or " ".join(settings["ood"])
        raise ConfigError(
            f"{args.run_dir} is a Flower run: its clients' states stayed at their sites, so "
            f"only the shift report its run made can be shown, and you asked {differs}; run "
            f"it again with the run keys shift = \"{wanted}\" and ood = \"{ood}\" (bayesfl "
            "flower ... --shift KIND:S1,S2 --ood SET), then bayesfl evaluate shows that report")
    return report


__all__ = ["EXAMPLES", "add_parser", "run_evaluate"]
