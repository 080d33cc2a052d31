"""Test settings: strict rank promotion (jax_numpy_rank_promotion="raise") and float32 by default; on a
GPU, test workers (pytest-xdist, one per CPU) allocate device memory as they need it
instead of each reserving most of it."""
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# the CLI's on-disk compile cache in the home directory (fedjax-fair run) stays off
os.environ.setdefault("FEDJAX_FAIR_COMPILATION_CACHE", "off")
# instead, one on-disk XLA cache for this session only (the xdist workers and the
# tests' subprocesses inherit it, and it is removed at the end): tests build many
# identical programs from fresh closures, which jax's in-memory cache does not share
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile
    _cache = tempfile.mkdtemp(prefix="fedjax_fair_tests_xla_")
    atexit.register(shutil.rmtree, _cache, True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
