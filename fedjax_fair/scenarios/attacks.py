"""Malicious clients: data and model poisoning attacks as pure functions (docs/robustness.md).

Four attacks, each a setting of ``Attack`` (a NamedTuple, so it can be a static
argument, and its ``scale`` / ``std`` may be arrays to ``jax.vmap`` over):

* ``"label_flip"`` (data poisoning): the malicious clients train on their own inputs
  with every real label y replaced by ``flip_map[y]``, by default ``num_classes - 1
  - y`` (Fang, Cao, Jia, Gong, "Local Model Poisoning Attacks to Byzantine-Robust
  Federated Learning", USENIX Security 2020, arXiv:1911.11815: label l -> L - l - 1).
  For two classes this is Ditto's flip 1 - y (Li, Hu, Beirami, Smith, "Ditto: Fair
  and Robust Federated Learning Through Personalization", ICML 2021,
  arXiv:2012.04221, attack A1 on CelebA); Ditto's multi-class datasets get uniformly
  random labels instead, which this module does not draw.
* ``"sign_flip"``: Delta_k -> -scale * Delta_k (a Byzantine client pushing the model
  up its own loss; scale 1 unless given).
* ``"gaussian"``: Delta_k ~ N(0, std^2) per coordinate (Ditto's A2 "random
  updates"); ``std=None`` takes the standard deviation of the client's own
  flattened update, as Ditto's code does.
* ``"scaled_replacement"``: Delta_k -> gamma * Delta_k (model replacement:
  Bagdasaryan, Veit, Hua, Estrin, Shmatikov, "How To Backdoor Federated Learning",
  AISTATS 2020, arXiv:1807.00459; the attacker sends gamma (X - G^t) + G^t with gamma
  = n / eta, so that averaging replaces the global model G^t by its model X; in
  pseudo-gradients Delta = G^t - L this is gamma Delta_k). ``scale`` is gamma;
  ``scale=None`` takes the number of unmasked clients of the round, Ditto's A3
  boosting (``clients_per_round * diff``), which is n / eta for a uniform mean with
  server rate 1.

Who is malicious is fixed for a run: ``malicious_ids`` draws a boolean [N] mask on
the host (a seeded fraction or an explicit list). In a round, ``poison_data`` is
applied to the cohort's data before local training and ``poison_outputs`` to the
stacked client outputs after it; both change only the rows of malicious clients and
are jittable. ``drivers.runner.attacked_summary`` reports the fairness summary of the
benign and of the malicious clients separately.

``scenarios.with_attack(algorithm, attack, is_malicious)`` puts an attack into every
round of a method (scenarios/wrap.py); the command line's ``--attack`` uses it
(fedjax_fair/cli/transforms.py).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_fair import hparams as H
from fedjax_fair.core.types import ClientData, ClientOutput

LABEL_FLIP = "label_flip"
SIGN_FLIP = "sign_flip"
GAUSSIAN = "gaussian"
SCALED_REPLACEMENT = "scaled_replacement"
KINDS = (LABEL_FLIP, SIGN_FLIP, GAUSSIAN, SCALED_REPLACEMENT)
"""Accepted values of ``Attack.kind``."""

OUTPUT_KINDS = (SIGN_FLIP, GAUSSIAN, SCALED_REPLACEMENT)
"""The kinds that change the clients' uploads (``poison_outputs``); ``label_flip``
changes their data (``poison_data``)."""

LABEL_KEY = "y"  # the integer labels of ClientData.examples (every built-in dataset)

ATTACK_KEY_ID = 2 ** 31 - 2
"""A ``fold_in`` id for the attack's key, next to ``algorithm.SERVER_KEY_ID``: pass
``jax.random.fold_in(round_key, ATTACK_KEY_ID)`` to ``poison_outputs`` so that the
Gaussian updates are independent of the clients' training keys
(``fold_in(round_key, client_id)``) and of the server's."""

_FLOOR_TOL = 1e-9  # as metrics.num_selected: 0.29 * 100 selects 29 clients, not 28

HPARAMS = {
    # continuous: a run may be vmapped over them (None: the documented default)
    "scale": H.Range(0.0, None, low_open=True, nullable=True),
    "std": H.Range(0.0, None, nullable=True),
}


class Attack(NamedTuple):
    """One attack's configuration.

    kind: one of ``KINDS``.
    scale: ``sign_flip``'s factor (Delta -> -scale Delta; None: 1) and
      ``scaled_replacement``'s gamma (Delta -> gamma Delta; None: the number of unmasked
      clients of the round). > 0; a float or a JAX array (vmap over it).
    std: ``gaussian``'s standard deviation per coordinate (None: that of the client's
      own flattened update). >= 0; a float or a JAX array.
    num_classes: ``label_flip``'s number of classes C (the map y -> C - 1 - y) when no
      ``flip_map`` is given.
    flip_map: ``label_flip``'s map as a sequence of C labels (y -> flip_map[y]);
      None: ``C - 1 - y``. Labels outside [0, C) are left as they are.
    """

    kind: str
    scale: Optional[float] = None
    std: Optional[float] = None
    num_classes: Optional[int] = None
    flip_map: Optional[Sequence[int]] = None


def check_attack(attack: Attack) -> Attack:
    """``attack`` if its concrete values are valid, else ``FieldError("attack.FIELD",
    ...)``. JAX arrays (tracers under vmap / grad) pass unchecked."""
    if not isinstance(attack, Attack):
        raise H.FieldTypeError("attack", f"must be an attacks.Attack, got "
                                         f"{type(attack).__name__}")
    if attack.kind not in KINDS:
        raise H.FieldError("attack.kind", f"must be one of {list(KINDS)}, got {attack.kind!r}")
    for name in HPARAMS:
        HPARAMS[name].check(f"attack.{name}", getattr(attack, name))
    if attack.kind == LABEL_FLIP:
        _flip_table(attack)
    return attack


def _flip_table(attack: Attack):
    """The label map [C] of a ``label_flip`` attack (checked when concrete)."""
    if attack.flip_map is None:
        if attack.num_classes is None:
            raise H.FieldError("attack.num_classes", "label_flip needs num_classes (or a "
                                                     "flip_map)")
        c = H.count(attack.num_classes, "attack.num_classes", minimum=2)
        return jnp.arange(c - 1, -1, -1, dtype=jnp.int32)
    if isinstance(attack.flip_map, jax.Array):
        return attack.flip_map.astype(jnp.int32)
    table = np.asarray(attack.flip_map)
    if table.ndim != 1 or table.size < 2 or not np.issubdtype(table.dtype, np.integer):
        raise H.FieldError("attack.flip_map", f"must be a sequence of at least 2 integer "
                                              f"labels, got {attack.flip_map!r}")
    if table.min() < 0 or table.max() >= table.size:
        raise H.FieldError("attack.flip_map", f"labels must lie in [0, {table.size}), got "
                                              f"{table.tolist()}")
    if attack.num_classes is not None and attack.num_classes != table.size:
        raise H.FieldError("attack.flip_map", f"has {table.size} entries, num_classes is "
                                              f"{attack.num_classes}")
    return jnp.asarray(table, jnp.int32)


# ------------------------------------------------------------- who is malicious


def num_malicious(num_clients: int, fraction: float) -> int:
    """The number of malicious clients of a fraction: ``floor(fraction * N)`` (with a
    1e-9 tolerance, as ``metrics.num_selected``, so that 0.29 * 100 gives 29), never
    rounded up: 10% of 15 clients is 1 client, 5% of 10 clients none."""
    n = H.count(num_clients, "num_clients")
    f = H.probability(fraction, "malicious_fraction")
    return min(n, int(math.floor(f * n + _FLOOR_TOL)))


def malicious_ids(num_clients: int, fraction: Optional[float] = None,
                  ids: Optional[Sequence[int]] = None, seed: int = 0) -> np.ndarray:
    """Which clients are malicious: a NumPy bool [N] mask, fixed for a run.

    Give either ``fraction`` in [0, 1] (``num_malicious(N, fraction)`` clients, the
    first ones of ``np.random.default_rng(seed).permutation(N)``: deterministic per
    seed, and for one seed a larger fraction's clients include a smaller one's) or
    ``ids``, an explicit list of distinct client ids in [0, N). Neither: no client is
    malicious. Bad values raise ``FieldError`` naming ``malicious_fraction`` or
    ``malicious_ids``.
    """
    n = H.count(num_clients, "num_clients")
    out = np.zeros((n,), bool)
    if fraction is not None and ids is not None:
        raise H.FieldError("malicious_ids", "give malicious_ids or malicious_fraction, not both")
    if fraction is not None:
        count = num_malicious(n, fraction)
        out[np.random.default_rng(seed).permutation(n)[:count]] = True
        return out
    if ids is None:
        return out
    chosen = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids)
    if chosen.size == 0 and chosen.ndim == 1:
        return out
    if (chosen.ndim != 1 or chosen.dtype == bool
            or not np.issubdtype(chosen.dtype, np.integer)):
        raise H.FieldError("malicious_ids", f"must be a list of integer client ids, got {ids!r}")
    bad = chosen[(chosen < 0) | (chosen >= n)]
    if bad.size:
        raise H.FieldError("malicious_ids", f"client ids must lie in [0, {n}), got "
                                            f"{sorted(set(bad.tolist()))}")
    unique, counts = np.unique(chosen, return_counts=True)
    if np.any(counts > 1):
        raise H.FieldError("malicious_ids", f"lists clients {unique[counts > 1].tolist()} "
                                            f"more than once")
    out[chosen] = True
    return out


def _rows(is_malicious, client_ids):
    """is_malicious[client_ids]: bool [K] (or [] for one client)."""
    return jnp.asarray(is_malicious, bool)[jnp.asarray(client_ids)]


def _expand(flags, ndim: int):
    """``flags`` [K] with trailing unit axes up to ``ndim`` (explicit, for
    ``jax_numpy_rank_promotion="raise"``)."""
    return flags.reshape(flags.shape + (1,) * (ndim - flags.ndim))


# ------------------------------------------------------------------ data poisoning


def poison_data(data: ClientData, client_ids, is_malicious, attack: Attack) -> ClientData:
    """The cohort's data as the attack's clients train on it.

    data: ClientData [K, M, ...] gathered at ``client_ids`` (int [K]); a single
      client's ClientData [M, ...] with a scalar id works too.
    is_malicious: bool [N] (``malicious_ids``), a JAX or NumPy array.

    ``label_flip``: the real rows (``data.mask``) of the malicious clients get labels
    ``flip_map[y]`` (default ``num_classes - 1 - y``); padding rows, labels outside
    [0, C), the inputs, mask and sizes are left as they are. Other kinds: ``data``
    unchanged. Jittable; ``attack`` is read as static (its kind and label map).
    """
    check_attack(attack)
    if attack.kind != LABEL_FLIP:
        return data
    table = _flip_table(attack)
    y = data.examples[LABEL_KEY]
    rows = _rows(is_malicious, client_ids)
    real = _expand(_expand(rows, data.mask.ndim) & data.mask, y.ndim)
    known = (y >= 0) & (y < table.shape[0])
    flipped = table[jnp.where(known, y, 0)].astype(y.dtype)
    new_y = jnp.where(jnp.broadcast_to(real, y.shape) & known, flipped, y)
    return data._replace(examples={**data.examples, LABEL_KEY: new_y})


# ----------------------------------------------------------------- model poisoning


def _own_std(delta):
    """Standard deviation of one client's flattened update (all leaves together, the
    population std as NumPy's ``np.std``): Ditto's scale of its random updates."""
    leaves = [jnp.ravel(x).astype(jnp.float32) for x in jax.tree.leaves(delta)]
    size = sum(x.size for x in leaves)
    mean = sum(jnp.sum(x) for x in leaves) / size
    return jnp.sqrt(sum(jnp.sum(jnp.square(x - mean)) for x in leaves) / size)


def _real(x):
    """The floating dtype the attack computes a leaf in (its own, float32 otherwise)."""
    return x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else jnp.float32


def gaussian_update(key, client_id, delta, std=None):
    """One client's random update: a pytree like ``delta`` (without a client axis) of
    N(0, std^2) draws from ``fold_in(key, client_id)``, leaf i from a further
    ``fold_in(., i)``: the same for a key and a client whatever its cohort slot.
    ``std=None``: the standard deviation of ``delta``'s own coordinates."""
    std = _own_std(delta) if std is None else std
    client_key = jax.random.fold_in(key, client_id)
    leaves, treedef = jax.tree.flatten(delta)
    noise = [(jnp.asarray(std).astype(_real(x)) * jax.random.normal(
        jax.random.fold_in(client_key, i), x.shape, _real(x))).astype(x.dtype)
        for i, x in enumerate(leaves)]
    return jax.tree.unflatten(treedef, noise)


def _attacked_delta(outputs: ClientOutput, client_ids, mask, attack: Attack, key):
    """The uploads [K, ...] every client would send if it ran ``attack``."""
    delta = outputs.delta
    if attack.kind == GAUSSIAN:
        return jax.vmap(lambda i, d: gaussian_update(key, i, d, attack.std))(
            jnp.asarray(client_ids), delta)
    if attack.kind == SIGN_FLIP:
        factor = -(1.0 if attack.scale is None else attack.scale)
    else:  # SCALED_REPLACEMENT
        factor = (jnp.sum(jnp.asarray(mask, jnp.float32)) if attack.scale is None
                  else attack.scale)
    return jax.tree.map(lambda d: (jnp.asarray(factor).astype(_real(d)) * d).astype(d.dtype),
                        delta)


def poison_outputs(outputs: ClientOutput, client_ids, mask, is_malicious, attack: Attack,
                   key, server_params=None) -> tuple[ClientOutput, dict]:
    """The cohort's uploads after the malicious clients tampered with them.

    outputs: the stacked ``ClientOutput`` [K] of local training.
    client_ids: int [K]; mask: bool [K] (False rows are padding and never change).
    is_malicious: bool [N] (``malicious_ids``).
    key: the attack's key for the round (``fold_in(round_key, ATTACK_KEY_ID)``);
      only ``gaussian`` draws from it, client k from ``fold_in(key, client_ids[k])``.
    server_params: theta^t, the model the deltas refer to. The four attacks act on the
      deltas alone and do not read it (a replacement's uploaded model is theta^t -
      gamma Delta_k); the round hook passes it so that an attack crafting a model needs
      no new signature.

    Only ``outputs.delta`` of the malicious unmasked clients changes (``sign_flip``:
    -scale Delta_k; ``gaussian``: N(0, std^2) draws; ``scaled_replacement``: gamma
    Delta_k); every other field and row is returned as it is. ``label_flip`` (a data
    attack, ``poison_data``) leaves the outputs unchanged.

    Returns ``(outputs, info)`` with ``info = {"malicious": bool [K]}``, the clients
    whose upload the attacker controlled this round (malicious and unmasked), for the
    round log. Jittable; vmappable over ``key`` and over an array ``attack.scale`` /
    ``attack.std``.
    """
    del server_params  # see the docstring: no current attack reads it
    check_attack(attack)
    hit = _rows(is_malicious, client_ids) & jnp.asarray(mask, bool)
    info = {"malicious": hit}
    if attack.kind not in OUTPUT_KINDS:
        return outputs, info
    attacked = _attacked_delta(outputs, client_ids, mask, attack, key)
    delta = jax.tree.map(lambda new, old: jnp.where(_expand(hit, old.ndim), new, old),
                         attacked, outputs.delta)
    return outputs._replace(delta=delta), info
