"""FedSpeed — Sun, Shen, Huang, Ding, Tao, "FedSpeed: Larger Local Interval, Less
Communication Round, and Higher Generalization Accuracy", ICLR 2023
(arXiv:2302.10429), in the form the A-FedPD paper compares against ("SAM inside
FedDyn", its Appendix A.1): FedDyn's local solve and server with SAM's gradient,

    active i:   K steps theta <- theta - eta (grad f_i(theta + e; B) + lambda_i
                + rho (theta - theta^t) + wd theta),  e = r g0 / (||g0|| + eps),
                g0 = grad f_i(theta; B);
                lambda_i^{t+1} = lambda_i^t + rho (theta_i^{t+1} - theta^t)
    server:     lambda-bar^{t+1} = lambda-bar^t + (rho / C) sum_{i in P} (theta_i^{t+1} - theta^t),
                theta^{t+1} = theta-bar^{t+1} + lambda-bar^{t+1} / rho.

The original paper's merged perturbed / unperturbed gradient and corrected-model
aggregation are not reproduced (we follow the A-FedPD paper's description). ``sam_radius=0``
is FedDyn on the same keys.

Pieces (primal_dual.py): ``augmented_lagrangian``, ``dual_ascent``,
``primal_dual_aggregator("participants")``, SAM steps of ``client.local_sgd``.
Symbols -> arguments: rho = ``rho`` (Table 3: 0.1), r = ``sam_radius`` (0.1), eps =
``sam_eps`` (1e-2), the others as in afedpd.py.

Gradient clipping (``training.clip_norm`` c; off by default). FedSpeed's authors' code
(the FL-Simulator of its first author, github.com/woodenchild95/FL-Simulator:
``client/fedspeed.py``, ``optimizer/ESAM.py``, ``server/FedSpeed.py``; the A-FedPD
paper's FedSpeed row) takes the SAM gradient, adds the linear term's gradient rho
(h_i - theta^t) (``loss_correct.backward()``), clips the sum (``clip_grad_norm_``, max
norm 10), and adds (rho + wd) theta in the base optimizer's weight decay
(``SGD(weight_decay=wd + lamb)``). The default ``clip_mode="step"`` is that form here
(``primal_dual(..., penalty_as_decay=True)``, ``families.primal_dual.clip_split``):

    clip(grad f_i(theta + e; B) + lambda_i - rho theta^t) + (rho + wd) theta,

lambda_i = rho h_i, e from the minibatch loss alone, as above; ``"loss"`` clips
grad f_i(theta + e; B) alone. Without a clip (the default) the step is the one at the
top of this docstring. The simulator's SAM divides by ||g0|| + 1e-7: ``sam_eps=1e-7``
(docs/algorithms.md).
"""
from __future__ import annotations

from fedjax_fair.core.algorithm import FederatedAlgorithm
from fedjax_fair.core.client import ClientTraining
from fedjax_fair.algorithms.families.primal_dual import HPARAMS as PD_HPARAMS
from fedjax_fair.algorithms.families.primal_dual import SAM_HPARAMS, TRAINING, primal_dual
from fedjax_fair.algorithms.registry import register

HPARAMS = {**PD_HPARAMS, **SAM_HPARAMS}


def fedspeed(model, *, rho: float = 0.1, sam_radius: float = 0.1, sam_eps: float = 1e-2,
             training: ClientTraining = TRAINING, client_table: str = "dense",
             weight_by_size: bool = False, evaluate: str = "average") -> FederatedAlgorithm:
    """FedSpeed: FedDyn with SAM local steps."""
    return primal_dual(model, rho=rho, rule="participants", training=training,
                       client_table=client_table, weight_by_size=weight_by_size,
                       evaluate=evaluate, sam_radius=sam_radius, sam_eps=sam_eps,
                       penalty_as_decay=True)


register("fedspeed", fedspeed, HPARAMS, family="primal_dual",
         search_space={"rho": (0.001, 0.01, 0.1, 1.0)},
         search_source="A-FedPD (arXiv:2409.18915), Table 3: rho in {1e-3, 1e-2, 0.1, 1}")
