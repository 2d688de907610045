"""The batch-axis analysis: which entries of each tensor belong to which example, which
ops couple examples, and whether row i of `ys` depends on example i alone.

One forward analysis (`analyze`) serves the per-op rules (row layouts, `Analysis.rows`)
and the coupling checks of every method (`Analysis.couplings`, `find_couplings`). Modules:

    lattice           the values (Rows, INDEPENDENT, SIZE, UNKNOWN, ...), Coupling
    static            static values and shapes of small integer tensors, shape operands
    transfer_layout   elementwise ops, reshapes, axes, values shaped by the batch
    transfer_index    slices and gathers: entries picked by position or index
    transfer_compute  reductions, ops along axes, products, convolutions, normalizations
    transfer_blocks   SpaceToBatchND / BatchToSpaceND (dilated convolutions' blocks)
    transfer_lookups  partitioned and sparse lookups
    functions         If/While/calls, TensorLists, TF1 frames, loops over the examples
    size_uses         a size used as data or as a size; reductions that only bound loops
    loop_bounds       loops bounded by such a reduction, masked past each example's end
    analysis          the driver (one scan in graph order) and its table `TRANSFERS`
    verdict           the verdict (independent, coupled or unproven), joined batches

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
from pertower._batch_axis.static import parse_einsum
from pertower._batch_axis.static import static_value

__all__ = ["Analysis", "analyze", "find_couplings",
           "INDEPENDENT", "Interleaved", "SIZE", "UNKNOWN", "Coupling", "Rows",
           "parse_einsum", "static_value"]
