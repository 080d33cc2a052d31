"""FedDyn — Acar, Zhao, Matas, Mattina, Whatmough, Saligrama, "Federated Learning
Based on Dynamic Regularization", ICLR 2021 (arXiv:2111.04263), Algorithm 1.

Every client i keeps the gradient of its last local objective, g_i = grad L_i at
its previous local model (g_i = 0 at the start), and solves the dynamically
regularised problem from the server model theta^{t-1}:

    theta_i^t = argmin_theta L_i(theta) - <g_i, theta> + (alpha / 2) ||theta - theta^{t-1}||^2,
    g_i <- g_i - alpha (theta_i^t - theta^{t-1}).

The server keeps h (h = 0 at the start) and, over the cohort P of a federation of
N clients,

    h <- h - (alpha / N) sum_{i in P} (theta_i^t - theta^{t-1}),
    theta^t = (1 / |P|) sum_{i in P} theta_i^t - h / alpha.

With Delta_i = theta^{t-1} - theta_i^t this is theta^t = theta^{t-1} - d with
d = (1 / |P|) sum Delta_i + h / alpha, the aggregator's direction (server step
sgd(1)). At a fixed point the clients' g_i sum to zero and every client's model
is the global optimum, which removes FedAvg's client-drift bias.

In the primal-dual notation of the family (primal_dual.py; the A-FedPD paper, arXiv:2409.18915, eq. 7) the
client's dual is lambda_i = -g_i and the server's mean dual lambda-bar = -h, with
rho = alpha: the client solves f_i + <lambda_i, theta - theta^{t-1}> + (rho/2)||.||^2,
lambda_i += rho (theta_i^t - theta^{t-1}), and theta^t = theta-bar + lambda-bar / rho with
lambda-bar moved by the participants only (rule "participants"; A-FedPD also moves
every other client's dual). The client table stores lambda_i, the aggregator state
lambda-bar (``mean_dual``) and theta-bar (``average``).

Symbols -> arguments: alpha = ``alpha`` (may be traced; the paper's grid {0.1,
0.01, 0.001}); the local solver is ``training`` (``ClientTraining``): SGD with
eta_l = ``training.lr`` for E = ``training.num_epochs`` epochs of batch B =
``training.batch_size`` (the argmin is approximate, as in the paper), plus coupled
``training.weight_decay``. ``evaluate``: "average" evaluates theta-bar^t, the same
model as the rest of the primal-dual family (A-FedPD's Theorem 1 is stated for
theta-bar), so a comparison made with defaults is like for like; "server" evaluates
theta^t (the FedDyn paper's choice).

Gradient clipping (``training.clip_norm`` c; off by default). The paper states no clip;
its authors' code clips every local step, and so does the A-FedPD author's simulator
that the A-FedPD paper's FedDyn row comes from: both write the penalty as the linear
loss term alpha <theta, h_i - theta^{t-1}> (``train_feddyn_mdl`` in
github.com/alpemreacar/FedDyn, utils_general.py; ``client/feddyn.py`` with
``server/FedDyn.py`` in github.com/woodenchild95/FL-Simulator) and put alpha into
the optimizer's weight decay, ``torch.optim.SGD(weight_decay=alpha + wd)``, which
``step()`` adds after ``clip_grad_norm_``. So the default ``clip_mode="step"`` is that
form here (``primal_dual(..., penalty_as_decay=True)``,
``families.primal_dual.clip_split``):

    clip(g + lambda_i - alpha theta^{t-1}) + (alpha + wd) theta,   lambda_i = alpha h_i,

where the family's other methods clip the whole penalty's gradient. ``"loss"`` clips
the minibatch gradient g alone and adds lambda_i + alpha (theta - theta^{t-1}) +
wd theta. Without a clip (the default) both are the unclipped step g + lambda_i +
alpha (theta - theta^{t-1}) + wd theta, in the same program as before the option.
"""
from __future__ import annotations

from fedjax_fair import hparams as H
from fedjax_fair.core.algorithm import FederatedAlgorithm
from fedjax_fair.algorithms.families.primal_dual import primal_dual
from fedjax_fair.core.client import ClientTraining
from fedjax_fair.algorithms.registry import register

HPARAMS = {"alpha": H.POSITIVE}


def feddyn(model, *, alpha: float = 0.01, training: ClientTraining = ClientTraining(),
           client_table: str = "dense", weight_by_size: bool = False,
           evaluate: str = "average") -> FederatedAlgorithm:
    """FedDyn: local SGD on the dynamically regularised objective, server state h.
    The participants' models are averaged uniformly (the paper), or by n_k with
    ``weight_by_size``.

    ``client_table``: "dense", "lazy" or "lazy:CAPACITY" storage of the clients'
    duals (optionally ":bf16")."""
    H.check(HPARAMS, alpha=alpha)
    return primal_dual(model, rho=alpha, rule="participants", training=training,
                       client_table=client_table, weight_by_size=weight_by_size,
                       evaluate=evaluate, penalty_as_decay=True)


register("feddyn", feddyn, HPARAMS, family="primal_dual",
         search_space={"alpha": (0.001, 0.01, 0.1, 1.0)},
         search_source="A-FedPD (arXiv:2409.18915), Table 3: rho in {1e-3, 1e-2, 0.1, 1}")
