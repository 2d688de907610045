"""The version of pertower, in one place: read by setup.py (without importing the
package or TensorFlow), `pertower.__version__` and `pertower --version`."""

__all__ = ["__version__"]

__version__ = "0.1.0"
