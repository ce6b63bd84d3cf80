"""The ClientApp: bayesfl's, which trains on this SuperNode's partition (node_config
partition-id / num-partitions)."""

from bayesfl.flower.client_app import app

__all__ = ["app"]
