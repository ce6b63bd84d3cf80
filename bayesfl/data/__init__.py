"""Data for federated experiments: pooled data sets, label partitions, per-client splits.

- :mod:`bayesfl.data.datasets`: :class:`Dataset` (your own arrays: :meth:`Dataset.from_arrays`),
  :func:`as_dataset`, :data:`DATASETS`, :func:`load_dataset`.
- :mod:`bayesfl.data.partition`: :func:`partition` (schemes ``iid``, ``dirichlet:ALPHA``,
  ``shards:K``, ``per_class:N[:K]``), :class:`PartitionScheme`, :func:`partition_summary`,
  :func:`format_partition_summary`.
- :mod:`bayesfl.data.clients`: :class:`ClientData`, :func:`make_clients`.
"""

from bayesfl.data.clients import ClientData, make_clients, stratified_split
from bayesfl.data.datasets import (
    DATASETS,
    Dataset,
    as_dataset,
    default_data_root,
    load_dataset,
)
from bayesfl.data.partition import (
    PARTITION_SCHEMES,
    PartitionScheme,
    assign_classes,
    format_partition_summary,
    partition,
    partition_summary,
)

__all__ = [
    "DATASETS",
    "PARTITION_SCHEMES",
    "ClientData",
    "Dataset",
    "PartitionScheme",
    "as_dataset",
    "assign_classes",
    "default_data_root",
    "format_partition_summary",
    "load_dataset",
    "make_clients",
    "partition",
    "partition_summary",
    "stratified_split",
]
