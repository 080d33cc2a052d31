"""A-FedPD and A-FedPDSAM — Sun, Shen, Tao, "A-FedPD: Aligning Dual-Drift is All
Federated Primal-Dual Learning Needs", NeurIPS 2024 (arXiv:2409.18915),
Algorithms 1 and 2.

Round t with cohort P^t of a federation of C clients, every client holding a dual
lambda_i (lambda_i^0 = 0):

    active i:   K local steps from theta^t on
                f_i(theta) + <lambda_i^t, theta - theta^t> + (rho / 2) ||theta - theta^t||^2
                (+ wd / 2 ||theta||^2), giving theta_i^{t+1};
                lambda_i^{t+1} = lambda_i^t + rho (theta_i^{t+1} - theta^t)
    server:     theta-bar^{t+1} = (1 / P) sum_{i in P^t} theta_i^{t+1}
    inactive i: lambda_i^{t+1} = lambda_i^t + rho (theta-bar^{t+1} - theta^t)   (virtual update)
    server:     lambda-bar^{t+1} = (1 / C) sum_i lambda_i^{t+1},
                theta^{t+1} = theta-bar^{t+1} + lambda-bar^{t+1} / rho.

The virtual update makes the mean dual move as under full participation,
lambda-bar^{t+1} = lambda-bar^t + rho (theta-bar^{t+1} - theta^t), so the server keeps
lambda-bar in O(d) and theta^{t+1} = 2 theta-bar^{t+1} - theta-bar^t. Inactive clients'
deviations lambda_i - lambda-bar never change: in the lazy table
(``client_table="lazy"``, client_states.py) the virtual update is one O(d) drift,
rows are stored as deviations from it, and a client never sampled costs nothing.

A-FedPDSAM (Algorithm 2) replaces the local gradient by SAM's,
grad f_i(theta + r g0 / (||g0|| + eps)) on the same minibatch; the dual, penalty and
weight-decay terms are added unperturbed. r (Algorithm 2's second "rho") is
``sam_radius``, separate from the penalty ``rho``.

Pieces (primal_dual.py): ``augmented_lagrangian`` (regularizer), ``dual_ascent``
(finish), ``virtual_dual_drift`` (drift), ``primal_dual_aggregator("virtual")``.

Symbols -> arguments: rho = ``rho`` (not in Table 3; we use 0.1, FedDyn's value;
traced), eta^t = ``training.lr`` (a schedule of the round for eta_0 d^t, e.g.
``lambda t: 0.1 * 0.998 ** t``), K = ``training.num_epochs`` x ceil(n_i / B) capped by
``training.max_steps``, B = ``training.batch_size`` (default 50:
``primal_dual.TRAINING``), wd = ``training.weight_decay`` (Table 3: 1e-3), r =
``sam_radius``, eps = ``sam_eps``; uniform
weights 1 / P (``weight_by_size``: n_i-weighted theta-bar, and lambda-bar follows
the same recursion). ``evaluate``: "average" evaluates theta-bar^t (the paper's
output, Theorem 1), "server" the broadcast theta^t.
"""
from __future__ import annotations

from fedjax_fair.core.algorithm import FederatedAlgorithm
from fedjax_fair.core.client import ClientTraining
from fedjax_fair.algorithms.families.primal_dual import HPARAMS as PD_HPARAMS
from fedjax_fair.algorithms.families.primal_dual import SAM_HPARAMS, TRAINING, primal_dual
from fedjax_fair.algorithms.registry import register

HPARAMS = dict(PD_HPARAMS)
SAM_VARIANT_HPARAMS = {**PD_HPARAMS, **SAM_HPARAMS}


def afedpd(model, *, rho: float = 0.1, training: ClientTraining = TRAINING,
           client_table: str = "dense", weight_by_size: bool = False,
           evaluate: str = "average") -> FederatedAlgorithm:
    """A-FedPD: augmented-Lagrangian local SGD, real dual updates for the cohort and
    virtual ones for every other client, theta = theta-bar + lambda-bar / rho.

    ``client_table``: "dense" (every dual rewritten every round), "lazy" or
    "lazy:CAPACITY" (deviations from the mean dual, rows only for clients sampled),
    each optionally ":bf16" storage."""
    return primal_dual(model, rho=rho, rule="virtual", training=training,
                       client_table=client_table, weight_by_size=weight_by_size,
                       evaluate=evaluate)


def afedpd_sam(model, *, rho: float = 0.1, sam_radius: float = 0.1, sam_eps: float = 1e-2,
               training: ClientTraining = TRAINING, client_table: str = "dense",
               weight_by_size: bool = False, evaluate: str = "average") -> FederatedAlgorithm:
    """A-FedPDSAM: A-FedPD with SAM local steps (radius ``sam_radius``, two gradient
    evaluations per step). ``sam_radius=0`` is A-FedPD."""
    return primal_dual(model, rho=rho, rule="virtual", training=training,
                       client_table=client_table, weight_by_size=weight_by_size,
                       evaluate=evaluate, sam_radius=sam_radius, sam_eps=sam_eps)


register("afedpd", afedpd, HPARAMS, family="primal_dual",
         search_space={"rho": (0.001, 0.01, 0.1, 1.0)},
         search_source="A-FedPD (arXiv:2409.18915), Table 3: rho in {1e-3, 1e-2, 0.1, 1}")
register("afedpd_sam", afedpd_sam, SAM_VARIANT_HPARAMS, family="primal_dual",
         search_space={"rho": (0.001, 0.01, 0.1, 1.0)},
         search_source="A-FedPD (arXiv:2409.18915), Table 3: rho in {1e-3, 1e-2, 0.1, 1}")
