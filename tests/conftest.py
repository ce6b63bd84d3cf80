"""Shared test configuration: headless plotting (no display on CI machines)."""

import matplotlib

matplotlib.use("Agg")
