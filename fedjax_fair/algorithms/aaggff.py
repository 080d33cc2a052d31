"""AAggFF — Hahn, Kim, Lee, "Pursuing Overall Welfare in Federated Learning via
Sequential Decision Making", ICML 2024 (arXiv:2405.20821); S.-J. Hahn, PhD thesis "Algorithms for
Collaborative Machine Learning under Statistical Heterogeneity", UNIST 2024, Ch. III
(equation numbers below are the thesis's).

The server is an online decision maker: each round it commits to mixing
coefficients p^(t) on the simplex over the K clients of the federation, observes a
response r^(t) built from the clients' losses and pays the log-wealth decision loss

    l^(t)(p) = -log(1 + <p, r^(t)>),    grad l^(t)(p) = -r^(t) / (1 + <p, r^(t)>).

Responses (eq. 3.8): r_i = C1 + (C2 - C1) CDF(F_i / Fbar), F_i = loss of the global
model on client i's training rows before local training (``ClientOutput.loss_before``),
Fbar the mean over this round's participants, CDF one of six fixed distributions
(``CDFS``).

AAggFF-S (cross-silo, full participation; Online Newton Step in FTRL form, eq. 3.7):

    g = -r / (1 + <p, r>),  A += g g^T,  b += (1 - beta <g, p>) g,
    p^(t+1) = argmin_{p in Delta} 1/2 p^T (alpha I + beta A) p + b^T p,
    C1 = 0, C2 = 1/K, L = C2 / (1 + C1), alpha = 4 K L = 4, beta = 1 / (4 L) = K / 4.

AAggFF-D (cross-device, partial participation; linearised FTRL with a doubly robust
estimate, eqs. 3.10-3.12), m sampled clients, C = m / K:

    rbar = mean_{i in S} r_i,
    rbreve_i = rbar + (r_i - rbar) / C  (i in S),   rbreve_i = rbar  (i not in S),
    gbreve = -rbreve / (1 + rbar) + rbar (<p, rbreve> - rbar) / (1 + rbar)^2 1_K,
    s += gbreve,  p^(t+1) = softmax(-s / zeta^(t+1)),  zeta^(t) = Lbreve sqrt(t) / sqrt(log K),
    C1 = 0, C2 = C, Lbreve = C2/(1+C1) + 2 (C2-C1) / (C (1+C1)) = C + 2 (C2/(1+C1) if C = 1).

Both then aggregate this round's updates with the NEW decision renormalised over the
cohort (eq. 3.13): ptilde_i = p_i^(t+1) / sum_{j in S} p_j^(t+1); the server step is
the algorithm's (default theta - sum_i ptilde_i Delta_i).

The default (``variant="thesis"``) follows the thesis; ``variant="reference"``
reproduces the authors' PyTorch code (github.com/vaseline555/AAggFF, commit 3932c3d,
``src/server/aaggffserver.py``) where the two differ. Every difference:

    what                        thesis (default)                  authors' code
R   ONS objective (eq. 3.7)     B = alpha I + beta A,             B = alpha (1 + beta) I
                                b = sum (1 - beta <g, p>) g           + beta A, b = sum g
R   initial decision (Alg. 3.1) p^(1) = 1/K                       C 1_K, off-simplex (S: 1_K)
R   DR value (eq. 3.10)         rbar + (r_i - rbar) / C           (r_i - rbar) / C
R   Lbreve (Lemma 3.5)          C2/(1+C1) + 2 (C2-C1)/(C (1+C1)); 2 + C at every C
                                C2/(1+C1) at full participation
R   Normal transform (id 3)     Phi(x - 1): increasing in F_i,    (1 + erfc((x - 1)/sqrt 2)) / 2
                                in [0, 1], 1/2 at the mean loss   = 1.5 - Phi(x - 1): decreasing
                                                                  in F_i, in (0.5, 1.35), 1 at
                                                                  the mean loss
-   propensity (Alg. 3.2)       C = m / K (the realised cohort)   the nominal fraction C (also
                                                                  as C2 and in 2 + C)
-   server LR                   constant                          divided by phi at every
                                                                  client-LR decay (run option,
                                                                  see ``compensate_server_lr``)
-   Fbar = 0, Frechet at x = 0  clamped to >= 1e-12               raw division (NaN / inf)
-   QP of AAggFF-S              FISTA, ``num_iters`` steps        cvxpy (exact)
-   S or D                      the user's choice (S needs        ONS iff C == 1, else FTRL
                                full participation)

R: reproduced by ``variant="reference"``; -: the same in both variants (the rule sees
m, not the nominal C; the two agree when C K is an integer; the server-LR
compensation belongs to the run, not to the mixing rule; the guards only act on
degenerate losses).
The five other CDF ids 0-2, 4, 5 compute exactly the thesis CDFs in the authors' code
(``REFERENCE_TRANSFORMS``). Identical in both: alpha = 4 K L, beta = 1 / (4 L) with
L = 1/K for the default (0, 1/K); C1 = 0, C2 = 1/K (S) or C (D); F_i = the mean
per-example training loss of the global model before local training; zeta^(t+1)
with sqrt(t + 1) after t gradients; aggregation with p^(t+1) renormalised over S.

Symbols -> arguments: the CDF = ``cdf`` (a name of ``CDFS`` or the reference code's
``fair_const`` id 0-5); [C1, C2] = ``response_range`` (None: the defaults above);
alpha, beta = ``alpha``, ``beta`` (None: the Theorem 3.1 values); the number of QP
iterations = ``num_iters``; K = the number of clients of the federation
(``init(num_clients)``); S = the cohort's unmasked rows. The state holds p, A, b
(S) or p, s (D) over ALL K clients, indexed by client id.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.scipy.special import erfc, ndtr

from fedjax_fair import hparams as H
from fedjax_fair.core.algorithm import FederatedAlgorithm
from fedjax_fair.algorithms.families.training import Rate, Transform
from fedjax_fair.algorithms.fedavg import fedavg
from fedjax_fair.core.client import ClientTraining
from fedjax_fair.core.mixing import MixingRule, normalize
from fedjax_fair.solvers.online import (diagonal_simplex_qp, entropic_ftrl,
                                        psd_lipschitz_bound, simplex_qp)
from fedjax_fair.core.types import ClientOutput, ServerContext
from fedjax_fair.algorithms.registry import register

VARIANTS = ("thesis", "reference")
HPARAMS = {"alpha": H.Range(0.0, None, low_open=True, nullable=True),
           "beta": H.Range(0.0, None, nullable=True),
           "num_iters": H.COUNT, "server_lr": H.POSITIVE}
SOLVERS = ("fista", "diagonal")
_FRECHET_MIN = 1e-12
_MEAN_MIN = 1e-12

# --------------------------------------------------------------------------------------
# Response transforms (Def. 3.4, Table 3.3): CDF(x), x = F_i / Fbar >= 0.


def weibull_cdf(x):
    """Weibull(scale 1, shape 2): 1 - exp(-x^2)."""
    return -jnp.expm1(-jnp.square(x))


def exponential_cdf(x):
    """Exponential(rate 1): 1 - exp(-x)."""
    return -jnp.expm1(-x)


def frechet_cdf(x):
    """Frechet(scale 1, shape 1): exp(-1/x), x clamped to >= 1e-12 (the thesis does not guard x = 0)."""
    return jnp.exp(-1.0 / jnp.maximum(x, _FRECHET_MIN))


def normal_cdf(x):
    """Normal(mean 1, sd 1): (1 + erf((x - 1) / sqrt 2)) / 2."""
    return ndtr(x - 1.0)


def gumbel_cdf(x):
    """Gumbel(loc 1, scale 1): exp(-exp(-(x - 1)))."""
    return jnp.exp(-jnp.exp(-(x - 1.0)))


def logistic_cdf(x):
    """Logistic(loc 1, scale 1): 1 / (1 + exp(-(x - 1)))."""
    return jax.nn.sigmoid(x - 1.0)


CDFS = {"weibull": weibull_cdf, "exponential": exponential_cdf, "frechet": frechet_cdf,
        "normal": normal_cdf, "gumbel": gumbel_cdf, "logistic": logistic_cdf}
CDF_IDS = ("weibull", "exponential", "frechet", "normal", "gumbel", "logistic")
"""The reference code's ``fair_const`` ids 0-5, in order."""


def reference_normal_transform(x):
    """The authors' code's id 3 ("Normal CDF, mean 1, sd 1"): (1 + erfc((x - 1) / sqrt 2)) / 2.

    erfc = 1 - erf, so this is 1.5 - Phi(x - 1), NOT the Normal CDF Phi(x - 1) of
    Table 3.3: it decreases from 1.5 - Phi(-1) ~ 1.34 at x = 0 through 1 at the mean
    loss (x = 1) to 0.5 as x -> inf, so a client with a higher loss gets a SMALLER
    response, and r exceeds C2 for every loss below the mean. The two forms agree
    only where Phi(x - 1) = 3/4 (x ~ 1.674).
    """
    return 0.5 * (1.0 + erfc((x - 1.0) / math.sqrt(2.0)))


REFERENCE_TRANSFORMS = {**CDFS, "normal": reference_normal_transform}
"""The transform of each CDF name in the authors' code (``variant="reference"``): ids
0-2, 4, 5 compute exactly the thesis CDFs; id 3 is ``reference_normal_transform``."""

REFERENCE_CDFS = {"berka": "normal", "mqp": "logistic", "isic2019": "weibull",
                  "celeba": "gumbel", "reddit": "frechet", "speechcommands": "weibull",
                  "heart": "frechet", "tinyimagenet": "exponential"}
"""The CDF of the authors' run scripts per dataset (the thesis does not state it); tune over ``CDFS`` else.
Their "normal" (Berka) is ``reference_normal_transform``, i.e. ``variant="reference"``."""


def cdf_name(cdf: Union[str, int]) -> str:
    """The canonical name of ``cdf`` (a name of ``CDFS`` or a reference id 0-5)."""
    if isinstance(cdf, (int, np.integer)) and not isinstance(cdf, bool):
        if not 0 <= int(cdf) < len(CDF_IDS):
            raise H.FieldError("cdf", f"id must be in 0..{len(CDF_IDS) - 1}, got {cdf}")
        return CDF_IDS[int(cdf)]
    if isinstance(cdf, str) and cdf.lower() in CDFS:
        return cdf.lower()
    raise H.FieldError("cdf", f"unknown {cdf!r}; allowed: {sorted(CDFS)} or ids 0-5")


def get_cdf(cdf: Union[str, int]):
    """The CDF function for a name or reference id."""
    return CDFS[cdf_name(cdf)]


def get_transform(cdf: Union[str, int], variant: str = "thesis"):
    """The response transform for a CDF name or reference id: the thesis CDF
    (``CDFS``), or under ``variant="reference"`` what the authors' code computes for
    that id (``REFERENCE_TRANSFORMS``; differs for "normal" = id 3 only)."""
    _check_variant(variant)
    return (CDFS if variant == "thesis" else REFERENCE_TRANSFORMS)[cdf_name(cdf)]


def transform_responses(losses, client_mask, cdf: Union[str, int] = "normal",
                        lower=0.0, upper=1.0, *, variant: str = "thesis"):
    """r_i = C1 + (C2 - C1) CDF(F_i / Fbar) (eq. 3.8) for the cohort's losses.

    Parameters
    ----------
    losses : [K] F_i(theta^(t)), the losses before local training.
    client_mask : [K] bool; Fbar is the mean over the True rows, and False rows get 0.
    cdf : a name of ``CDFS`` or a reference id 0-5.
    lower, upper : C1 <= C2, the response range (scalars, may be traced).
    variant : "reference" applies the authors' transform of ``cdf``
        (``get_transform``): for "normal" (id 3) 1.5 - Phi(x - 1), decreasing in F_i
        and in C1 + (C2 - C1) (0.5, 1.35).

    Fbar is clamped to >= 1e-12, so all-zero losses give CDF(0) (the thesis does not guard Fbar = 0; the
    authors' code divides by the raw mean). The thesis map is increasing in F_i;
    both variants are invariant to scaling all losses by c > 0.
    """
    fn = get_transform(cdf, variant)
    losses = jnp.asarray(losses, jnp.float32)
    mask = jnp.asarray(client_mask, bool)
    observed = jnp.where(mask, losses, 0.0)
    mean = jnp.sum(observed) / jnp.maximum(jnp.sum(mask), 1)
    x = observed / jnp.maximum(mean, _MEAN_MIN)
    r = lower + (upper - lower) * fn(x)
    return jnp.where(mask, r, 0.0)


# --------------------------------------------------------------------------------------
# Decision loss and its gradients.


def decision_loss(p, r):
    """l(p) = -log(1 + <p, r>) (negative log wealth, thesis §3.3)."""
    return -jnp.log1p(jnp.vdot(p, r))


def ons_gradient(p, r):
    """grad l(p) = -r / (1 + <p, r>)."""
    return -r / (1.0 + jnp.vdot(p, r))


def linearized_gradient(r, r0, p):
    """First-order expansion of h(r) = -r / (1 + <p, r>) around ``r0`` (Lemma 3.3):

        htilde(r) = -r / (1 + <p, r0>) + r0 <p, r - r0> / (1 + <p, r0>)^2.

    ``r`` [K]; ``r0`` [K] or a scalar (AAggFF-D: rbar 1_K); ``p`` [K]. Affine in r and
    exact at r = r0.
    """
    r0 = jnp.broadcast_to(jnp.asarray(r0, r.dtype), r.shape)
    denom = 1.0 + jnp.vdot(p, r0)
    return -r / denom + r0 * (jnp.vdot(p, r - r0) / jnp.square(denom))


def doubly_robust_responses(responses, client_ids, client_mask, num_clients: int,
                            propensity, imputation, *, variant: str = "thesis"):
    """The doubly robust estimate of the full response vector (eq. 3.10).

        rbreve_i = (1 - 1[i in S] / C) rhat_i + 1[i in S] / C r_i,

    i.e. rhat_i off the sample and rhat_i + (r_i - rhat_i) / C on it.

    Parameters
    ----------
    responses : [K] observed responses of the cohort rows.
    client_ids : [K] int, the rows' client ids in 0..num_clients-1.
    client_mask : [K] bool; False rows are not observed and write nothing.
    num_clients : N, static.
    propensity : C = P(i in S) (AAggFF-D: m / N).
    imputation : rhat, a scalar or [N] (AAggFF-D: the sample mean rbar).
    variant : "reference" writes (r_i - rhat_i) / C on the sample (it drops rbar).

    Returns
    -------
    [N] estimate over all clients. With rhat independent of S it is unbiased; with
    rhat = rbar (same sample) E[rbreve_i] - r_i = (K - m) / (m (K - 1)) (rbar_pop - r_i)
    (Lemma 3.2 treats rbar as a constant).
    """
    _check_variant(variant)
    dtype = jnp.asarray(responses).dtype
    imputation = jnp.broadcast_to(jnp.asarray(imputation, dtype), (num_clients,))
    safe_ids = jnp.clip(client_ids, 0, num_clients - 1)
    rhat = imputation[safe_ids]
    corrected = (responses - rhat) / propensity
    if variant == "thesis":
        corrected = rhat + corrected
    ids = jnp.where(client_mask, client_ids, num_clients)
    return imputation.at[ids].set(corrected.astype(dtype), mode="drop")


def _check_variant(variant):
    if variant not in VARIANTS:
        raise H.FieldError("variant", f"must be one of {VARIANTS}, got {variant!r}")


# --------------------------------------------------------------------------------------
# AAggFF-S: Online Newton Step.


class ONSState(NamedTuple):
    """AAggFF-S server state over all N clients.

    decision: [N] p^(t), on the simplex.
    hessian: [N, N] A_t = sum_tau g g^T (or its diagonal [N] with ``solver="diagonal"``).
    linear: [N] b_t.
    round: int32 [] t, the number of gradients accumulated.
    """

    decision: jax.Array
    hessian: jax.Array
    linear: jax.Array
    round: jax.Array


def ons_defaults(num_clients: int, lower: float = 0.0, upper: Optional[float] = None):
    """(alpha, beta) of Theorem 3.1: alpha = 4 K L, beta = 1 / (4 L), L = C2 / (1 + C1);
    C2 defaults to 1/K, giving (4, K/4)."""
    upper = 1.0 / num_clients if upper is None else upper
    lip = upper / (1.0 + lower)
    return 4.0 * num_clients * lip, 1.0 / (4.0 * lip)


def ons_init(num_clients: int, *, solver: str = "fista") -> ONSState:
    """p^(1) = 1/N, A = 0, b = 0, t = 0."""
    hess_shape = (num_clients,) if solver == "diagonal" else (num_clients, num_clients)
    return ONSState(decision=jnp.full((num_clients,), 1.0 / num_clients, jnp.float32),
                    hessian=jnp.zeros(hess_shape, jnp.float32),
                    linear=jnp.zeros((num_clients,), jnp.float32),
                    round=jnp.zeros((), jnp.int32))


def ons_step(state: ONSState, responses, *, alpha: float, beta: float,
             variant: str = "thesis", num_iters: int = 300, solver: str = "fista",
             initial_decision=None) -> ONSState:
    """One AAggFF-S decision update from a full response vector ``responses`` [N].

    thesis (eq. 3.7):  g = -r / (1 + <p, r>), A += g g^T, b += (1 - beta <g, p>) g,
        p' = argmin_Delta 1/2 p^T (alpha I + beta A) p + b^T p;
    reference code:    b += g, p' = argmin_Delta 1/2 p^T (alpha (1 + beta) I + beta A) p + b^T p.

    ``solver="diagonal"`` keeps only diag(A) and uses the water-filling closed form of
    the diagonal QP (an approximation; loses the log T guarantee). ``initial_decision``
    (reference variant) replaces p in the first round (t = 0).
    """
    _check_variant(variant)
    if solver not in SOLVERS:
        raise H.FieldError("solver", f"must be one of {SOLVERS}, got {solver!r}")
    p = state.decision
    if initial_decision is not None:
        p = jnp.where(state.round == 0, jnp.asarray(initial_decision, p.dtype), p)
    r = jnp.asarray(responses, p.dtype)
    g = ons_gradient(p, r)
    if variant == "thesis":
        linear = state.linear + (1.0 - beta * jnp.vdot(g, p)) * g
        ridge = alpha
    else:
        linear = state.linear + g
        ridge = alpha * (1.0 + beta)
    if solver == "diagonal":
        hessian = state.hessian + jnp.square(g)
        decision = diagonal_simplex_qp(ridge + beta * hessian, linear)
    else:
        hessian = state.hessian + jnp.outer(g, g)
        k = p.shape[0]
        B = ridge * jnp.eye(k, dtype=p.dtype) + beta * hessian
        # lambda_max(B) <= ridge + beta min(tr A, Gershgorin(A)) (alpha + beta tr A).
        decision = simplex_qp(B, linear, init=state.decision, num_iters=num_iters,
                              strong_convexity=ridge,
                              lipschitz=ridge + beta * psd_lipschitz_bound(hessian))
    return ONSState(decision, hessian, linear, state.round + 1)


def _resolve_range(response_range, name="response_range"):
    """(C1, C2) or None; concrete values are checked, traced ones pass."""
    if response_range is None:
        return None
    try:
        lower, upper = response_range
    except (TypeError, ValueError):
        raise H.FieldError(name, f"must be a pair (C1, C2) of floats, got {response_range!r}")
    if not (H.is_concrete(lower) and H.is_concrete(upper)):
        return lower, upper
    try:
        lower, upper = float(lower), float(upper)
    except (TypeError, ValueError):
        raise H.FieldError(name, f"must be a pair (C1, C2) of floats, got {response_range!r}")
    if not (0.0 <= lower <= upper and upper > 0.0 and math.isfinite(upper)):
        raise H.FieldError(name, f"need 0 <= C1 <= C2 and 0 < C2 < inf, got {response_range!r}")
    return lower, upper


def _masked_mean(x, mask):
    return jnp.sum(jnp.where(mask, x, 0.0)) / jnp.maximum(jnp.sum(mask), 1)


def _keep_if(cond, new, old):
    return jax.tree.map(lambda a, b: jnp.where(cond, a, b), new, old)


def aaggff_s_mixing(*, cdf: Union[str, int] = "normal", response_range=None,
                    alpha: Optional[float] = None, beta: Optional[float] = None,
                    variant: str = "thesis", num_iters: int = 300,
                    solver: str = "fista") -> MixingRule:
    """AAggFF-S mixing rule (Online Newton Step over all N clients; eq. 3.7).

    Needs full participation: the cohort must hold every client (sampler
    ``fedjax_fair.scenarios.sampling.full``); a cohort smaller than the federation raises.
    Clients masked out of a round (padding) get the mean observed response, write
    nothing else and get weight 0; a round with no participant leaves the state as is.

    Parameters
    ----------
    cdf : response CDF (``CDFS`` name or reference id 0-5). Default "normal", the better
        CDF of the thesis's ablation (§5.1); see ``REFERENCE_CDFS`` per dataset.
    response_range : (C1, C2); None = (0, 1/N).
    alpha, beta : ridge and exp-concavity constants; None = Theorem 3.1
        (alpha = 4 N L, beta = 1 / (4 L), L = C2 / (1 + C1): 4 and N/4 by default).
        alpha > 0, beta >= 0 (beta = 0: FTRL with an L2 regulariser).
    variant : "thesis" (eq. 3.7) or "reference" (the authors' code: their ONS
        objective, p^(1) = 1_N and their Normal transform; module doc).
    num_iters : accelerated projected-gradient iterations of the QP per round.
    solver : "fista" (exact QP) or "diagonal" (diag(A) only, O(N) memory).
    """
    name = cdf_name(cdf)
    rng = _resolve_range(response_range)
    _check_variant(variant)
    if solver not in SOLVERS:
        raise H.FieldError("solver", f"must be one of {SOLVERS}, got {solver!r}")
    H.check(HPARAMS, alpha=alpha, beta=beta)
    if not (isinstance(num_iters, (int, np.integer)) and num_iters >= 1):
        raise H.FieldError("num_iters", f"must be an int >= 1, got {num_iters!r}")

    def init(num_clients: int) -> ONSState:
        return ons_init(num_clients, solver=solver)

    def update(state: ONSState, outputs: ClientOutput, ctx: ServerContext):
        client_ids, client_mask = ctx.client_ids, ctx.client_mask
        n = state.decision.shape[0]
        if client_ids.shape[0] < n:
            raise H.FieldError("cohort_size", f"AAggFF-S needs full participation (a cohort of "
                                              f"all {n} clients, sampler 'full'), got "
                                              f"{client_ids.shape[0]}; "
                                              f"use aaggff_d for partial participation")
        lower, upper = rng if rng is not None else (0.0, 1.0 / n)
        d_alpha, d_beta = ons_defaults(n, lower, upper)
        a = d_alpha if alpha is None else alpha
        b = d_beta if beta is None else beta
        r_obs = transform_responses(outputs.loss_before, client_mask, name, lower, upper,
                                    variant=variant)
        # Observed rows write their response; unobserved clients get the observed mean.
        r = doubly_robust_responses(r_obs, client_ids, client_mask, n, 1.0,
                                    _masked_mean(r_obs, client_mask))
        init_p = jnp.ones((n,), jnp.float32) if variant == "reference" else None
        new = ons_step(state, r, alpha=a, beta=b, variant=variant, num_iters=num_iters,
                       solver=solver, initial_decision=init_p)
        new = _keep_if(jnp.any(client_mask), new, state)
        weights = normalize(new.decision[jnp.clip(client_ids, 0, n - 1)], client_mask)
        return weights, new

    return MixingRule(init, update, losses_only=True)  # reads loss_before alone


# --------------------------------------------------------------------------------------
# AAggFF-D: linearised FTRL with the doubly robust estimator.


class FTRLState(NamedTuple):
    """AAggFF-D server state over all N clients.

    decision: [N] p^(t) = softmax(-s / zeta).
    grad_sum: [N] s^(t) = sum_tau gbreve^(tau).
    round: int32 [] t, the number of gradients accumulated.
    """

    decision: jax.Array
    grad_sum: jax.Array
    round: jax.Array


def ftrl_init(num_clients: int) -> FTRLState:
    """p^(1) = 1/N, s = 0, t = 0."""
    return FTRLState(decision=jnp.full((num_clients,), 1.0 / num_clients, jnp.float32),
                     grad_sum=jnp.zeros((num_clients,), jnp.float32),
                     round=jnp.zeros((), jnp.int32))


def dr_lipschitz(propensity, lower, upper, *, full_participation=None,
                 variant: str = "thesis"):
    """Lbreve of Lemma 3.5, C2/(1+C1) + 2 (C2-C1) / (C (1+C1)); L = C2/(1+C1) at full
    participation (Theorem 3.2). The reference code uses 2 + C always."""
    if variant == "reference":
        return 2.0 + propensity
    base = upper / (1.0 + lower)
    dr = base + 2.0 * (upper - lower) / (propensity * (1.0 + lower))
    if full_participation is None:
        return dr
    return jnp.where(full_participation, base, dr)


def ftrl_step(state: FTRLState, responses, client_ids, client_mask, *, lower=0.0,
              upper=None, variant: str = "thesis") -> FTRLState:
    """One AAggFF-D decision update from the cohort's responses [K].

    With m = #unmasked rows, C = m / N (the reference code uses the nominal C), rbar their mean response:
    rbreve = ``doubly_robust_responses(..., C, rbar)``,
    gbreve = ``linearized_gradient(rbreve, rbar, p)``, s += gbreve, t += 1,
    p' = softmax(-s sqrt(log N) / (Lbreve sqrt(t + 1))). ``upper`` (C2) None = C; it
    only enters Lbreve here (the responses are already scaled).
    In the reference variant the first round's p is C 1_N (off-simplex).
    A round with no unmasked row leaves the state unchanged.
    """
    _check_variant(variant)
    n = state.decision.shape[0]
    mask = jnp.asarray(client_mask, bool)
    m = jnp.sum(mask)
    c = jnp.maximum(m, 1).astype(jnp.float32) / n
    c2 = c if upper is None else upper
    rbar = _masked_mean(responses, mask)
    r_breve = doubly_robust_responses(responses, client_ids, mask, n, c, rbar, variant=variant)
    p = state.decision
    if variant == "reference":
        p = jnp.where(state.round == 0, c * jnp.ones_like(p), p)
    g = linearized_gradient(r_breve, rbar, p)
    grad_sum = state.grad_sum + g
    t = state.round + 1
    lip = dr_lipschitz(c, lower, c2, full_participation=m >= n, variant=variant)
    zeta = lip * jnp.sqrt(t + 1.0) / math.sqrt(max(math.log(n), 1e-12))
    new = FTRLState(entropic_ftrl(grad_sum, zeta), grad_sum, t)
    return _keep_if(m > 0, new, state)


def aaggff_d_mixing(*, cdf: Union[str, int] = "normal", response_range=None,
                    variant: str = "thesis") -> MixingRule:
    """AAggFF-D mixing rule (linearised FTRL + doubly robust estimator; eqs. 3.10-3.12).

    Works with any sampler; the propensity is C = m / N with m the cohort's unmasked
    rows (C = 1 under full participation, where the estimator is exact). The state is
    a dense [N] vector over all clients; masked rows write nothing and get weight 0.

    Parameters
    ----------
    cdf : response CDF (``CDFS`` name or reference id 0-5); default "normal".
    response_range : (C1, C2); None = (0, C).
    variant : "thesis" or "reference" (the authors' code: their DR value, 2 + C,
        p^(1) = C 1_N and their Normal transform; module doc).
    """
    name = cdf_name(cdf)
    rng = _resolve_range(response_range)
    _check_variant(variant)

    def init(num_clients: int) -> FTRLState:
        return ftrl_init(num_clients)

    def update(state: FTRLState, outputs: ClientOutput, ctx: ServerContext):
        client_ids, client_mask = ctx.client_ids, ctx.client_mask
        n = state.decision.shape[0]
        m = jnp.sum(client_mask)
        c = jnp.maximum(m, 1).astype(jnp.float32) / n
        lower, upper = rng if rng is not None else (0.0, c)
        r_obs = transform_responses(outputs.loss_before, client_mask, name, lower, upper,
                                    variant=variant)
        new = ftrl_step(state, r_obs, client_ids, client_mask, lower=lower, upper=upper,
                        variant=variant)
        weights = normalize(new.decision[jnp.clip(client_ids, 0, n - 1)], client_mask)
        return weights, new

    return MixingRule(init, update, losses_only=True)  # reads loss_before alone


# --------------------------------------------------------------------------------------
# Algorithm factories.


def aaggff_s(model, *, cdf: Union[str, int] = "normal", response_range: Optional[tuple] = None,
             alpha: Optional[float] = None, beta: Optional[float] = None,
             variant: str = "thesis", num_iters: int = 300, solver: str = "fista",
             training: ClientTraining = ClientTraining(), server_lr: Rate = 1.0,
             server_optimizer: Optional[Transform] = None) -> FederatedAlgorithm:
    """AAggFF-S: FedAvg clients, ONS mixing (``aaggff_s_mixing``); run it with full
    participation (sampler ``full``). The server steps by ``server_lr`` (a number or a
    schedule; the reference code's global rate, see ``schedules.compensated``) unless a
    ``server_optimizer`` is given."""
    return fedavg(model, mixing=aaggff_s_mixing(cdf=cdf, response_range=response_range,
                                                alpha=alpha, beta=beta, variant=variant,
                                                num_iters=num_iters, solver=solver),
                  training=training,
                  server_optimizer=server_optimizer or _server_sgd(server_lr))


def aaggff_d(model, *, cdf: Union[str, int] = "normal", response_range: Optional[tuple] = None,
             variant: str = "thesis", training: ClientTraining = ClientTraining(),
             server_lr: Rate = 1.0,
             server_optimizer: Optional[Transform] = None) -> FederatedAlgorithm:
    """AAggFF-D: FedAvg clients, linearised-FTRL mixing (``aaggff_d_mixing``) for
    partial participation; ``server_lr`` as in ``aaggff_s``."""
    return fedavg(model, mixing=aaggff_d_mixing(cdf=cdf, response_range=response_range,
                                                variant=variant),
                  training=training,
                  server_optimizer=server_optimizer or _server_sgd(server_lr))


def _server_sgd(server_lr: Rate):
    """The reference code's server step theta <- theta - eta_g * direction."""
    if not callable(server_lr):
        HPARAMS["server_lr"].check("server_lr", server_lr)
    return optax.sgd(server_lr)


# --------------------------------------------------------------------------------------
# Benchmark helper.


def aaggff_server_step(num_clients: int, *, mode: str = "s", cohort_size: Optional[int] = None,
                       seed: int = 0, **rule_kwargs):
    """One AAggFF server (mixing) step for ``num_clients`` clients, for timing.

    Returns ``(step, args)``: ``step(*args) -> (weights, state)`` is the rule's pure
    ``update`` (wrap it in ``jax.jit``) and ``args = (state, outputs, ctx)`` example
    inputs with random losses. ``mode="s"``: ONS over all
    clients (O(N^2) memory, O(num_iters N^2) time); ``mode="d"``: FTRL with a cohort of
    ``cohort_size`` clients (default max(1, N // 100); O(N)). ``rule_kwargs`` go to the
    mixing rule (e.g. ``num_iters``, ``solver``, ``cdf``).
    """
    if mode not in ("s", "d"):
        raise H.FieldError("mode", f"must be 's' or 'd', got {mode!r}")
    if num_clients < 1:
        raise H.FieldError("num_clients", f"must be >= 1, got {num_clients}")
    rng = np.random.default_rng(seed)
    if mode == "s":
        rule = aaggff_s_mixing(**rule_kwargs)
        k = num_clients
        ids = np.arange(k)
    else:
        rule = aaggff_d_mixing(**rule_kwargs)
        k = max(1, num_clients // 100) if cohort_size is None else cohort_size
        if not 1 <= k <= num_clients:
            raise H.FieldError("cohort_size", f"must be in 1..{num_clients}, got {k}")
        ids = np.sort(rng.choice(num_clients, k, replace=False))
    outputs = ClientOutput(delta=(), loss_before=jnp.asarray(rng.gamma(2.0, 0.5, k), jnp.float32),
                           num_examples=jnp.full((k,), 10, jnp.int32),
                           num_steps=jnp.ones((k,), jnp.int32))
    ctx = ServerContext(params=(), round=jnp.zeros((), jnp.int32), key=jax.random.key(seed),
                        client_ids=jnp.asarray(ids, jnp.int32), client_mask=jnp.ones((k,), bool))
    return rule.update, (rule.init(num_clients), outputs, ctx)


__all__ = ["CDFS", "CDF_IDS", "FTRLState", "ONSState", "REFERENCE_CDFS", "REFERENCE_TRANSFORMS",
           "aaggff_d",
           "aaggff_d_mixing", "aaggff_s", "aaggff_s_mixing", "aaggff_server_step", "cdf_name",
           "decision_loss", "doubly_robust_responses", "dr_lipschitz", "exponential_cdf",
           "frechet_cdf", "ftrl_init", "ftrl_step", "get_cdf", "get_transform", "gumbel_cdf",
           "linearized_gradient", "logistic_cdf", "normal_cdf", "ons_defaults", "ons_gradient",
           "ons_init", "ons_step", "reference_normal_transform", "transform_responses",
           "weibull_cdf"]


register("aaggff_s", aaggff_s, HPARAMS, family="fair", participation="full", server_rate="server_lr",
         size_prior=None)
register("aaggff_d", aaggff_d, HPARAMS, family="fair", server_rate="server_lr", size_prior=None)
