"""The process environment the tools set up, and the CPU facts that decide their speed.

Nothing here imports TensorFlow at module level. The SPEED_VARIABLES are read at process
start, so they must be set before Python starts: MALLOC_MMAP_THRESHOLD_ and
MALLOC_TRIM_THRESHOLD_ raised (glibc keeps large buffers instead of page-faulting them
every sess.run), MALLOC_ARENA_MAX=1 (one arena, kept by TensorFlow's threads too),
LD_PRELOAD (another allocator), TF_ENABLE_ONEDNN_OPTS (oneDNN kernels, 0 off, 1 on; on
by default for Linux x86 builds: convolution speeds change several-fold).
"""

import contextlib
import os
import re
import sys
import tempfile

__all__ = ["TF_DEFAULTS", "SPEED_VARIABLES", "prepare_tensorflow", "quiet_native_logs",
           "cpu_facts", "describe_cpu_facts", "graph_mode_tensorflow"]

# Set unless the user set them: C++ log level 2 (errors only), Keras 2 (tf.compat.v1.layers).
TF_DEFAULTS = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_USE_LEGACY_KERAS": "1"}

SPEED_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX",
                   "LD_PRELOAD", "TF_ENABLE_ONEDNN_OPTS")

# Lines TensorFlow's profiler and start-up write to fd 2 through C++/absl logging
# even when asked to be quiet (they say nothing about the user's results).
_NOISE = re.compile(
    r"Profiler session|GPU trace was not collected|CUPTI|cuInit|cuda drivers|"
    r"absl::InitializeLog|oneDNN custom operations|cpu_feature_guard|"
    r"rebuild TensorFlow with the appropriate compiler flags|Unable to register cu|"
    r"computation placer|TF-TRT Warning|^\s*$")


def prepare_tensorflow(environ=None):
    """Sets TF_DEFAULTS in `environ` (default os.environ) where the user set nothing,
    before TensorFlow is imported; returns the names it set."""
    environ = os.environ if environ is None else environ
    set_here = []
    for name, value in TF_DEFAULTS.items():
        if name not in environ:
            environ[name] = value
            set_here.append(name)
    return set_here


@contextlib.contextmanager
def quiet_native_logs():
    """Collects what native code writes to file descriptor 2 inside the block and,
    after it, writes back every line except TensorFlow's profiler, CUDA-probe and
    start-up noise (so real errors still reach the user). Python's `sys.stderr`, when
    it writes to fd 2, keeps writing to the terminal meanwhile. Blocks may nest."""
    absl_logging = sys.modules.get("absl.logging")   # absl's Python logging: errors only
    if absl_logging is not None:
        absl_logging.set_verbosity(absl_logging.ERROR)
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:   # no fd 2 (embedded interpreters): nothing to redirect
        yield
        return
    python_stderr = sys.stderr
    live = None
    if _writes_to_fd2(python_stderr):
        live = os.fdopen(os.dup(saved), "w", buffering=1, encoding="utf-8",
                         errors="replace")
        sys.stderr = live
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            if live is not None:
                live.flush()
                sys.stderr = python_stderr
                live.close()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [line for line in captured.read().decode("utf-8", "replace").splitlines()
                    if not _NOISE.search(line)]
            if kept:
                print("\n".join(kept), file=sys.stderr, flush=True)


def _writes_to_fd2(stream):
    try:
        return stream.fileno() == 2
    except (AttributeError, OSError, ValueError):
        return False


def cpu_facts(environ=None):
    """What decides CPU speed, as a JSON-ready dict: the SPEED_VARIABLES as set (None
    when unset), whether the CPU has AVX-512 (Linux /proc/cpuinfo flags; None when
    unknown) and whether TensorFlow's oneDNN kernels are on in this process (None
    before TensorFlow is imported)."""
    environ = os.environ if environ is None else environ
    facts = {name: environ.get(name) for name in SPEED_VARIABLES}
    flags = _cpu_flags()
    facts["avx512"] = None if flags is None else any(f.startswith("avx512") for f in flags)
    facts["avx512_vnni"] = None if flags is None else "avx512_vnni" in flags
    facts["onednn_enabled"] = None
    if "tensorflow" in sys.modules:
        from pertower import _tf   # pylint: disable=import-outside-toplevel
        facts["onednn_enabled"] = _tf.onednn_enabled()
    return facts


def describe_cpu_facts(facts):
    """One line for the tools' headers from `cpu_facts()`."""
    variables = ", ".join(f"{name}={facts[name] if facts[name] is not None else '(unset)'}"
                          for name in SPEED_VARIABLES)
    avx = {True: "yes", False: "no", None: "unknown"}[facts["avx512"]]
    onednn = {True: "on", False: "off", None: "unknown"}[facts["onednn_enabled"]]
    return f"{variables}; AVX-512: {avx}; TensorFlow oneDNN: {onednn}"


def _cpu_flags():
    """The CPU's feature flags from /proc/cpuinfo, or None where it is not readable."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def graph_mode_tensorflow():
    """`prepare_tensorflow`, then imports TensorFlow (its start-up lines, written before
    absl logging reads TF_CPP_MIN_LOG_LEVEL, kept off the terminal) and switches to graph
    mode; returns the `tensorflow` module."""
    prepare_tensorflow()
    with quiet_native_logs():
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

    tf.compat.v1.disable_eager_execution()
    return tf
