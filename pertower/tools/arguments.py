"""argparse types shared by the commands (`pertower demo`, `pertower explain`) and
`python -m benchmarks`."""

import argparse

from pertower.tools import environment

__all__ = ["positive_int", "assignment"]


def positive_int(text):
    """argparse type: a positive integer."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def assignment(text):
    """argparse type: NAME=VALUE -> (NAME, VALUE)."""
    try:
        return environment.parse_assignment(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
