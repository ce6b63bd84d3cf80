"""``bayesfl-calibrate``: a calibration report of saved predictions.

Examples::

    bayesfl-calibrate preds.npz                       # keys probs, labels[, client_ids]
    bayesfl-calibrate logits.pt --logits --json report.json --plot diagram.png
    bayesfl-calibrate scores.npy --labels labels.npy --bins 20 --binning quantile
    bayesfl-calibrate preds.csv --client-column site  # columns label, site, one per class

Prints a table (per client, pooled (micro), macro, sd over clients) and exits 0. Every failure
is one line ``bayesfl-calibrate: error: <reason>`` on stderr and a non-zero exit: 1 for bad input
(or anything else that went wrong), 2 for bad command-line usage, 130 when interrupted; never a
traceback (set ``BAYESFL_TRACEBACK=1`` to see one for an unexpected error). Warnings about the
input (e.g. an ignored pandas index column) are one line each, ``bayesfl-calibrate: warning:``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from calibration.binning import MAX_BINS, Binning, check_n_bins
from calibration.bounded_files import MAX_FILE_BYTES
from calibration.errors import CalibrationError
from calibration.prediction_files import load_predictions
from calibration.report import report

PROG = "bayesfl-calibrate"
_SIZE_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
               "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors on one line (and the same prefix as every other error)."""

    def error(self, message: str) -> NoReturn:
        _fail(f"{message} (see {PROG} --help)")
        raise SystemExit(2)


def byte_count(text: str) -> int:
    """``"1073741824"``, ``"4G"`` (10**9), ``"4GiB"`` (2**30), ... as a positive int."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]i?)?[bB]?\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r} (a number of bytes, optionally with K, M, G or T, e.g. 4G)")
    count = int(float(match.group(1)) * _SIZE_UNITS[(match.group(2) or "").upper()])
    if count < 1:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (must be at least 1 byte)")
    return count


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Calibration report (ECE, MCE, Brier, NLL, accuracy) of saved predictions.",
        epilog="File layouts: .npz/.pt with 'probs' (or 'logits' with --logits), 'labels' and "
        "optional 'client_ids'; .npy with scores only (use --labels); .csv with a 'label' "
        "column, an optional 'client_id' column and one column per class.",
    )
    parser.add_argument("predictions", type=Path, help="prediction file (.npz, .npy, .pt, .csv)")
    parser.add_argument("--labels", type=Path, default=None,
                        help="separate labels file (.npy, .npz, .pt, .csv)")
    parser.add_argument("--bins", type=int, default=15,
                        help=f"number of bins (default 15, at most {MAX_BINS:,})")
    parser.add_argument("--binning", choices=[b.value for b in Binning], default="uniform",
                        help="equal-width 'uniform' (default) or equal-mass 'quantile' bins")
    parser.add_argument("--logits", action="store_true",
                        help="scores are logits (read key 'logits'); default: probabilities")
    parser.add_argument("--label-key", "--label-column", dest="label_key", default=None,
                        help="entry/column holding the labels (default 'labels' or 'label')")
    parser.add_argument("--client-key", "--client-column", dest="client_key", default=None,
                        help="entry/column holding client ids for a per-client report "
                        "(default 'client_ids' or 'client_id' when present)")
    parser.add_argument("--json", type=Path, default=None, help="write the report as JSON here")
    parser.add_argument("--markdown", type=Path, default=None,
                        help="write the report table as Markdown here")
    parser.add_argument("--plot", type=Path, default=None,
                        help="write the pooled reliability diagram here (.png, .svg or .pdf)")
    parser.add_argument("--max-bytes", type=byte_count, default=MAX_FILE_BYTES,
                        help="the most bytes a prediction or labels file may hold or decompress "
                        "to (default 1GiB); e.g. 4G or 8GiB for a larger evaluation")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 success, 1 failure, 2 bad usage, 130 Ctrl-C)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, or a usage error already reported on one line
        return int(exit_.code or 0)
    with warnings.catch_warnings():
        warnings.simplefilter("default", UserWarning)
        warnings.showwarning = _warn  # one line each, as they happen (restored on exit)
        try:
            _run(args)
            code = 0
        except (CalibrationError, OSError) as err:
            code = _fail(_one_line(err))
        except MemoryError:
            code = _fail("out of memory; score fewer predictions at a time (or fewer --bins)")
        except KeyboardInterrupt:
            code = _fail("interrupted", 130)
        except Exception as err:  # a bug: still one line, unless a traceback is asked for
            if os.environ.get("BAYESFL_TRACEBACK"):
                raise
            code = _fail(f"unexpected {type(err).__name__}: {_one_line(err)} (this is a bug in "
                         f"{PROG}; rerun with BAYESFL_TRACEBACK=1 to see where)")
    return code


def _warn(message, category, *args, **kwargs) -> None:
    if issubclass(category, UserWarning):  # about the input; other categories are for developers
        print(f"{PROG}: warning: {_one_line(message)}", file=sys.stderr)


def _run(args: argparse.Namespace) -> None:
    # Everything that needs no file is checked before a possibly large file is read.
    check_n_bins(args.bins)
    for option, path in (("--json", args.json), ("--markdown", args.markdown),
                         ("--plot", args.plot)):
        if path is not None and path.is_dir():
            raise CalibrationError(f"{option} {path} is a directory; give a file path")
    if args.plot is not None and args.plot.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise CalibrationError(f"--plot needs a .png, .svg or .pdf path; got {args.plot}")
    predictions = load_predictions(args.predictions, args.labels, logits=args.logits,
                                   label_key=args.label_key, client_key=args.client_key,
                                   max_bytes=args.max_bytes)
    result = report(predictions.scores, predictions.labels, predictions.client_ids,
                    n_bins=args.bins, binning=args.binning,
                    from_logits=predictions.from_logits)
    print(result)
    if args.json is not None:
        _write_text(args.json, result.to_json() + "\n")
        print(f"wrote {args.json}")
    if args.markdown is not None:
        _write_text(args.markdown, result.to_markdown() + "\n")
        print(f"wrote {args.markdown}")
    if args.plot is not None:
        result.plot(args.plot)
        print(f"wrote {args.plot}")


CLI_SPELLINGS = {"pass from_logits=True": "pass --logits"}
"""Advice the library words for Python callers -> the same advice in this command's flags."""


def _one_line(message: object) -> str:
    text = " ".join(str(message).split())  # one line, whatever the message held
    for python, flag in CLI_SPELLINGS.items():
        text = text.replace(python, flag)
    return text


def _fail(reason: str, code: int = 1) -> int:
    print(f"{PROG}: error: {reason}", file=sys.stderr)
    return code


def _write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    raise SystemExit(main())
