"""Data for federated experiments: pooled data sets, label partitions, per-client splits.

- `bayesfl.data.datasets`: `Dataset` (your own arrays: `Dataset.from_arrays`),
  [`as_dataset`][bayesfl.data.as_dataset], [`DATASETS`][bayesfl.data.DATASETS], `load_dataset`.
- `bayesfl.data.partition`: `partition` (schemes ``iid``, ``dirichlet:ALPHA``,
  ``shards:K``, ``per_class:N[:K]``), `PartitionScheme`, `partition_summary`,
  [`format_partition_summary`][bayesfl.data.format_partition_summary].
- `bayesfl.data.clients`: [`ClientData`][bayesfl.data.ClientData], `make_clients`.
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
