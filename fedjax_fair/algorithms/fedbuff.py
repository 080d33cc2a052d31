"""Asynchronous aggregation on the virtual clock: FedBuff and FedAsync.

* FedBuff — Nguyen, Malik, Zhan, Yousefpour, Rabbat, Malek, Huba, "Federated Learning
  with Buffered Asynchronous Aggregation", AISTATS 2022 (arXiv:2106.06639),
  Algorithm 1: C clients train concurrently, each from the model version current
  when it started; every K finished updates the server applies their
  staleness-weighted average, w <- w - eta_g (1 / K) sum_k s(tau_k) Delta_k, with
  s(tau) = (1 + tau)^(-a) and tau_k the number of server steps since client k began.
* FedAsync — Xie, Koyejo, Gupta, "Asynchronous Federated Optimization" (arXiv:1903.03934),
  Algorithm 1 with the polynomial staleness function. A worker that received the
  model x_tau (version tau) runs local SGD on the regularised objective

      g_{x_tau}(x) = f_k(x) + (rho / 2) ||x - x_tau||^2,
      x <- x - gamma (grad f_k(x; B) + rho (x - x_tau))     (each local step),

  (``core.client.proximal_term(rho)``, FedProx's term, centred on the model the
  client started from) and every finished client's model x_k is mixed in at once,
  w <- (1 - alpha_t) w + alpha_t x_k with alpha_t = alpha s(tau_k) (K = 1). rho = 0
  is plain local SGD; the default rho = 0.005 is the paper's value in its CIFAR-10
  CNN experiments (gamma = 0.1). Cohort size K > 1 is not the paper's algorithm:
  the round then applies the *mean* of the K earliest arrivals' mixing steps,
  w <- w - (alpha / n) sum_k s(tau_k) (w - x_k), as one server step (a buffered
  FedAsync: FedBuff's buffer with FedAsync's model mixing); ``fedasync_cohort_note``
  says so in one line.

**The construction: a round is one server step.** Both are built with ``compose``, so
they run in ``simulate``'s scan, resume, ``jax.vmap`` over seeds and
``jax.grad`` like every method. The round's cohort (K clients, the buffer size) is
the clients *dispatched* right after the previous server step: they train from the
current model ``state.params`` (the model version they start from), in one vmapped
map like any cohort, and their results wait in the aggregator's ``Pool``, a
fixed-size buffer of C in-flight clients (their update, id, start version and finish
time on the clock). The aggregator then pops the K in-flight
clients that finish first, weights each by the staleness of its start version,
applies their average, and advances the clock to the K-th arrival. Training a
client when it is dispatched instead of when it finishes gives the same update (it
depends only on the model it starts from), so the pool stores C updates [C, d]
rather than a ring buffer of past global models; everything has a fixed shape and
the whole run compiles once.

The first rounds fill the pool: no server step is taken until C clients are in flight
(C / K rounds of dispatches, all at time 0). A round that could not dispatch K clients
(too few available, dropped) pops the in-flight clients it has, up to K. A masked
cohort client (unavailable, dropped) is not dispatched.

Client k's time is its clock time (``scenarios/system.py``'s ``Clock``:
latency_k + 2 * model_bytes / bandwidth_k + steps_k / speed_k, with the steps it
actually took); without a clock, one second per local step. Each round logs
``server/round_seconds`` (the clock's advance; the runner's ``clock_seconds`` sums
it), ``server/staleness`` (mean tau of the applied updates), ``server/applied``
(updates applied) and ``server/version``.

With K = C, staleness 0 for every update (all start from the current model), and
s(0) = 1, FedBuff's round is FedAvg's with the simple average (tested).

**Bounds on C.** K <= C (the buffer must fit in the pool; the round refuses a smaller
pool when it is traced) and C <= N: a client trains one task at a time, so at most N
can be in flight; a larger pool only delays the first server step (C / K rounds of
filling) and costs C x the model's size. The factory does not know N;
``check_concurrency(concurrency, num_clients, cohort_size)`` is the check for a
caller that does (the command line).

**Precision.** The staleness weight s(tau) is computed in the widest enabled float
(float64 under ``jax_enable_x64``, as DQN-Fed's Gram) and cast to each update's
dtype by the combination; in float32 runs nothing changes.

Symbols -> arguments: K = the cohort size, C = ``concurrency`` (K <= C <= N),
a = ``staleness_exponent`` (traced: ``jax.grad`` through it), eta_g = ``server_lr``,
alpha = ``alpha`` (traced), rho = ``rho`` (FedAsync; traced), gamma = the clients'
``training.lr``.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from fedjax_fair import hparams as H
from fedjax_fair.algorithms.fedavg import fedavg
from fedjax_fair.core.aggregators import UPDATE, Aggregator, plain_combine
from fedjax_fair.core.algorithm import FederatedAlgorithm, derive
from fedjax_fair.core.client import ClientTraining, proximal_term
from fedjax_fair.core.memory import tree_bytes
from fedjax_fair.scenarios.system import client_seconds
from fedjax_fair.algorithms.registry import register

HPARAMS = {"staleness_exponent": H.NONNEGATIVE, "server_lr": H.POSITIVE,
           "alpha": H.Range(0.0, 1.0, low_open=True),
           "concurrency": H.COUNT, "rho": H.NONNEGATIVE}


class Pool(NamedTuple):
    """The in-flight clients: C slots."""

    payload: Any  # [C, ...]: the update Delta_k (FedBuff) or the local model x_k (FedAsync)
    client_ids: jax.Array  # int32 [C]
    start_version: jax.Array  # int32 [C], the server version each client started from
    finish: jax.Array  # float32 [C], finish time of the client in the slot
    busy: jax.Array  # bool [C], whether the slot holds a client in flight
    version: jax.Array  # int32 [], server steps taken
    now: jax.Array  # float32 [], the clock at the last server step


def staleness_weight(tau, exponent):
    """s(tau) = (1 + tau)^(-a): FedBuff's 1 / sqrt(1 + tau) at a = 0.5; 1 at tau = 0.
    In the widest enabled float (``jnp.result_type(float)``: float64 under x64)."""
    dtype = jnp.result_type(float)
    return jnp.power(1.0 + jnp.asarray(tau).astype(dtype), -jnp.asarray(exponent, dtype))


def check_concurrency(concurrency, num_clients, cohort_size=None) -> int:
    """``concurrency`` C as an int if K <= C <= N, else a ``FieldError`` naming
    ``concurrency``. N = ``num_clients``: a client trains one task at a time, so no
    more than N can be in flight (a larger pool holds C updates of the model's size
    and takes C / K rounds to fill before the first server step: ``--hp
    concurrency=1000000`` on 6 clients never stepped in 2 rounds). K =
    ``cohort_size`` (optional): the buffer must fit in the pool. For callers that know
    N (the command line, before building anything); the factory does not."""
    c = H.count(concurrency, "concurrency")
    n = H.count(num_clients, "num_clients")
    if c > n:
        raise H.FieldError("concurrency", f"{c} clients in flight on a federation of {n}: "
                                          f"a client trains one task at a time, so "
                                          f"concurrency <= {n} (the number of clients)")
    if cohort_size is not None:
        k = H.count(cohort_size, "cohort_size")
        if c < k:
            raise H.FieldError("concurrency", f"{c} clients in flight cannot hold a cohort "
                                              f"of {k} (the buffer size): concurrency >= "
                                              f"cohort size")
    return c


def fedasync_cohort_note(cohort_size) -> Optional[str]:
    """The one line a caller shows when FedAsync runs with a cohort of K > 1 (None for
    K = 1, the paper's algorithm): each round then applies the mean of the K earliest
    arrivals' mixing steps as one server step, a buffered FedAsync."""
    k = H.count(cohort_size, "cohort_size")
    if k == 1:
        return None
    return (f"fedasync with cohort size {k}: each server step applies the mean of the {k} "
            f"earliest arrivals' mixing steps, w - (alpha / n) sum_k s(tau_k) (w - x_k) (a "
            f"buffered FedAsync); Xie et al.'s Algorithm 1 mixes in every arrival at once: "
            f"cohort size 1")


def buffered_aggregator(concurrency: int = 10, staleness_exponent=0.5,
                        mode: str = "buffer", alpha=1.0, clock=None) -> Aggregator:
    """The asynchronous server (module docstring) as an ``Aggregator`` over a ``Pool``:
    ``mode="buffer"``: FedBuff's (1 / n) sum s(tau) Delta over the n applied updates;
    ``mode="model"``: FedAsync's alpha s(tau) (w - x_k), averaged over them."""
    if mode not in ("buffer", "model"):
        raise H.FieldError("mode", f"must be 'buffer' or 'model', got {mode!r}")

    def init(params, num_clients: int) -> Pool:
        del num_clients
        return _empty_pool(params, concurrency)

    def aggregate(pool: Pool, outputs, weights, ctx, combine=plain_combine):
        del weights
        k = ctx.client_ids.shape[0]
        c = pool.finish.shape[0]
        if c < k:
            raise H.FieldError("concurrency", f"{c} clients in flight cannot hold a cohort of "
                                              f"{k} (the buffer size): concurrency >= cohort size")
        # ---- dispatch: the cohort's reporting clients take free slots, in cohort order
        free = ~pool.busy
        slots = jnp.argsort(~free, stable=True)[:k]  # free slots first
        rank = jnp.cumsum(ctx.client_mask) - 1  # the cohort member's place in line
        go = ctx.client_mask & (rank < jnp.sum(free))
        target = jnp.where(go, slots[jnp.clip(rank, 0, k - 1)], c)  # c: dropped
        seconds = (outputs.num_steps.astype(jnp.float32) if clock is None else  # 1 step/s
                   client_seconds(clock, outputs.num_steps, ctx.client_ids,
                                  tree_bytes(ctx.params)))
        payload = outputs.delta if mode == "buffer" else jax.tree.map(
            lambda p, d: p[None] - d, ctx.params, outputs.delta)
        put = lambda table, rows: table.at[target].set(rows.astype(table.dtype), mode="drop")
        pool = pool._replace(
            payload=jax.tree.map(put, pool.payload, payload),
            client_ids=put(pool.client_ids, ctx.client_ids),
            start_version=put(pool.start_version, jnp.full((k,), pool.version)),
            finish=put(pool.finish, pool.now + seconds),
            busy=pool.busy.at[target].set(True, mode="drop"))
        # ---- pop: the K earliest finishers, once C are in flight (or none can be added)
        in_flight = jnp.sum(pool.busy)
        starved = jnp.sum(go) < jnp.minimum(k, jnp.sum(free))
        step = (in_flight >= c) | (starved & (in_flight > 0))
        _, first = jax.lax.top_k(jnp.where(pool.busy, -pool.finish, -jnp.inf), k)
        arrived = pool.busy[first] & step
        tau = pool.version - pool.start_version[first]
        s = jnp.where(arrived, staleness_weight(tau, staleness_exponent), 0.0)
        count = jnp.maximum(jnp.sum(arrived), 1)
        rows = jax.tree.map(lambda t: t[first], pool.payload)
        if mode == "buffer":  # (1 / n) sum s(tau) Delta
            direction = combine(UPDATE, rows, s / count)
        else:  # w - x_k, mixed in with alpha s(tau)
            direction = combine(UPDATE, jax.tree.map(lambda p, r: p[None] - r, ctx.params, rows),
                                alpha * s / count)
        arrival = jnp.max(jnp.where(arrived, pool.finish[first], pool.now))
        busy = pool.busy.at[jnp.where(arrived, first, c)].set(False, mode="drop")
        applied = jnp.sum(arrived).astype(jnp.int32)
        info = {"round_seconds": (arrival - pool.now).astype(jnp.float32),
                "staleness": jnp.sum(jnp.where(arrived, tau, 0)) / count,
                "applied": applied, "version": pool.version + step.astype(jnp.int32)}
        pool = pool._replace(busy=busy, now=arrival,
                             version=pool.version + step.astype(jnp.int32))
        return direction, pool, info

    # the virtual clock orders the arrivals by each client's local steps
    return Aggregator(init, aggregate, combines=(UPDATE,), reads=("num_steps",))


def _empty_pool(params, c: int) -> Pool:
    return Pool(payload=jax.tree.map(lambda p: jnp.zeros((c, *p.shape), p.dtype), params),
                client_ids=jnp.full((c,), -1, jnp.int32),
                start_version=jnp.zeros((c,), jnp.int32),
                finish=jnp.zeros((c,), jnp.float32), busy=jnp.zeros((c,), bool),
                version=jnp.zeros((), jnp.int32), now=jnp.zeros((), jnp.float32))


def _asynchronous(model, training, aggregator, server_lr,
                  regularizer=None) -> FederatedAlgorithm:
    alg = fedavg(model, training=training, aggregator=aggregator,
                 server_optimizer=optax.sgd(server_lr), regularizer=regularizer,
                 weight_by_size=False)
    return derive(alg, lambda a: a._replace(clock=True))


def fedbuff(model, *, training: ClientTraining = ClientTraining(), concurrency: int = 10,
            staleness_exponent: float = 0.5, server_lr: float = 1.0,
            clock=None) -> FederatedAlgorithm:
    """FedBuff: the cohort size K is the buffer, ``concurrency`` C >= K the clients in
    flight (C = K: every round applies the K clients it dispatched; the default
    suits the default cohort of 10), updates weighted by (1 + tau)^(-staleness_exponent),
    w <- w - server_lr * their average. ``clock``: a ``system.clock`` timing each
    client (None: one second per local step)."""
    H.check(HPARAMS, concurrency=concurrency, staleness_exponent=staleness_exponent,
            server_lr=server_lr)
    return _asynchronous(model, training,
                         buffered_aggregator(concurrency, staleness_exponent, "buffer",
                                             clock=clock), server_lr)


def fedasync(model, *, training: ClientTraining = ClientTraining(),
             concurrency: int = 10, alpha: float = 0.6,
             staleness_exponent: float = 0.5, rho: float = 0.005,
             clock=None) -> FederatedAlgorithm:
    """FedAsync: run with cohort size 1 (each round one client finishes and is mixed in,
    w <- (1 - alpha s(tau)) w + alpha s(tau) x_k); ``concurrency`` clients in flight;
    each client's local SGD minimises f_k(x) + (rho / 2) ||x - x_tau||^2 from the
    model x_tau it received (rho = 0: plain local SGD). A cohort of K > 1 applies the
    mean of K mixing steps per round (module docstring; ``fedasync_cohort_note``)."""
    H.check(HPARAMS, concurrency=concurrency, alpha=alpha,
            staleness_exponent=staleness_exponent, rho=rho)
    return _asynchronous(model, training,
                         buffered_aggregator(concurrency, staleness_exponent, "model",
                                             alpha=alpha, clock=clock), 1.0,
                         regularizer=proximal_term(rho))


register("fedbuff", fedbuff, HPARAMS, family="participation", server_rate="server_lr", size_prior=None,
         clocked=True)
register("fedasync", fedasync, HPARAMS, family="participation", size_prior=None, clocked=True,
         note=fedasync_cohort_note)
