"""``bayesfl-calibrate``: a calibration report of saved predictions.

Examples::

    bayesfl-calibrate preds.npz                       # keys probs, labels[, client_ids]
    bayesfl-calibrate logits.pt --logits --json report.json --plot diagram.png
    bayesfl-calibrate scores.npy --labels labels.npy --bins 20 --binning quantile
    bayesfl-calibrate preds.csv --client-column site  # columns label, site, one per class

Prints a table (per client, pooled (micro), macro, sd over clients) and exits 0; on bad input
prints one line ``bayesfl-calibrate: error: <reason>`` to stderr and exits 1 (2 for bad
command-line usage).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from calibration.binning import Binning
from calibration.errors import CalibrationError
from calibration.prediction_files import load_predictions
from calibration.report import report

PROG = "bayesfl-calibrate"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Calibration report (ECE, MCE, Brier, NLL, accuracy) of saved predictions.",
        epilog="File layouts: .npz/.pt with 'probs' (or 'logits' with --logits), 'labels' and "
        "optional 'client_ids'; .npy with scores only (use --labels); .csv with a 'label' "
        "column, an optional 'client_id' column and one column per class.",
    )
    parser.add_argument("predictions", type=Path, help="prediction file (.npz, .npy, .pt, .csv)")
    parser.add_argument("--labels", type=Path, default=None,
                        help="separate labels file (.npy, .npz, .pt, .csv)")
    parser.add_argument("--bins", type=int, default=15, help="number of bins (default 15)")
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 success, 1 bad input, 2 bad usage)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse already printed its usage message
        return int(exit_.code or 0)
    try:
        if args.plot is not None and args.plot.suffix.lower() not in (".png", ".svg", ".pdf"):
            raise CalibrationError(f"--plot needs a .png, .svg or .pdf path; got {args.plot}")
        predictions = load_predictions(args.predictions, args.labels, logits=args.logits,
                                       label_key=args.label_key, client_key=args.client_key)
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
    except (CalibrationError, OSError) as err:
        reason = " ".join(str(err).split())  # one line, whatever the message held
        print(f"{PROG}: error: {reason}", file=sys.stderr)
        return 1
    return 0


def _write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    raise SystemExit(main())
