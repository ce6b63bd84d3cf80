"""bayesfl's ServerApp, with the app's own strategy registered (importing its module is all)."""

import strategy_app.damped_fedavg  # noqa: F401 - registers "damped-fedavg"
from bayesfl.flower.server_app import app

__all__ = ["app"]
