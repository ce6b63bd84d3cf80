"""The ServerApp: bayesfl's, which drives the strategy named in the run config."""

from bayesfl.flower.server_app import app

__all__ = ["app"]
