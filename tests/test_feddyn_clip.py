"""Gradient clipping of FedDyn and FedSpeed as their authors clip (issue 47): the
penalty's linear part clipped with the loss's gradient, alpha theta added after the
clip as weight decay (``families.primal_dual.clip_split``; the module docstrings of
feddyn.py / fedspeed.py give the reason and the sources).

The float64 NumPy reference below is written by hand from the authors' code:

* FedDyn: ``client/feddyn.py`` + ``server/FedDyn.py`` of the A-FedPD author's
  FL-Simulator (github.com/woodenchild95/FL-Simulator), the same step as
  ``train_feddyn_mdl`` of FedDyn's own code (github.com/alpemreacar/FedDyn,
  utils_general.py): ``loss = CE + lamb * <theta, h_i - theta^t>``, ``backward()``,
  ``clip_grad_norm_(max_norm)``, ``SGD(weight_decay=wd + lamb).step()``; after the
  local run h_i += theta_i - theta^t; theta^{t+1} = mean_cohort(theta_i) + mean_N(h).
* FedSpeed: ``client/fedspeed.py`` + ``optimizer/ESAM.py`` + ``server/FedSpeed.py`` of
  the same simulator: ESAM's gradient at theta + r g0 / (||g0|| + 1e-7) (g0 the loss's
  gradient at theta), then ``loss_correct.backward()`` adds lamb (h_i - theta^t), the
  clip, and the base ``SGD(weight_decay=wd + lamb)`` step; the same server.

The library's duals are lambda_i = lamb h_i (primal_dual.py). Full-batch clients
(B = 12 >= every client's size), so the simulator's shuffled loader gives the same
steps; the learning rate is constant (the simulator's ``lr_decay=1``). The JAX side
runs in float32 and matches the reference to ~1e-6.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from helpers import (ALG_MODEL as MODEL, ALG_PARAMS as PARAMS, ALG_TRAIN as TRAIN, ALG_N as N,
                     ALG_KEY as KEY, ALG_FULL_BATCH as FULL_BATCH, sequential as _seq)
from fedjax_fair.algorithms.families.primal_dual import (augmented_lagrangian, clip_split,
                                                         dual_ascent, primal_dual)
from fedjax_fair.algorithms.feddyn import feddyn
from fedjax_fair.algorithms.fedspeed import fedspeed
from fedjax_fair.core.client import ClientTraining, local_training
from fedjax_fair.core.types import Broadcast

LR, WD, LAMB, STEPS = 0.3, 0.05, 0.4, 3
SAM_R, SAM_EPS = 0.2, 1e-7  # the simulator's ESAM divides by ||g0|| + 1e-7
COHORTS = ((0, 1, 4), (1, 3, 5), (0, 4, 5), (1, 3, 4))  # client 2 (empty) never sampled


# ------------------------------------------------------------------ NumPy reference


def _flat(params):
    w, b = helpers.logreg_to_numpy(params)
    return np.concatenate([w.ravel(), b])


def _grad(theta, x, y, shape):
    """Gradient of the mean cross-entropy at the flat (W, b) ``theta``, flat."""
    w, b = theta[:-shape[1]].reshape(shape), theta[-shape[1]:]
    gw, gb = helpers.logreg_grad_numpy(w, b, x, y)
    return np.concatenate([gw.ravel(), gb])


def _clip(g, c):
    """``torch.nn.utils.clip_grad_norm_`` without its 1e-6 (the library's rule)."""
    norm = np.linalg.norm(g)
    return g * min(1.0, c / norm), norm


def authors_local(theta_t, h_i, x, y, shape, c, sam, form="authors"):
    """The simulator's local run of one client: STEPS steps from theta^t. ``form``
    "authors": g + lamb (h_i - theta^t) clipped, then + (wd + lamb) theta (the
    optimizer's weight decay); "whole": the whole penalty inside the clip,
    clip(g + lamb h_i + lamb (theta - theta^t)) + wd theta (the rest of the family).
    Returns (theta_K, the norms the clip saw)."""
    correction = h_i - theta_t  # the server's Local_dual_correction
    theta, norms = theta_t.copy(), []
    for _ in range(STEPS):
        if sam:  # ESAM.step(): first_step at the loss's gradient, then the loss's again
            g0 = _grad(theta, x, y, shape)
            e = SAM_R * g0 / (np.linalg.norm(g0) + SAM_EPS)
            g = _grad(theta + e, x, y, shape)
        else:
            g = _grad(theta, x, y, shape)
        if form == "authors":
            g, norm = _clip(g + LAMB * correction, c)  # loss_correct.backward(); clip
            theta = theta - LR * (g + (WD + LAMB) * theta)  # SGD(weight_decay=wd + lamb)
        else:
            g, norm = _clip(g + LAMB * h_i + LAMB * (theta - theta_t), c)
            theta = theta - LR * (g + WD * theta)
        norms.append(norm)
    return theta, norms


def authors_rounds(c, sam, form="authors"):
    """theta^t after every round of COHORTS, the final h [N, d] and every norm the
    clip saw: the simulator's Server.train() with FedDyn's / FedSpeed's hooks."""
    shape = helpers.logreg_to_numpy(PARAMS)[0].shape
    theta = _flat(PARAMS)
    h = np.zeros((N, theta.size))
    thetas, norms = [], []
    for ids in COHORTS:
        models = []
        for i in ids:
            x, y = helpers.real_rows(TRAIN, [i])
            local, seen = authors_local(theta, h[i], x, y, shape, c, sam, form)
            h[i] += local - theta  # postprocess(): h_i += local update
            models.append(local)
            norms += seen
        theta = np.mean(models, 0) + h.mean(0)  # global_update()
        thetas.append(theta)
    return thetas, h, norms


def _clip_value():
    """A bound at 0.3x the first gradient norm of client 0 at theta^0."""
    x, y = helpers.real_rows(TRAIN, [0])
    g = _grad(_flat(PARAMS), x, y, helpers.logreg_to_numpy(PARAMS)[0].shape)
    return 0.3 * float(np.linalg.norm(g))


# ------------------------------------------------------------------ the rounds


def _algorithm(name, clip, clip_mode="step"):
    training = ClientTraining(lr=LR, batch_size=FULL_BATCH, num_epochs=STEPS,
                              weight_decay=WD, clip_norm=clip, clip_mode=clip_mode)
    if name == "feddyn":
        return _seq(feddyn(MODEL, alpha=LAMB, training=training))
    return _seq(fedspeed(MODEL, rho=LAMB, sam_radius=SAM_R, sam_eps=SAM_EPS,
                         training=training))


def _play(alg):
    apply = jax.jit(alg.apply)
    state = alg.init(PARAMS, N)
    thetas = []
    for r, ids in enumerate(COHORTS):
        state, _ = apply(state, helpers.cohort(TRAIN, ids), jax.random.fold_in(KEY, r))
        thetas.append(_flat(state.params))
    duals = alg.client_table.gather(state.client_states, jnp.arange(N, dtype=jnp.int32))
    return thetas, np.stack([_flat(jax.tree.map(lambda v: v[i], duals)) for i in range(N)])


@pytest.mark.parametrize("name", ["feddyn", "fedspeed"])
def test_rounds_with_a_clip_equal_the_authors_simulator(name):
    """FedDyn / FedSpeed with ``clip_norm`` (default ``clip_mode="step"``) over 4 rounds
    of partial participation, 3 local steps per client, the clip binding at every step
    and the duals nonzero from the second round: theta^t after every round and every
    client's dual lambda_i = lamb h_i equal the float64 transcription of the authors'
    simulator to ~1e-6; the whole-penalty clip of the rest of the family is far off."""
    sam = name == "fedspeed"
    clip = _clip_value()
    expected, h, norms = authors_rounds(clip, sam)
    assert min(norms) > 1.2 * clip  # the clip binds at every local step
    whole, _, _ = authors_rounds(clip, sam, form="whole")
    assert np.abs(whole[-1] - expected[-1]).max() > 1e-3  # the two forms differ here

    thetas, duals = _play(_algorithm(name, clip))
    for got, want in zip(thetas, expected):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(duals, LAMB * h, rtol=0, atol=1e-6)
    assert np.abs(h).max() > 1e-2  # the duals moved


# ------------------------------------------------------------------ one client


def _one_client(split, clip, sam):
    training = ClientTraining(lr=LR, batch_size=FULL_BATCH, num_epochs=STEPS,
                              weight_decay=WD, clip_norm=clip)
    regularizer = augmented_lagrangian(LAMB)
    if split:
        regularizer, training = clip_split(LAMB, training)
    return jax.jit(local_training(MODEL, training, regularizer=regularizer,
                                  finish=dual_ascent(LAMB), sam_radius=SAM_R if sam else None,
                                  sam_eps=SAM_EPS))


@pytest.mark.parametrize("sam", [False, True], ids=["plain", "sam"])
@pytest.mark.parametrize("split", [True, False], ids=["authors", "whole"])
def test_one_client_with_a_random_dual_equals_the_reference(split, sam):
    """The family's two "step" forms on one client holding a random dual lambda_i:
    ``clip_split`` (FedDyn, FedSpeed) is the authors' local step, the plain
    augmented Lagrangian (FedPD, FedADMM, A-FedPD) clips the whole penalty; the new
    dual is lambda_i + lamb (theta_K - theta^t) in both."""
    k = 1
    x, y = helpers.real_rows(TRAIN, [k])
    shape = helpers.logreg_to_numpy(PARAMS)[0].shape
    rng = np.random.default_rng(4)
    dual = rng.normal(scale=0.5, size=_flat(PARAMS).size)
    clip = _clip_value()
    expected, norms = authors_local(_flat(PARAMS), dual / LAMB, x, y, shape, clip, sam,
                                    "authors" if split else "whole")
    assert min(norms) > 1.2 * clip

    w_size = shape[0] * shape[1]
    dual_tree = helpers.logreg_from_numpy(dual[:w_size].reshape(shape), dual[w_size:], PARAMS)
    broadcast = Broadcast(PARAMS, jnp.zeros((), jnp.int32), ())
    out, new_dual = _one_client(split, clip, sam)(
        broadcast, jax.tree.map(jnp.asarray, dual_tree), helpers.client(TRAIN, k),
        jnp.int32(2 ** 30), KEY)
    assert int(out.num_steps) == STEPS
    local = _flat(PARAMS) - _flat(out.delta)
    np.testing.assert_allclose(local, expected, rtol=0, atol=1e-6)
    np.testing.assert_allclose(_flat(new_dual), dual + LAMB * (expected - _flat(PARAMS)),
                               rtol=0, atol=1e-6)


# ------------------------------------------------------------------ when the split applies


def test_clip_split_applies_only_to_a_step_clip_and_names_the_callers_values():
    """No clip, or ``clip_mode="loss"``: the augmented Lagrangian and the training as
    given (so without a clip the program is the one built without the option); a
    "step" clip: the linear correction and lamb added to the weight decay (also a
    traced lamb). A bad weight decay is refused with the caller's own value."""
    for training in (ClientTraining(weight_decay=WD),
                     ClientTraining(weight_decay=WD, clip_norm=1.0, clip_mode="loss")):
        regularizer, same = clip_split(LAMB, training)
        assert same is training
        assert regularizer.__qualname__ == augmented_lagrangian(LAMB).__qualname__
    _, split = clip_split(LAMB, ClientTraining(weight_decay=WD, clip_norm=1.0))
    assert split.weight_decay == pytest.approx(WD + LAMB) and split.clip_norm == 1.0
    decay = jax.jit(lambda lam: clip_split(lam, ClientTraining(clip_norm=1.0))[1].weight_decay)
    assert float(decay(jnp.float32(LAMB))) == pytest.approx(LAMB)
    for factory in (feddyn, fedspeed):
        with pytest.raises(ValueError, match=r"^training.weight_decay: .*-0\.5"):
            factory(MODEL, training=ClientTraining(weight_decay=-0.5, clip_norm=1.0))


def test_loss_mode_and_no_clip_are_unchanged():
    """``clip_mode="loss"`` clips the (perturbed) minibatch gradient alone and adds the
    whole penalty after it: FedDyn and FedSpeed equal the family's plain local solve
    there, bit for bit."""
    clip = _clip_value()
    for name in ("feddyn", "fedspeed"):
        got, _ = _play(_algorithm(name, clip, "loss"))
        training = ClientTraining(lr=LR, batch_size=FULL_BATCH, num_epochs=STEPS,
                                  weight_decay=WD, clip_norm=clip, clip_mode="loss")
        kw = dict(sam_radius=SAM_R, sam_eps=SAM_EPS) if name == "fedspeed" else {}
        plain = _seq(primal_dual(MODEL, rho=LAMB, rule="participants", training=training,
                                 client_table="dense", weight_by_size=False,
                                 evaluate="average", **kw))
        want, _ = _play(plain)
        np.testing.assert_array_equal(got[-1], want[-1])
