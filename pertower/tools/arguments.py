"""argparse types shared by the commands (`pertower demo`, `pertower explain`) and
`python -m benchmarks`."""

import argparse

__all__ = ["positive_int"]


def positive_int(text):
    """argparse type: a positive integer."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value
