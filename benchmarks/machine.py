"""The machine the figures come from: its description, and the memory available now,
against which the bench skips a row that would not fit (B x P x 4 bytes can exceed it at
large B)."""

import datetime
import os
import platform

import numpy as np
import tensorflow as tf
import tf_keras as keras

import pertower
from pertower.tools import environment

__all__ = ["VMAP_MEMORY_SHARE", "MATERIALIZED_MEMORY_SHARE", "available_memory_bytes",
           "too_big", "machine_info"]

# tf.vectorized_map's backward pass holds about B copies of the batch's activations:
# it is skipped when B times the batch gradient's peak (or twice its B per-example
# gradients) exceeds this share of the memory available when it is about to be built.
VMAP_MEMORY_SHARE = 0.25
# Entries that hold the B per-example gradients (B x P x 4 bytes; towers hold them
# twice) are skipped when twice that exceeds this share of the memory available when
# they are about to run; a whole (model, B) is skipped when the loop's reference
# (stacked from B rows: twice) does not fit in it.
MATERIALIZED_MEMORY_SHARE = 0.3


def available_memory_bytes():
    """MemAvailable from /proc/meminfo (Linux), or None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def too_big(needed_bytes, share, what):
    """A reason to skip an entry when `needed_bytes` exceed `share` of the memory
    available now, else an empty string."""
    available = available_memory_bytes()
    if available is None or needed_bytes <= share * available:
        return ""
    return (f"{what}: about {needed_bytes / 2**30:.1f} GiB, more than {share:.0%} of the "
            f"{available / 2**30:.1f} GiB available")



def machine_info():
    """A dict describing the machine and software the figures come from."""
    cpu_model = platform.processor() or ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    available = available_memory_bytes()
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable,
        "cpu_model": cpu_model,
        "load_average_1_5_15": list(load) if load else None,
        "memory_available_gib": round(available / 2**30, 1) if available else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "tf_keras": keras.__version__,
        "numpy": np.__version__,
        "pertower": pertower.__version__,
        "pertower_folder": os.path.dirname(os.path.abspath(pertower.__file__)),
        "cpu_speed": environment.cpu_facts(),
    }
