"""The transfer functions of lookups whose intermediate rows are data-dependent: a
partitioned table's DynamicPartition/DynamicStitch (`transfer_partition`) and a
SparseTensor's lookup built from the batch's dense ids (`transfer_sparse`). Each
matches its whole pattern at its last op and takes back the loss recorded inside it."""

from pertower._batch_axis import transfer_partition
from pertower._batch_axis import transfer_sparse

__all__ = ["TRANSFERS", "READS_UNKNOWN"]

TRANSFERS = dict(transfer_partition.TRANSFERS, **transfer_sparse.TRANSFERS)
READS_UNKNOWN = transfer_partition.READS_UNKNOWN | transfer_sparse.READS_UNKNOWN
