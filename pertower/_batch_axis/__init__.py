"""The batch-axis analysis: which entries of each tensor belong to which example, which
ops couple examples, and whether row i of `ys` depends on example i alone.

One forward analysis (`analyze`) serves the per-op rules (row layouts, `Analysis.rows`)
and the coupling checks of every method (`Analysis.couplings`, `find_couplings`). Modules:

    lattice           the values (Rows, INDEPENDENT, SIZE, UNKNOWN), Coupling
    static            static values and shapes of small integer tensors
    transfer_layout   elementwise ops, reshapes, axes, values shaped by the batch
    transfer_index    slices and gathers: entries picked by position or index
    transfer_compute  reductions, products, convolutions, normalizations, losses
    transfer_blocks   SpaceToBatchND / BatchToSpaceND (dilated convolutions' blocks)
    functions         If/While/calls, TensorLists, v1 Switch/Merge
    bounds            reductions over the batch that only size shapes or bound loops
    joined            several batches joined along the batch axis
    size_uses         a size used as data (the whole batch's B) or as a size, index
                      or range (the tower's own), and the row index tf.range(n)
    analysis          the driver (one scan in graph order), size data edges
    verdict           the verdict: independent, coupled or unproven

The op types it tells apart are named in `pertower._op_types`.
"""

from pertower._batch_axis.verdict import Analysis
from pertower._batch_axis.analysis import analyze
from pertower._batch_axis.analysis import find_couplings
from pertower._batch_axis.lattice import INDEPENDENT
from pertower._batch_axis.lattice import Interleaved
from pertower._batch_axis.lattice import SIZE
from pertower._batch_axis.lattice import UNKNOWN
from pertower._batch_axis.lattice import Coupling
from pertower._batch_axis.lattice import Rows
from pertower._batch_axis.lattice import complete
from pertower._batch_axis.static import parse_einsum
from pertower._batch_axis.static import refined_reshape_shape
from pertower._batch_axis.static import static_value

__all__ = ["Analysis", "analyze", "find_couplings",
           "INDEPENDENT", "Interleaved", "SIZE", "UNKNOWN", "Coupling", "Rows", "complete",
           "parse_einsum", "refined_reshape_shape", "static_value"]
