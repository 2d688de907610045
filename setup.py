"""pertower: per-example gradients for TensorFlow graph mode, by per-op rules where they
provably apply and weight-copy towers elsewhere."""

import os
import re

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def read_version():
    """pertower/_version.py's __version__, read as text: setup.py imports neither
    pertower nor TensorFlow."""
    with open(os.path.join(HERE, "pertower", "_version.py"), encoding="utf-8") as handle:
        match = re.search(r'^__version__ = "([^"]+)"$', handle.read(), re.M)
    if match is None:
        raise RuntimeError("pertower/_version.py holds no __version__ = \"...\" line")
    return match.group(1)


with open(os.path.join(HERE, "README.md"), encoding="utf-8") as readme:
    LONG_DESCRIPTION = readme.read()

setup(
    name="pertower",
    version=read_version(),
    description=("Per-example gradients, Jacobians and microbatch gradients for "
                 "TensorFlow graph mode (tf.compat.v1.Session), without rewriting the model: "
                 "per-op rules where they provably apply, weight-copy towers elsewhere."),
    long_description=LONG_DESCRIPTION,
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Intended Audience :: Developers",
        "Intended Audience :: Science/Research",
        "License :: OSI Approved :: Apache Software License",
        "Operating System :: OS Independent",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Topic :: Software Development :: Libraries :: Python Modules",
    ],
    packages=find_packages(include=["pertower", "pertower.*"]),
    python_requires=">=3.9",
    # The TensorFlow releases pertower is tested on: it reaches into TensorFlow's private
    # API through one seam (pertower/_tf), which docs/tensorflow_upgrade.md describes with
    # what to check before raising the upper bound.
    install_requires=[
        "tensorflow>=2.16,<2.22",
        "tf-keras>=2.16,<2.22",
        "numpy",
    ],
    extras_require={
        # Privacy accounting for pertower.compute_epsilon.
        "dp": ["dp-accounting>=0.4"],
        # The digits examples: real data (scikit-learn), progress bars, figures.
        "examples": ["dp-accounting>=0.4", "scikit-learn", "tqdm", "matplotlib"],
        # The README's test command runs in two processes (pytest-xdist's -n 2).
        "test": ["pytest>=7", "pytest-xdist>=3", "hypothesis", "dp-accounting>=0.4",
                 "scikit-learn", "tqdm", "matplotlib"],
    },
    entry_points={"console_scripts": ["pertower=pertower.tools.cli:main"]},
)
