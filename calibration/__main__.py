"""``python -m calibration``: the same as the ``bayesfl-calibrate`` command."""

from calibration.cli import main

raise SystemExit(main())
