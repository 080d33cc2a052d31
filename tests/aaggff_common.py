"""Shared pieces of the AAggFF tests (tests/test_aaggff_mixing.py, tests/test_aaggff.py):
literal NumPy float64 references of the thesis's equations (Hahn, UNIST 2024 thesis,
Ch. III; arXiv:2405.20821) and of the authors' code, and a driver that runs a mixing
rule for many rounds under one jitted scan."""
from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_fair.core.types import ClientOutput, ServerContext

KEY = jax.random.key(0)


# ------------------------------------------------------------------ NumPy references


def np_cdf(name, x):
    x = np.asarray(x, np.float64)
    return {
        "weibull": lambda: 1 - np.exp(-x ** 2),
        "exponential": lambda: 1 - np.exp(-x),
        "frechet": lambda: np.exp(-1 / np.maximum(x, 1e-12)),
        "normal": lambda: np.array([0.5 * (1 + math.erf((v - 1) / math.sqrt(2))) for v in x]),
        "gumbel": lambda: np.exp(-np.exp(-(x - 1))),
        "logistic": lambda: 1 / (1 + np.exp(-(x - 1))),
    }[name]()


def np_responses(losses, name, c1, c2):
    losses = np.asarray(losses, np.float64)
    return c1 + (c2 - c1) * np_cdf(name, losses / max(losses.mean(), 1e-12))


def np_project_simplex(v):
    v = np.asarray(v, np.float64)
    u = np.sort(v)[::-1]
    css = np.cumsum(u)
    rho = max(j for j in range(1, len(v) + 1) if u[j - 1] - (css[j - 1] - 1) / j > 0)
    return np.maximum(v - (css[rho - 1] - 1) / rho, 0.0)


def np_qp_exact(B, b):
    """argmin_{p in simplex} 1/2 p'Bp + b'p by enumerating supports (small K):
    on a support S solve B_SS p_S + b_S = nu 1, 1'p_S = 1, keep the feasible one."""
    B, b = np.asarray(B, np.float64), np.asarray(b, np.float64)
    k = len(b)
    best, best_val = None, np.inf
    for size in range(1, k + 1):
        for support in itertools.combinations(range(k), size):
            s = list(support)
            kkt = np.zeros((size + 1, size + 1))
            kkt[:size, :size] = B[np.ix_(s, s)]
            kkt[:size, size] = -1.0
            kkt[size, :size] = 1.0
            rhs = np.concatenate([-b[s], [1.0]])
            try:
                sol = np.linalg.solve(kkt, rhs)
            except np.linalg.LinAlgError:
                continue
            p = np.zeros(k)
            p[s] = sol[:size]
            nu = sol[size]
            h = B @ p + b
            if p.min() >= -1e-12 and np.all(h >= nu - 1e-9):
                val = 0.5 * p @ B @ p + b @ p
                if val < best_val:
                    best, best_val = p, val
    return best


def np_ons_run(responses, alpha, beta, variant="thesis", diagonal=False):
    """Literal eq. 3.7 (thesis) / the authors' cvxpy objective (reference), float64;
    ``diagonal`` keeps only diag(B). Returns the decisions p^(2..T+1)."""
    t_max, k = responses.shape
    p = np.ones(k) if variant == "reference" else np.full(k, 1.0 / k)
    A, b = np.zeros((k, k)), np.zeros(k)
    out = []
    for r in responses:
        g = -r / (1 + p @ r)
        A += np.outer(g, g)
        if variant == "thesis":
            b += (1 - beta * (g @ p)) * g
            B = alpha * np.eye(k) + beta * A
        else:
            b += g
            B = alpha * np.eye(k) + beta * (alpha * np.eye(k) + A)  # cvxpy: hess_hist = alpha I + A
        if diagonal:
            B = np.diag(np.diag(B))
        p = np_qp_exact(B, b)
        out.append(p)
    return np.array(out)


def np_ftrl_run(rounds, n, variant="thesis"):
    """Literal Algorithm 3.2 (thesis) / the authors' update (reference), float64.
    ``rounds``: list of (client_ids, responses) of the sampled clients."""
    p = np.full(n, 1.0 / n)
    s = np.zeros(n)
    out = []
    for t, (ids, r) in enumerate(rounds, start=1):
        m = len(ids)
        c = m / n
        rbar = r.mean()
        if variant == "reference" and t == 1:
            p = np.full(n, c)
        rb = np.full(n, rbar)
        for i, ri in zip(ids, r):
            rb[i] = (rbar + (ri - rbar) / c) if variant == "thesis" else (ri - rbar) / c
        denom = 1 + rbar * p.sum()
        g = -rb / denom + rbar * (p @ rb - rbar * p.sum()) / denom ** 2
        s += g
        if variant == "thesis":
            lip = c if m == n else c + 2  # C2 = C, C1 = 0
        else:
            lip = 2 + c
        z = -s * math.sqrt(math.log(n)) / (lip * math.sqrt(t + 1))
        p = np.exp(z - z.max())
        p /= p.sum()
        out.append(p)
    return np.array(out)


def ctx_of(client_ids, client_mask):
    """The round's ServerContext for a cohort (what mixing rules read: ids and mask)."""
    return ServerContext(params=(), round=jnp.zeros((), jnp.int32), key=KEY,
                         client_ids=jnp.asarray(client_ids, jnp.int32),
                         client_mask=jnp.asarray(client_mask, bool))


def outputs_of(losses):
    k = len(losses)
    return ClientOutput(delta=(), loss_before=jnp.asarray(losses, jnp.float32),
                        num_examples=jnp.full((k,), 5, jnp.int32),
                        num_steps=jnp.ones((k,), jnp.int32))


def run_rule(rule, n, losses, ids=None, masks=None):
    """Runs ``rule`` for R rounds under one jitted lax.scan (vmapped over a leading
    batch axis when ``losses`` is [B, R, K]). Returns (weights [.., R, K], decisions
    [.., R, N], final state)."""
    losses = jnp.asarray(losses, jnp.float32)
    k = losses.shape[-1]
    ids = (jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), losses.shape) if ids is None
           else jnp.asarray(ids, jnp.int32))
    masks = jnp.ones(losses.shape, bool) if masks is None else jnp.asarray(masks, bool)

    def body(state, xs):
        loss, i, msk = xs
        w, state = rule.update(state, outputs_of(loss), ctx_of(i, msk))
        return state, (w, state.decision)

    def run(xs):
        return jax.lax.scan(body, rule.init(n), xs)

    if losses.ndim == 3:
        run = jax.vmap(run)
    state, (w, dec) = jax.jit(run)((losses, ids, masks))
    return np.asarray(w), np.asarray(dec), state
