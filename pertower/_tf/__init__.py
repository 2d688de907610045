"""pertower's one seam to TensorFlow's private API.

Only this package imports `tensorflow.python` modules or touches private attributes of
TensorFlow objects; the rest of pertower asks it by name. `probe` holds the switch
(``PERTOWER_TF_FALLBACK``, `forced_fallback`) and the record of which private way is
taken (`report`); `graphs` the op, graph and function accessors; `while_loops` the
pieces of while_v2's While gradient that pertower rebuilds; `list_ops` the TensorList
ops. docs/tensorflow_upgrade.md lists every private name, why, and its fallback.
"""

from pertower._tf import list_ops
from pertower._tf.graphs import *  # noqa: F401,F403  pylint: disable=wildcard-import
from pertower._tf.probe import (ENV_VAR, WAYS, Finding, fallback_reason, forced_fallback,
                                report)
from pertower._tf.while_loops import *  # noqa: F401,F403  pylint: disable=wildcard-import
from pertower._tf import graphs as _graphs
from pertower._tf import while_loops as _while_loops

__all__ = (["list_ops", "ENV_VAR", "WAYS", "Finding", "fallback_reason", "forced_fallback",
            "report"]
           + _graphs.__all__ + _while_loops.__all__)
