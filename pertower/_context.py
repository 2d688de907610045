"""The public function a call came through, for error messages.

Every public function runs inside `public(name)`; the layers below it name that
function in their errors and warnings through one helper, `error(kind, text)` (or
`prefixed(text)` for a warning's text), which puts "pertower.NAME: " in front, instead
of taking the name as a parameter. The innermost public call wins: an error raised
while `DPOptimizer.compute_gradients` runs `per_example_norms` names
`per_example_norms`, whose argument it is about.
"""

import contextlib
import contextvars
import functools

__all__ = ["public", "public_call", "name", "prefix", "prefixed", "error"]

# The name of the innermost public function running in this context.
_CALLER = contextvars.ContextVar("pertower_public_call", default=None)


@contextlib.contextmanager
def public_call(function_name):
    """Runs the body as a call of the public function `function_name`."""
    token = _CALLER.set(function_name)
    try:
        yield
    finally:
        _CALLER.reset(token)


def public(function_name, inner=True):
    """Decorator: the function runs as the public function `function_name`.

    With inner=False (a public method that pertower's own functions also call, such as
    `Towers.gradients` inside `per_example_gradients`) it names itself only when no
    other public call is running, so errors name the function the user called."""

    def decorate(function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            if not inner and _CALLER.get() is not None:
                return function(*args, **kwargs)
            with public_call(function_name):
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
    """`text` with the caller's prefix: "pertower.NAME: text" (for warnings)."""
    return f"{prefix()}: {text}"


def error(kind, text):
    """The exception `kind` (ValueError, TypeError, ...) with the caller's prefix in
    front of `text`; `raise _context.error(ValueError, "...")`."""
    return kind(prefixed(text))
