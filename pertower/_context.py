"""The public function a call came through, for error messages: every public function
runs inside `public(name)`, and the layers below put "pertower.NAME: " (the innermost
public call's) in front of their errors (`error`) and warnings (`prefixed`). A call
made with `public_call(name, hold=True)` keeps its name through the public functions it
calls (the Keras optimizers, whose errors name the Keras class, not the DPOptimizer
they use). Inside a `tf.function` a public call is not converted by AutoGraph and
builds with AutoGraph off and TF1's tensor equality (`_tf.built_as_written`).
"""

import contextlib
import contextvars
import functools

from pertower import _tf

__all__ = ["public", "public_call", "name", "prefix", "prefixed", "error"]

# The name of the innermost public function running in this context.
_CALLER = contextvars.ContextVar("pertower_public_call", default=None)
# True inside a `public_call(..., hold=True)`: inner public calls keep its name.
_HELD = contextvars.ContextVar("pertower_public_call_held", default=False)


@contextlib.contextmanager
def public_call(function_name, hold=False):
    """Runs the body as a call of the public function `function_name`; with hold=True
    the public functions it calls run under that name too."""
    if _HELD.get():
        yield
        return
    token, held = _CALLER.set(function_name), _HELD.set(hold)
    try:
        yield
    finally:
        _HELD.reset(held)
        _CALLER.reset(token)


def public(function_name, inner=True):
    """Decorator: the function runs as the public function `function_name`; with
    inner=False (a public method pertower also calls, `Towers.gradients`) only when no
    other public call is running."""

    def decorate(function):
        # inside a tf.function: not converted by AutoGraph, and built as written
        # (`_tf.built_as_written`)
        @_tf.not_converted
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            if not inner and _CALLER.get() is not None:
                return function(*args, **kwargs)
            with public_call(function_name), _tf.built_as_written():
                return function(*args, **kwargs)
        return wrapper

    return decorate


def name():
    """The innermost public function's name ("pertower" outside any public call)."""
    caller = _CALLER.get()
    return caller if caller is not None else "pertower"


def prefix():
    """"pertower.NAME" for the innermost public call, "pertower" outside any."""
    caller = _CALLER.get()
    return "pertower" if caller is None else f"pertower.{caller}"


def prefixed(text):
    return f"{prefix()}: {text}"


def error(kind, text):
    """The exception `kind` with the caller's prefix in front of `text`."""
    return kind(prefixed(text))
