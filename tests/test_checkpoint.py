"""Checkpoint writers and readers (fedjax_fair/drivers/checkpoint.py): round trips of
typed keys, bfloat16 and server states, header checks, mismatched templates, and
damaged files named in one-line errors.

The federation is helpers.tiny_federation(): 6 clients, 10 features, 3 classes,
train sizes (7, 12, 0, 3, 9, 5) padded to M = 12, client 2 empty.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from helpers import (ENGINE_MODEL as MODEL, ENGINE_PARAMS as PARAMS, ENGINE_N as N, ENGINE_B as B,
                     vmap_round as _vmap_round, seq_fedavg as _seq_fedavg, _garbage, _cut_in_half,
                     _npy_not_npz, newest_file as _newest_file)
from fedjax_fair.drivers import checkpoint as ckpt
from fedjax_fair.core.algorithm import ServerState
from fedjax_fair.algorithms import ALGORITHMS
from fedjax_fair.core.client import ClientTraining


def test_checkpoint_roundtrip_with_typed_key(tmp_path):
    key = jax.random.key(3)
    state = {"w": jnp.arange(6.0).reshape(2, 3), "step": jnp.int32(7),
             "mask": jnp.array([True, False]), "key": key,
             "nested": (jnp.ones((2,), jnp.float16), ())}
    directory = str(tmp_path / "c")
    ckpt.save(directory, state, {"round": 7, "history": [{"round": 0, "mean": 0.5}]})
    assert ckpt.exists(directory)
    template = jax.tree.map(jnp.zeros_like, {k: v for k, v in state.items() if k != "key"})
    template["key"] = jax.random.key(0)
    restored, meta = ckpt.restore(directory, template)
    assert meta == {"round": 7, "history": [{"round": 0, "mean": 0.5}]}
    assert jnp.issubdtype(restored["key"].dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(restored["key"]),
                                  jax.random.key_data(key))
    np.testing.assert_array_equal(jax.random.normal(restored["key"], (3,)),
                                  jax.random.normal(key, (3,)))
    for name in ("w", "step", "mask", "nested"):
        chex.assert_trees_all_equal(restored[name], state[name])
        chex.assert_trees_all_equal_dtypes(restored[name], state[name])


def test_checkpoint_verify_reads_shapes_from_headers(tmp_path):
    state = {"w": jnp.arange(6.0).reshape(2, 3), "key": jax.random.key(3),
             "h": jnp.ones((4,), jnp.bfloat16), "n": jnp.int32(2)}
    directory = str(tmp_path / "c")
    ckpt.save(directory, state, {"history": []})
    ckpt.verify(directory, jax.eval_shape(lambda: state))  # abstract template: passes
    ckpt.verify(directory, state)
    for bad in ({**state, "w": jnp.zeros((3, 2))}, {**state, "n": jnp.float32(2)},
                {**state, "extra": jnp.zeros(())}):
        with pytest.raises(ValueError, match="^checkpoint: "):
            ckpt.verify(directory, jax.eval_shape(lambda b=bad: b))


def test_checkpoint_roundtrip_with_bfloat16_leaf(tmp_path):
    """bf16 is the documented memory-aware form of per-client tables (docs/architecture.md),
    so a checkpoint must restore it. NumPy has no bfloat16: np.savez writes such a
    leaf as raw void bytes (|V2), which restore() then rejects as a dtype mismatch."""
    state = {"table": jnp.arange(6.0, dtype=jnp.bfloat16).reshape(3, 2)}
    directory = str(tmp_path / "bf16")
    ckpt.save(directory, state, {})
    restored, _ = ckpt.restore(directory, {"table": jnp.zeros((3, 2), jnp.bfloat16)})
    assert restored["table"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(restored["table"], np.float32),
                                  np.arange(6.0).reshape(3, 2))


def test_checkpoint_roundtrip_of_server_state(tmp_path):
    alg = helpers.bind_execution(ALGORITHMS["fedadam"](MODEL,
                                                       training=ClientTraining(batch_size=B)), "vmap")
    template = alg.init(PARAMS, N)
    # A state with non-trivial values in every leaf (params, adam count / moments).
    state = jax.tree.map(lambda x: x + jnp.ones_like(x), template)
    state = state._replace(params=_vmap_round()[0].params)
    directory = str(tmp_path / "s")
    ckpt.save(directory, state, {})
    restored, _ = ckpt.restore(directory, alg.init(PARAMS, N))
    assert isinstance(restored, ServerState)
    chex.assert_trees_all_equal(restored, state)


def test_checkpoint_mismatched_template_raises(tmp_path):
    directory = str(tmp_path / "c")
    ckpt.save(directory, {"w": jnp.zeros((2, 3)), "b": jnp.zeros((3,))}, {})
    with pytest.raises(ValueError):
        ckpt.restore(directory, {"w": jnp.zeros((3, 2)), "b": jnp.zeros((3,))})
    with pytest.raises(ValueError):
        ckpt.restore(directory, {"w": jnp.zeros((2, 3), jnp.int32), "b": jnp.zeros((3,))})
    with pytest.raises(ValueError):
        ckpt.restore(directory, {"w": jnp.zeros((2, 3))})
    with pytest.raises(FileNotFoundError):
        ckpt.restore(str(tmp_path / "missing"), {"w": jnp.zeros((2, 3))})


# reference_run (tests/conftest.py) is a checkpointed run whose round-4 save the
# damaged-file cases copy (as in tests/test_runner.py).


@pytest.mark.parametrize("name,damage", [
    ("state.npz", _garbage), ("state.npz", _cut_in_half), ("state.npz", _npy_not_npz),
    ("meta.json", _garbage), ("meta.json", lambda p: p.write_text("[1, 2]")),
    ("client_history", _garbage), ("client_history", _cut_in_half)],
    ids=lambda v: getattr(v, "__name__", v))
def test_checkpoint_readers_name_the_damaged_file(reference_run, tmp_path, name, damage):
    """verify (headers only), restore, read_meta and load_arrays raise
    ``ValueError("checkpoint: ...")`` naming the file, not numpy / zipfile / json
    errors; exists only says whether the files are there."""
    directory = tmp_path / "ckpt"
    shutil.copytree(reference_run[2], directory)
    template = _seq_fedavg().init(PARAMS, N)
    ckpt.verify(str(directory), template)  # the intact copy passes
    damage(_newest_file(directory, name))
    assert ckpt.exists(str(directory))
    readers = {"state.npz": [lambda d: ckpt.restore(d, template)],
               "meta.json": [ckpt.read_meta, lambda d: ckpt.restore(d, template)],
               "client_history": [lambda d: ckpt.load_arrays(d, name)]}[name]
    for read in [lambda d: ckpt.verify(d, template), *readers]:
        with pytest.raises(ValueError, match="^checkpoint: ") as info:
            read(str(directory))
        assert name in str(info.value)


def test_checkpoint_without_meta_is_not_found(tmp_path):
    directory = tmp_path / "c"
    ckpt.save(str(directory), {"w": jnp.zeros(2)}, {})
    (Path(ckpt.latest(str(directory))) / "meta.json").unlink()
    assert not ckpt.exists(str(directory))
    with pytest.raises(FileNotFoundError):
        ckpt.read_meta(str(directory))
    with pytest.raises(FileNotFoundError):
        ckpt.verify(str(directory), {"w": jnp.zeros(2)})
    assert ckpt.load_arrays(str(directory), "absent.npz") == {}


def test_roll_back_makes_an_earlier_kept_save_the_newest(tmp_path):
    """``roll_back(dir, r)``: the kept save of round r becomes the newest (the later
    ones retired), a round without a kept save changes nothing and says so, round 0 is
    always possible (a fresh start), and a retired save left by a crash is cleared by
    the next save."""
    d = str(tmp_path / "ck")
    for r in (0, 2, 4):  # KEEP = 2: rounds 2 and 4 stay
        ckpt.save(d, {"x": jnp.full((2,), float(r))}, {"round": r})
    assert ckpt.read_meta(d)["round"] == 4
    assert ckpt.roll_back(d, 0) is True  # a fresh start: nothing to do
    assert ckpt.read_meta(d)["round"] == 4
    assert ckpt.roll_back(d, 3) is False and ckpt.read_meta(d)["round"] == 4
    assert ckpt.roll_back(d, 2) is True
    assert ckpt.read_meta(d)["round"] == 2
    state, _ = ckpt.restore(d, {"x": jnp.zeros((2,))})
    np.testing.assert_array_equal(state["x"], [2.0, 2.0])
    (Path(d) / "tmp.retired-00000009").mkdir()  # as a crash between rename and removal
    ckpt.save(d, {"x": jnp.full((2,), 6.0)}, {"round": 6})
    assert not any(p.name.startswith("tmp.") for p in Path(d).iterdir())
    assert ckpt.read_meta(d)["round"] == 6


def test_an_unmerged_log_keeps_a_segment_per_save_and_is_read_in_blocks(tmp_path):
    """A client table's rows (``unmerged``): every save adds its own segment, carried
    whole into the next save, and ``log_segments`` reads them oldest first in blocks
    of at most ``rows`` rows; a truncated segment is a ``checkpoint:`` error."""
    d = str(tmp_path / "ck")
    saves = [np.arange(5), np.arange(5, 12), np.arange(12, 15)]
    for i, ids in enumerate(saves):
        ckpt.save(d, {"x": np.zeros(1)}, {"round": i},
                  logs={"rows": {"client": ids.astype(np.int32),
                                 "leaf": np.stack([ids, -ids], 1).astype(np.float32)}},
                  fresh=i == 0, unmerged=("rows",))
    blocks = list(ckpt.log_segments(d, "rows", rows=4))
    assert [len(b["client"]) for b in blocks] == [4, 1, 4, 3, 3]
    np.testing.assert_array_equal(np.concatenate([b["client"] for b in blocks]), np.arange(15))
    np.testing.assert_array_equal(np.concatenate([b["leaf"] for b in blocks])[:, 1],
                                  -np.arange(15))
    step = Path(ckpt.latest(d)) / "rows"
    last = sorted(step.iterdir())[-1]
    data = last.read_bytes()
    last.unlink()  # (a hard link to the save that wrote it)
    last.write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match="checkpoint"):
        list(ckpt.log_segments(d, "rows"))
