"""Synthetic(alpha, beta): the heterogeneous logistic-regression federation of FedProx.

Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith, "Federated Optimization in
Heterogeneous Networks", MLSys 2020, §5.1 and its data/synthetic_*/generate_*.py;
reused by q-FFL (Li, Sanjabi, Beirami, Smith, "Fair Resource Allocation in Federated
Learning", ICLR 2020) with 100 devices.

Client k (symbols -> variables):

  u_k ~ N(0, alpha)                           u
  W_k in R^{10x60}, b_k in R^10, entries ~ N(u_k, 1)    W, b
  B_k ~ N(0, beta)                            B
  v_k in R^60, entries ~ N(B_k, 1)            v
  x ~ N(v_k, Sigma), Sigma_jj = j^(-1.2), j = 1..60     x
  y = argmax softmax(W_k x + b_k) = argmax (W_k x + b_k)

alpha is meant to control how much the local models differ, beta how much the local
inputs do. But u_k is one shift shared by every weight and bias entry of client k, so
it adds the same amount, u_k (1 + sum_j x_j), to all ten logits and cancels in the
argmax: in the reference generator (and here, by default) alpha has no effect on the
labels; only the N(0, 1) entries make the client models differ. ``alpha_per_class=True``
is a variant in which it does matter: one shift per class, u_kc ~ N(0, alpha), with
W_k[c, :] and b_k[c] ~ N(u_kc, 1), so alpha moves the class boundaries of each client.
The paper writes N(0, alpha) with alpha a *variance*, so by default u_k and B_k have
standard deviation sqrt(alpha) and sqrt(beta). The reference script passes alpha and
beta to ``np.random.normal`` as the standard deviation instead; ``alpha_beta_as_std=True``
reproduces that. The two agree for the published settings (0, 0) and (1, 1) and
differ for (0.5, 0.5).

Client sizes follow the reference generator's power law,
n_k = floor(lognormal(mean=4, sigma=2)) + 50, then capped at ``max_examples``
(the uncapped law has a heavy tail: with 30 clients the largest one often holds
several thousand examples, and padding would multiply it by N).

Synthetic-IID (``iid=True``): as in the reference generate_iid.py, one W, b with
entries ~ N(0, 1) shared by all clients and v = 0, so every client draws
x ~ N(0, Sigma) and labels from the same model; alpha and beta are then unused.

Each client's examples are split into train/test with ``split_per_client``:
``n_train = floor((1 - test_fraction) n)``. The default ``test_fraction=0.1`` matches
both reference generators (FedProx and q-FFL write ``train_len = int(0.9 * n)``).

``procedural=True`` holds no rows: client k's model and rows are computed from
(seed, k) inside each round (``generated.py``), with the same generative model, in
float32 (labels are the argmax of float32 logits; the in-memory builder takes them in
float64, so a row on a class boundary may differ), so a federation of a million
clients costs memory in the cohort only. Its values differ from the in-memory
federation's at the same seed (JAX's counter-based keys, one per client, instead of
one sequential NumPy stream); it needs a finite ``max_examples``.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_fair.data import generated
from fedjax_fair.data.federated import (Dataset, _check_seed,
                                        from_client_arrays, split_per_client)
from fedjax_fair.hparams import FieldError, count

NUM_FEATURES = 60
NUM_CLASSES = 10


def _check_scale(value, field: str) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise FieldError(field, f"must be a number >= 0, got {value!r}") from None
    if not value >= 0.0:
        raise FieldError(field, f"must be >= 0, got {value}")
    return value


def _generate_clients(alpha: float, beta: float, num_clients: int, iid: bool,
                      max_examples: int | None, seed: int, alpha_beta_as_std: bool,
                      alpha_per_class: bool = False) -> list[dict]:
    """Draws every client's generating model and examples (see the module docstring).

    Returns one dict per client: x float32 [n_k, 60], y int32 [n_k], and the
    generating parameters W [10, 60], b [10], v [60] (float64). Labels are computed
    from the float32 inputs, so y == argmax(x @ W.T + b) holds exactly for the stored x.
    """
    rng = np.random.default_rng(seed)
    sizes = np.floor(rng.lognormal(4.0, 2.0, num_clients)).astype(np.int64) + 50
    if max_examples is not None:
        sizes = np.minimum(sizes, max_examples)
    std = np.sqrt(np.arange(1, NUM_FEATURES + 1, dtype=np.float64) ** -1.2)  # sqrt(Sigma_jj)
    scale_u, scale_b = (alpha, beta) if alpha_beta_as_std else (np.sqrt(alpha), np.sqrt(beta))
    # shared (reference): one u_k per client, which cancels in the argmax; per class:
    # u_kc, which does not.
    u = rng.normal(0.0, scale_u, (num_clients, NUM_CLASSES) if alpha_per_class
                   else num_clients)
    big_b = rng.normal(0.0, scale_b, num_clients)
    if iid:
        shared_w = rng.normal(0.0, 1.0, (NUM_CLASSES, NUM_FEATURES))
        shared_b = rng.normal(0.0, 1.0, NUM_CLASSES)
    clients = []
    for k in range(num_clients):
        if iid:
            w, b, v = shared_w, shared_b, np.zeros(NUM_FEATURES)
        else:
            v = rng.normal(big_b[k], 1.0, NUM_FEATURES)
            shift = u[k][:, None] if alpha_per_class else u[k]
            w = rng.normal(shift, 1.0, (NUM_CLASSES, NUM_FEATURES))
            b = rng.normal(u[k], 1.0, NUM_CLASSES)
        x = (v + std * rng.standard_normal((sizes[k], NUM_FEATURES))).astype(np.float32)
        y = np.argmax(x.astype(np.float64) @ w.T + b, axis=1).astype(np.int32)
        clients.append({"x": x, "y": y, "W": w, "b": b, "v": v})
    return clients


def synthetic(alpha: float = 1.0, beta: float = 1.0, num_clients: int = 30,
              iid: bool = False, test_fraction: float = 0.1, max_examples: int | None = 1000,
              seed: int = 0, alpha_beta_as_std: bool = False,
              alpha_per_class: bool = False, procedural: bool = False) -> Dataset:
    """Synthetic(alpha, beta) of FedProx / q-FFL: 60 features, 10 classes.

    Args:
      alpha: variance of the per-client model mean u_k (>= 0). With the reference
        generator's shared shift it does not change the labels (it cancels in the
        argmax; module doc); ``alpha_per_class=True`` makes it matter.
      beta: variance of the per-client input mean B_k (>= 0).
      num_clients: 30 in FedProx, 100 in q-FFL.
      iid: Synthetic-IID (shared W, b; v = 0; alpha and beta unused).
      test_fraction: per-client test share in (0, 1); 0.1 as in the reference code.
      max_examples: cap on a client's total size (None: the uncapped power law).
      seed: everything is a function of the seed.
      alpha_beta_as_std: treat alpha and beta as standard deviations, as the
        reference script does.
      alpha_per_class: one model shift per class, u_kc ~ N(0, alpha), instead of the
        reference's one per client (a variant; not the published data).
      procedural: compute each client's rows from (seed, client id) inside the round
        instead of holding them (the splits are ``generated.GeneratedClients``).

    Returns a Dataset named "synthetic" with input_shape (60,).
    """
    alpha, beta = _check_scale(alpha, "alpha"), _check_scale(beta, "beta")
    num_clients = count(num_clients, "num_clients")
    seed = _check_seed(seed)
    if max_examples is not None:
        max_examples = count(max_examples, "max_examples")
    if procedural:
        if max_examples is None:
            raise FieldError("max_examples", "a procedural federation needs a finite cap "
                                             "(every client's rows are padded to it)")
        return _procedural(alpha, beta, num_clients, bool(iid), float(test_fraction),
                           max_examples, seed, bool(alpha_beta_as_std), bool(alpha_per_class))
    if max_examples is not None:  # per-client arrays, then the padded blocks
        generated.check_held(num_clients, 2 * num_clients * max_examples * (NUM_FEATURES + 2)
                             * 4, "clients")
    clients = _generate_clients(alpha, beta, num_clients, bool(iid), max_examples, seed,
                                bool(alpha_beta_as_std), bool(alpha_per_class))
    split = split_per_client(np.random.default_rng([seed, 1]), [c["x"] for c in clients],
                             [c["y"] for c in clients], test_fraction)
    info = {"alpha": alpha, "beta": beta, "num_clients": num_clients, "iid": bool(iid),
            "test_fraction": float(test_fraction), "max_examples": max_examples,
            "seed": int(seed), "alpha_beta_as_std": bool(alpha_beta_as_std),
            "alpha_per_class": bool(alpha_per_class),
            "client_sizes": [int(len(c["y"])) for c in clients],
            "source": "FedProx (Li et al. 2020) Synthetic(alpha, beta)"}
    return from_client_arrays(*split, name="synthetic", num_classes=NUM_CLASSES, info=info)


# ------------------------------------------------------------------ procedural


@dataclasses.dataclass(frozen=True)
class _ClientRows:
    """Client k's rows of one split (``generated.GeneratedClients.rows``), drawn from
    its key ``fold_in(key, k)``: its size from ``fold_in(., 0)``, u_k, B_k, v_k, W_k,
    b_k from ``fold_in(., 1..5)`` and split s's inputs from ``fold_in(., 6 + s)``; the
    IID form's shared W, b are ``shared``."""

    split: int  # 0 train, 1 test
    max_examples: int
    scale_u: float
    scale_b: float
    iid: bool
    alpha_per_class: bool

    def __call__(self, shared, key, client_id):
        del client_id
        f, c = NUM_FEATURES, NUM_CLASSES
        normal = lambda i, shape: jax.random.normal(jax.random.fold_in(key, i), shape,
                                                    jnp.float32)
        if self.iid:
            w, b, v = shared["W"], shared["b"], jnp.zeros((f,), jnp.float32)
        else:
            u = self.scale_u * normal(1, (c,) if self.alpha_per_class else ())
            big_b = self.scale_b * normal(2, ())
            v = big_b + normal(3, (f,))
            shift = u[:, None] if self.alpha_per_class else u
            w = shift + normal(4, (c, f))
            b = u + normal(5, (c,))
        x = v[None] + shared["std"][None] * normal(6 + self.split, (self.max_examples, f))
        y = jnp.argmax(x @ w.T + b[None], axis=1).astype(jnp.int32)
        return {"x": x, "y": y}


def _procedural(alpha, beta, num_clients, iid, test_fraction, max_examples, seed,
                alpha_beta_as_std, alpha_per_class) -> Dataset:
    root = jax.random.key(seed)
    clients = jax.random.fold_in(root, 0)
    cap = float(max_examples - 50) if max_examples > 50 else 0.0

    def size(k):  # floor(lognormal(4, 2)) + 50, capped (computed below the cap in float)
        z = jax.random.normal(jax.random.fold_in(k, 0), (), jnp.float32)
        return jnp.minimum(jnp.floor(jnp.exp(4.0 + 2.0 * z)), cap).astype(jnp.int32) + 50

    sizes = np.minimum(generated.client_draws(clients, num_clients, size), max_examples)
    # _num_train's rule, for every client at once (every size is at least 50)
    train_sizes = np.maximum(1, np.floor((1.0 - test_fraction) * sizes + 1e-9)).astype(np.int32)
    test_sizes = (sizes - train_sizes).astype(np.int32)
    std = np.sqrt(np.arange(1, NUM_FEATURES + 1, dtype=np.float64) ** -1.2).astype(np.float32)
    shared = {"std": std}
    if iid:
        w_key, b_key = jax.random.split(jax.random.fold_in(root, 1))
        shared["W"] = np.asarray(jax.random.normal(w_key, (NUM_CLASSES, NUM_FEATURES)))
        shared["b"] = np.asarray(jax.random.normal(b_key, (NUM_CLASSES,)))
    scale_u, scale_b = (alpha, beta) if alpha_beta_as_std else (np.sqrt(alpha), np.sqrt(beta))
    spec = (("x", (NUM_FEATURES,), "float32"), ("y", (), "int32"))
    key_data = np.asarray(jax.random.key_data(clients))

    def split(index: int, num_examples: np.ndarray):
        m = max(int(num_examples.max()), 1)
        rows = _ClientRows(index, m, float(scale_u), float(scale_b), iid, alpha_per_class)
        return generated.GeneratedClients(num_examples, shared, key_data, rows, m, spec)

    info = {"alpha": alpha, "beta": beta, "num_clients": num_clients, "iid": iid,
            "test_fraction": test_fraction, "max_examples": max_examples, "seed": int(seed),
            "alpha_beta_as_std": alpha_beta_as_std, "alpha_per_class": alpha_per_class,
            "procedural": True,
            "source": "FedProx (Li et al. 2020) Synthetic(alpha, beta), procedural"}
    return generated.dataset("synthetic", split(0, train_sizes), split(1, test_sizes),
                             NUM_CLASSES, (NUM_FEATURES,), info)
