"""Test settings: strict rank promotion (DESIGN.md §9) and float32 by default; on a
GPU, test workers (pytest-xdist, one per CPU) allocate device memory as they need it
instead of each reserving most of it."""
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# the CLI's on-disk compile cache (fedjax-fair run) stays off: every test compiles
# afresh, as on CI's clean machine, and nothing is written to the home directory
os.environ.setdefault("FEDJAX_FAIR_COMPILATION_CACHE", "off")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
