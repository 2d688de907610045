"""Which of TensorFlow's private ways pertower takes, and why not where it does not.

A *way* is a use of TensorFlow's private API with a public, slower fallback (`WAYS`,
docs/tensorflow_upgrade.md). `private_way(name)` probes once what the way relies on (the
names exist, each function takes the parameters pertower passes) and records a `Finding`,
so a changed TensorFlow takes the fallback with the reason on record instead of failing
deep in a build; `require` probes a private name with no public replacement and raises.

``PERTOWER_TF_FALLBACK`` (read at each call) forces fallbacks: ``1`` (or ``all``) every
way's, a comma-separated list of way names those; `forced_fallback(*names)` does the same
for a block (tests). `report()` lists the findings (`pertower explain` prints them); each
is logged once at debug level on the "pertower" logger.
"""

import contextlib
import inspect
import logging
import os
import warnings
from typing import NamedTuple

__all__ = ["ENV_VAR", "WAYS", "Finding", "fallback_reason", "forced_fallback", "private_way",
           "register", "report", "require", "has_parameters", "signature", "missing",
           "first_reason"]

ENV_VAR = "PERTOWER_TF_FALLBACK"

# way name -> (what the private way does, its fallback)
WAYS = {
    "loop_backward": ("per-step dZ and A of a TF2 while loop from its own backward "
                      "(while_v2's `_WhileGrad` rebuilt with pushes)",
                      "the loop's copy with zero inputs ε, differentiated by tf.gradients"),
    "while_edit": ("the edit a While gradient makes to the forward op, made without its "
                   "backward op (part of while_v2's `_WhileGrad`)",
                   "TensorFlow's registered While gradient, run whole in a scratch graph"),
    "loop_copy": ("rules for weights read in a while loop or a TF1 frame, through a copy "
                  "of the loop built from its body's ops",
                  "the weights stay on pertower's fallback method (towers or row passes)"),
    "one_sided_gradients": ("the gradient of a covered op's batch-side input alone "
                            "(an op's `_gradient_function` set while the backward is built)",
                            "the op's registered gradient (the weight's side too)"),
    "pfor": ("vectorized columns of the curvature products (parallel_for's `pfor`)",
             "tf.vectorized_map"),
    "op_order": ("ops sorted by creation (`Operation._id`)",
                 "the op's position in `graph.get_operations()`"),
    "create_op": ("an op created from a NodeDef's parts (`Graph._create_op_internal`)",
                  "tf.Graph.create_op"),
}

_LOG = logging.getLogger("pertower")


class Finding(NamedTuple):
    """The outcome of one probe: `way` (a name of `WAYS`, or a required private name),
    `private` (True: TensorFlow's private way is taken), `reason` (why not, or "")."""
    way: str
    private: bool
    reason: str


_probed = {}        # way -> Finding of the probe (made once)
_checks = {}        # way -> its check (`register`)
_forced = []        # stack of in-process forced sets (`forced_fallback`)
_warned = set()     # values of the environment variable warned about


def _forced_names():
    names = set()
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in ("1", "all", "true", "yes"):
        names.update(WAYS)
    elif value not in ("", "0", "false", "no"):
        names.update(part.strip() for part in value.split(",") if part.strip())
        unknown = sorted(names - set(WAYS))
        if unknown and value not in _warned:
            _warned.add(value)
            warnings.warn(f"{ENV_VAR}={value!r} names unknown way(s) {unknown}, which are "
                          f"ignored; use 1 (all) or names of {sorted(WAYS)}.", stacklevel=3)
    for forced in _forced:
        names.update(forced)
    return names


@contextlib.contextmanager
def forced_fallback(*names):
    """Forces the fallback of the ways `names` (all of `WAYS` when none is given) while
    the block runs, as ``PERTOWER_TF_FALLBACK`` does for a process.

    Raises:
      ValueError: a name that is not a way (the known ones are listed).
    """
    unknown = [name for name in names if name not in WAYS]
    if unknown:
        raise ValueError(f"forced_fallback: unknown way(s) {unknown}; pass names of "
                         f"{sorted(WAYS)}, or none for all.")
    _forced.append(frozenset(names or WAYS))
    try:
        yield
    finally:
        _forced.pop()


def register(name, check):
    """Makes `check` the probe of the way `name` (a key of `WAYS`): a function of no
    argument returning None when the private way can be taken, else the reason."""
    assert name in WAYS, name
    _checks[name] = check


def _probe(name, check):
    if name not in _probed:
        try:
            reason = check()
        except Exception as error:  # pylint: disable=broad-except  # any break is a fallback
            reason = f"probe failed ({type(error).__name__}: {error})"
        _probed[name] = Finding(name, reason is None, reason or "")
        _note(_probed[name])
    return _probed[name]


def private_way(name):
    """Whether the private way `name` is taken: not forced to its fallback, and its
    registered check (run once, its result kept) finds what the way relies on. Records
    and logs the finding."""
    if name in _forced_names():
        _note(Finding(name, False, f"forced by {ENV_VAR} or forced_fallback"))
        return False
    return _probe(name, _checks[name]).private


def require(name, check):
    """Records the probe of a private name pertower has no public replacement for
    (`check()` as for `private_way`, run once), and raises when it fails.

    Raises:
      RuntimeError: naming what is missing, the TensorFlow release and the tested range.
    """
    finding = _probe(name, check)
    if not finding.private:
        import tensorflow as tf   # pylint: disable=import-outside-toplevel
        raise RuntimeError(
            f"pertower needs TensorFlow's {name}, which this TensorFlow "
            f"({tf.__version__}) does not offer as expected: {finding.reason}. pertower is "
            "tested with TensorFlow >=2.16,<2.22; see docs/tensorflow_upgrade.md.")


_noted = set()


def _note(finding):
    if finding not in _noted:
        _noted.add(finding)
        _LOG.debug("TensorFlow seam: %s: %s%s", finding.way,
                   "private way" if finding.private else "fallback",
                   f" ({finding.reason})" if finding.reason else "")


def fallback_reason(name):
    """Why the private way `name` is not taken, as a plan's reason reads."""
    finding = next((f for f in report() if f.way == name), None)
    why = finding.reason if finding is not None else "not probed"
    return f"TensorFlow's private way {name!r} is not taken ({why})"


def report():
    """[Finding] by name: every way (probed now if not yet; a forced way reads as its
    fallback), and each required private name probed so far."""
    for name, check in _checks.items():
        _probe(name, check)
    forced = _forced_names()
    found = []
    for name in sorted(_probed):
        if name in forced and name in WAYS:
            found.append(Finding(name, False, f"forced by {ENV_VAR} or forced_fallback"))
        else:
            found.append(_probed[name])
    return found


def has_parameters(function, *names, label=None):
    """None when `function` (or a class's __init__) takes the parameters `names` in this
    order (after `self`), else why not (naming it `label`, else its qualified name): the
    signature check of a probe."""
    label = label or getattr(function, "__qualname__", repr(function))
    if function is None:
        return f"{label} is missing"
    try:
        parameters = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return None if callable(function) else "not callable"   # a builtin: name only
    if parameters and parameters[0] == "self":
        parameters = parameters[1:]
    if parameters[:len(names)] != list(names):
        return f"{label} takes {parameters}, not {list(names)}"
    return None


def signature(owner, name, *names):
    """`has_parameters` of the attribute `name` of `owner` (a module or class)."""
    owner_name = getattr(owner, "__name__", type(owner).__name__).rsplit(".", 1)[-1]
    return has_parameters(getattr(owner, name, None), *names, label=f"{owner_name}.{name}")


def missing(owner, *names):
    """None when `owner` has every attribute of `names`, else which are missing."""
    absent = [name for name in names if not hasattr(owner, name)]
    return f"{getattr(owner, '__name__', owner)} lacks {absent}" if absent else None


def first_reason(*reasons):
    """The first of `reasons` that is not None (a probe's checks in order), or None."""
    return next((reason for reason in reasons if reason is not None), None)
