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

# compiling dominates the suite (its programs are small and run briefly; about 85% of
# the summed test time is tracing, lowering and compiling). Two XLA:CPU settings cut
# the compile time in half; the HLO passes (the programs' structure, fusions and memory
# plans) are unchanged:
# - the LLVM backend at optimisation level 0 (about 30% faster);
# - the classic elemental emitters for fusions instead of the MLIR fusion emitters
#   (xla_cpu_use_fusion_emitters=false; about 2x faster again on the round programs).
# Results agree with the defaults' to float rounding (no fused multiply-adds: ~1e-7
# relative), and every test compares runs made with one setting. Tests only: the
# library and the benchmarks compile with XLA's defaults.
# Only without an accelerator plugin (jax_plugins: CUDA, ROCm, ...): a GPU jaxlib's XLA
# may not know the CPU flags, and an unknown flag in XLA_FLAGS is fatal (jax 0.11.2 on an
# H200 exited pytest with status 1 and no output).
import importlib.util  # noqa: E402

_FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
if importlib.util.find_spec("jax_plugins") is None:
    _flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = " ".join(
        [_flags] + [f for f in _FAST_COMPILE if f.split("=")[0] not in _flags]).strip()

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

import numpy as np  # noqa: E402
import pytest  # noqa: E402


# -------------------------------- shared fixtures (found by name; no import needed)

# test_qffl, test_term, test_afl, test_propfair, test_fedmax, test_simplex


@pytest.fixture
def rng():
    return np.random.default_rng(0)


# test_runner, test_checkpoint (the damaged-file cases copy its round-4 save)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """An uninterrupted 5-round run in chunks of 2, 2, 1 with checkpoints.

    Returns (result, number of traces of the round function, a copy of the round-4
    checkpoint). The copy is taken from the ``on_eval`` callback, whichever of the
    callback and the save comes first.
    """
    import shutil

    import helpers
    from fedjax_fair.drivers import checkpoint as ckpt

    alg, count = helpers.counting(helpers.seq_fedavg())
    directory = str(tmp_path_factory.mktemp("reference") / "ckpt")
    snapshot = str(tmp_path_factory.mktemp("snapshot") / "ckpt")
    template = alg.init(helpers.ENGINE_PARAMS, helpers.ENGINE_N)

    def on_eval(entry):
        if ckpt.exists(directory):
            restored, _ = ckpt.restore(directory, template)
            if int(restored.round) == 4 and not os.path.exists(snapshot):
                shutil.copytree(directory, snapshot)

    result = helpers.engine_run(alg, checkpoint_dir=directory, on_eval=on_eval)
    return result, count[0], snapshot


# ------------------------------------------------- the order in which files are handed out

# pyproject's addopts run each file on one xdist worker (--dist loadfile) in collection
# order (--no-loadscope-reorder: xdist would otherwise hand out the files with the most
# tests first, leaving long files of few tests, such as test_readme.py, to the end). The
# longest files go first, so that the short ones fill in at the end and the two workers
# finish together; the rest keep their alphabetical order. Costs measured on a 2-core CPU.
LONGEST_FILES_FIRST = (  # by the summed test times of one full run (--junitxml)
    "test_store.py",
    "test_store_compare.py",
    "test_notebooks.py",
    "test_traced.py",
    "test_cli_run.py",
    "test_sharding.py",
    "test_aaggff.py",
    "test_aaggff_mixing.py",
    "test_aggregators.py",
    "test_apfl_pfedme.py",
    "test_dqn_fed.py",
    "test_dqn_fed_server.py",
    "test_second_order.py",
    "test_resnet.py",
    "test_runner.py",
    "test_system.py",
    "test_fedevg.py",
    "test_cli_compare.py",
    "test_docs_snippets.py",
    "test_readme.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable
