"""bayesfl's ServerApp, unchanged."""

from bayesfl.flower.server_app import app

__all__ = ["app"]
