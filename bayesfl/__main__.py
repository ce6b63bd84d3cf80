"""``python -m bayesfl ...`` is the ``bayesfl`` command line."""

import sys

from bayesfl.cli import main

sys.exit(main())
