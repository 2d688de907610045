"""pertower: per-example gradients for TensorFlow graph mode, by per-op rules where they
provably apply and weight-copy towers elsewhere."""

from setuptools import find_packages, setup

setup(
    name="pertower",
    version="0.1.0",
    description=("Per-example gradients, Jacobians and microbatch gradients for "
                 "TensorFlow graph mode (tf.compat.v1.Session), without rewriting the model: "
                 "per-op rules where they provably apply, weight-copy towers elsewhere."),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["pertower", "pertower.*"]),
    python_requires=">=3.9",
    install_requires=[
        "tensorflow>=2.16",
        "tf-keras>=2.16",
        "numpy",
    ],
    extras_require={
        # Privacy accounting for pertower.compute_epsilon.
        "dp": ["dp-accounting>=0.4"],
        # The digits examples: real data (scikit-learn), progress bars, figures.
        "examples": ["dp-accounting>=0.4", "scikit-learn", "tqdm", "matplotlib"],
        # `pertower bench --plot`.
        "bench": ["matplotlib"],
        "test": ["pytest>=7", "hypothesis", "dp-accounting>=0.4", "scikit-learn",
                 "tqdm", "matplotlib"],
    },
    entry_points={"console_scripts": ["pertower=pertower.tools.cli:main"]},
)
