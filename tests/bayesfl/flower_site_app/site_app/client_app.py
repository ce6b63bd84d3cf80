"""bayesfl's ClientApp, unchanged."""

from bayesfl.flower.client_app import app

__all__ = ["app"]
