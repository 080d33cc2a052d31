"""Synthetic labelled data sets, the product of the generative methods (FedEvg,
``algorithms.fedevg``; the FedCVAE baseline, ``algorithms.fedcvae``; metrics of Hahn's thesis, UNIST 2024, Ch. IV, Tables 4.2-4.5):
the state they share, the server classifier they train on it, and its evaluation.

A generative method is a ``compose``d round whose aggregator is its server: it keeps
the synthetic set D~ = {(x~_j, y~_j)} in ``state.aggregator_state`` (a NamedTuple with
``x`` and ``y`` fields, beside the server classifier's optimizer state), and a
classifier of the user's model trained on D~ in ``state.params``, so that the runner's
per-client test accuracy is downstream accuracy and both methods compare with every
other method in one table.

* ``SyntheticSet``, ``balanced_labels`` (class-balanced labels [0]*spc + [1]*spc + ...);
* ``classifier_optimizer`` (Adam with coupled L2, optional global-norm clip),
  ``fit_classifier`` (minibatch cross-entropy steps on D~), ``synthetic_accuracy``,
  ``classifier_direction`` (the fit as the direction ``compose``'s server step applies);
* accessors ``synthetic_data`` (arrays) and ``synthetic_federation`` (a federation);
* Tables 4.2-4.3 (downstream utility): ``downstream_accuracy`` (a fresh classifier trained on D~ only, tested on
  real held-out rows) and ``downstream_report`` (the registry's end-of-run hook);
* Tables 4.4-4.5 (sample quality): ``frechet_distance`` and ``feature_distance`` (a Fréchet *classifier*
  distance on a fixed classifier's logits, the offline stand-in for FID; not FID),
  ``feature_classifier`` and ``pooled_examples`` (its embedding network);
* the thesis's sample figures: ``plot_sample_grid`` (class-wise sample grids over rounds).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_fair import hparams as H
from fedjax_fair.core.algorithm import FederatedAlgorithm, ServerState
from fedjax_fair.models.base import Model, cross_entropy
from fedjax_fair.core.types import ClientData, FederatedData


class SyntheticSet(NamedTuple):
    """A labelled synthetic set: x [M, *X], y int32 [M]."""

    x: jax.Array
    y: jax.Array


def balanced_labels(num_synth: int, num_classes: int) -> jax.Array:
    """[0]*spc + [1]*spc + ... + [L-1]*spc, spc = M / L (int32 [M]; eq. 4.12)."""
    if num_synth % num_classes:
        raise H.FieldError("num_synth", f"must be a multiple of num_classes={num_classes} "
                                        f"(class-balanced labels), got {num_synth}")
    return jnp.repeat(jnp.arange(num_classes, dtype=jnp.int32), num_synth // num_classes)



def classifier_optimizer(lr, weight_decay=1e-4, max_grad_norm=None):
    """[ref-code] local optimiser: (optional global-norm clip), coupled L2, Adam."""
    parts = [] if max_grad_norm is None else [optax.clip_by_global_norm(max_grad_norm)]
    return optax.chain(*parts, optax.add_decayed_weights(weight_decay), optax.adam(lr))


def check_data_range(data_range):
    """``data_range`` checked: None, or a pair (lo, hi) with lo < hi when concrete."""
    if data_range is None:
        return None
    try:
        lo, hi = data_range
    except (TypeError, ValueError):
        raise H.FieldError("data_range", f"must be None or a pair (lo, hi), got "
                                         f"{data_range!r}") from None
    if H.is_concrete(lo) and H.is_concrete(hi):
        H.REAL.check("data_range", lo)
        H.REAL.check("data_range", hi)
        if not lo < hi:
            raise H.FieldError("data_range", f"needs lo < hi, got {data_range!r}")
    return (lo, hi)


# ----------------------------------------------------------------- server classifier


def fit_classifier(model: Model, params, opt_state, optimizer, x, y, key, steps: int,
                   batch_size: int, unroll: Union[int, bool] = 1):
    """``steps`` optimizer steps of the mean cross-entropy on minibatches of min(B, M)
    distinct rows of (x, y), the s-th drawn from ``fold_in(key, s)``. Returns (params,
    opt_state, mean loss over the steps)."""
    if steps == 0:
        return params, opt_state, jnp.zeros((), jnp.float32)
    m = x.shape[0]
    bs = min(batch_size, m)

    def loss_fn(p, xb, yb):
        return jnp.mean(cross_entropy(model.apply(p, xb), yb))

    def step(carry, s):
        p, o = carry
        idx = jax.random.permutation(jax.random.fold_in(key, s), m)[:bs]
        loss, grads = jax.value_and_grad(loss_fn)(p, x[idx], y[idx])
        updates, o = optimizer.update(grads, o, p)
        return (optax.apply_updates(p, updates), o), loss

    (params, opt_state), losses = jax.lax.scan(step, (params, opt_state), jnp.arange(steps),
                                               unroll=unroll)
    return params, opt_state, jnp.mean(losses).astype(jnp.float32)


def synthetic_accuracy(model: Model, params, x, y):
    """The share of the rows (x, y) that ``model`` at ``params`` classifies correctly."""
    return jnp.mean((jnp.argmax(model.apply(params, x), -1) == y).astype(jnp.float32))


def classifier_direction(model: Model, params, opt_state, optimizer, x, y, key, steps: int,
                         batch_size: int, unroll: Union[int, bool] = 1):
    """The server classifier's round as an aggregator's output: ``fit_classifier`` from
    theta^t = ``params`` on the new set (x, y), returned as the direction
    Delta = theta^t - theta^{t+1} that ``compose``'s server step sgd(1.0) applies, with
    the optimizer's new state and the info ``classifier_loss`` and
    ``synthetic_accuracy`` (of theta^{t+1} on (x, y))."""
    fitted, opt_state, loss = fit_classifier(model, params, opt_state, optimizer, x, y, key,
                                             steps, batch_size, unroll)
    direction = jax.tree.map(jnp.subtract, params, fitted)
    return direction, opt_state, {"classifier_loss": loss,
                                  "synthetic_accuracy": synthetic_accuracy(model, fitted, x, y)}


# ----------------------------------------------------------------- accessors


def synthetic_data(state: ServerState):
    """The server's synthetic set (x [M, *X], y int32 [M])."""
    synth = state.aggregator_state
    return synth.x, synth.y


def synthetic_federation(state: ServerState, num_clients: int = 1,
                         test: Optional[ClientData] = None) -> FederatedData:
    """D~ as a federation: sample j goes to client j mod ``num_clients`` (the labels are
    sorted by class, so every client gets a near-balanced share), padded and masked like
    any built-in split (``data.federated.stack_clients``). ``test``: a test split with
    ``num_clients`` rows (e.g. real held-out data, which ``runner.run`` evaluates on);
    default: an empty test split of padded size 1."""
    from fedjax_fair.data.federated import stack_clients

    if isinstance(num_clients, bool) or not isinstance(num_clients, (int, np.integer)) \
            or num_clients < 1:
        raise H.FieldError("num_clients", f"must be an integer >= 1, got {num_clients!r}")
    x, y = (np.asarray(a) for a in synthetic_data(state))
    xs = [x[k::num_clients] for k in range(num_clients)]
    ys = [y[k::num_clients] for k in range(num_clients)]
    train = stack_clients(xs, ys)
    if test is None:
        empty_x = [np.zeros((0, *x.shape[1:]), np.float32)] * num_clients
        empty_y = [np.zeros((0,), np.int32)] * num_clients
        test = stack_clients(empty_x, empty_y, pad_to=1)
    elif test.mask.shape[0] != num_clients:
        raise H.FieldError("test", f"must have one row per client ({num_clients}), got "
                                   f"{test.mask.shape[0]}")
    return FederatedData(train=train, test=test)


@functools.lru_cache(maxsize=16)
def _downstream_program(model: Model, steps: int, batch_size: int):
    def train(x, y, key, lr, weight_decay):
        k_init, k_fit = jax.random.split(key)
        params = model.init(k_init)
        opt = classifier_optimizer(lr, weight_decay)
        params, _, loss = fit_classifier(model, params, opt.init(params), opt, x, y, k_fit,
                                         steps, batch_size)
        return params, loss

    return jax.jit(train)


def downstream_accuracy(model: Model, x, y, test_split: ClientData, key, steps: int = 200,
                        lr=1e-3, batch_size: int = 64, weight_decay=0.0) -> dict:
    """Downstream utility (thesis Tables 4.2-4.3): a fresh classifier (``model.init`` from ``key``) trained on the
    synthetic set (x, y) only, ``steps`` Adam steps (rate ``lr``, coupled L2
    ``weight_decay``) on minibatches of min(B, M) distinct samples (100 epochs over
    M = 100 with B = 64: ``steps = 200``), then evaluated on every client's real
    held-out rows ``test_split`` [N, m, ...].

    Returns {"accuracy": mean over clients weighted by test size (the [ref-code]
    number), "accuracy_std": unweighted std across clients with test rows,
    "per_client": [N] accuracies, "num_examples": [N], "train_loss": mean loss over the
    steps, "params": the trained classifier}."""
    from fedjax_fair.core.evaluation import make_evaluator

    H.Range(0, None, integer=True).check("steps", steps)
    H.COUNT.check("batch_size", batch_size)
    H.POSITIVE.check("lr", lr)
    H.NONNEGATIVE.check("weight_decay", weight_decay)
    params, loss = _downstream_program(model, int(steps), int(batch_size))(
        jnp.asarray(x), jnp.asarray(y, jnp.int32), key, lr, weight_decay)
    per = make_evaluator(model)(params, test_split)
    acc = np.asarray(per["accuracy"], np.float64)
    n = np.asarray(per["num_examples"], np.float64)
    has = n > 0
    if not has.any():
        raise H.FieldError("test_split", "no client has a test example")
    return {"accuracy": float(np.average(acc[has], weights=n[has])),
            "accuracy_std": float(acc[has].std()), "per_client": acc,
            "num_examples": n.astype(np.int64), "train_loss": float(loss), "params": params}


def downstream_report(model: Model, algorithm: FederatedAlgorithm, state: ServerState,
                      test_split: ClientData, *, epochs: int = 100, lr=1e-3,
                      batch_size: int = 64, seed: int = 0) -> dict:
    """The end-of-run numbers of Tables 4.2-4.3 for a registry ``report`` hook: a fresh
    ``model`` trained on the final D~ only for ``epochs`` passes (``epochs`` ceil(M / B)
    Adam steps, rate ``lr``, batch ``batch_size``; the thesis gives no budget; we recommend 100
    epochs, Adam 1e-3, B = 64), tested on every client's held-out rows. Returns
    {"downstream_accuracy" (weighted by test size), "downstream_accuracy_std" (across
    clients, unweighted), "downstream_steps", "num_synth", "synthetic_min",
    "synthetic_max"}. ``algorithm`` is unused (the hook's signature)."""
    del algorithm
    H.COUNT.check("epochs", epochs)
    x, y = synthetic_data(state)
    steps = int(epochs) * math.ceil(x.shape[0] / batch_size)
    out = downstream_accuracy(model, x, y, test_split, jax.random.key(seed), steps=steps,
                              lr=lr, batch_size=batch_size)
    xs = np.asarray(x)
    return {"downstream_accuracy": out["accuracy"],
            "downstream_accuracy_std": out["accuracy_std"], "downstream_steps": steps,
            "num_synth": int(xs.shape[0]), "synthetic_min": float(xs.min()),
            "synthetic_max": float(xs.max())}


def downstream_line(report: dict) -> str:
    """The line ``fedjax-fair run`` prints of ``downstream_report``'s numbers."""
    return (f"synthetic set ({report['num_synth']} samples, synthetic.npz): a fresh model "
            f"trained on it alone scores {report['downstream_accuracy']:.4f} on the clients' "
            f"test data (downstream utility, FedEvg: Hahn's thesis, Ch. IV §4.2)")


# ----------------------------------------------------------------- evaluation: feature distance


def _float_dtype(*arrays):
    """The inputs' common float type, at least float32 (float64 stays float64)."""
    return jnp.promote_types(jnp.result_type(*arrays), jnp.float32)


def frechet_distance(feat_a, feat_b):
    """Fréchet distance between Gaussians fitted to two feature sets [n_a, d], [n_b, d]
    (Dowson & Landau 1982; the formula of FID, Heusel et al. 2017):

        d^2 = ||mu_a - mu_b||^2 + Tr(C_a) + Tr(C_b) - 2 Tr((C_a^1/2 C_b C_a^1/2)^1/2),

    mu = the feature mean, C = the unbiased covariance (1 / (n - 1), as ``numpy.cov``).
    The last trace equals Tr((C_a C_b)^1/2) (same eigenvalues) and is computed from
    symmetric eigendecompositions only: C_a^1/2 = V diag(sqrt(max(lambda, 0))) V^T, then
    the eigenvalues of the symmetrised C_a^1/2 C_b C_a^1/2, clamped at 0 before their
    square roots (round-off on singular covariances, e.g. n <= d). Pure and jittable;
    computed in the inputs' float type, at least float32 (float64 inputs under
    ``jax.enable_x64`` stay float64). The result is clamped at 0. Needs n_a, n_b >= 2.
    """
    a = jnp.asarray(feat_a)
    b = jnp.asarray(feat_b)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"feat_a, feat_b: must be [n, d] with the same d, got {a.shape} and "
                         f"{b.shape}")
    if a.shape[0] < 2 or b.shape[0] < 2:
        raise ValueError(f"feat_a, feat_b: need at least 2 rows each for a covariance, got "
                         f"{a.shape[0]} and {b.shape[0]}")
    dtype = _float_dtype(a, b)
    a, b = a.astype(dtype), b.astype(dtype)

    def moments(f):
        mu = jnp.mean(f, axis=0)
        c = f - mu[None, :]
        return mu, c.T @ c / (f.shape[0] - 1)

    mu_a, cov_a = moments(a)
    mu_b, cov_b = moments(b)
    lam, vec = jnp.linalg.eigh(cov_a)
    root_a = (vec * jnp.sqrt(jnp.maximum(lam, 0.0))[None, :]) @ vec.T
    inner = root_a @ cov_b @ root_a
    inner = 0.5 * (inner + inner.T)
    trace_root = jnp.sum(jnp.sqrt(jnp.maximum(jnp.linalg.eigvalsh(inner), 0.0)))
    d2 = (jnp.sum(jnp.square(mu_a - mu_b)) + jnp.trace(cov_a) + jnp.trace(cov_b)
          - 2.0 * trace_root)
    return jnp.maximum(d2, 0.0)


def feature_distance(model: Model, params, x_synth, x_real):
    """The Fréchet *classifier* distance (FCD) between a synthetic and a real image set:
    ``frechet_distance`` of the **logits** f(x; theta) [n, L] of a fixed classifier
    ``model`` / ``params`` (lower is better; 0 for identical sets).

    A stand-in for the thesis's FID (Tables 4.4-4.5), which needs InceptionV3 pool3 features that
    are not available offline. It is **not FID** and not on FID's scale: the embedding
    is a small classifier trained on the federation's real pooled training rows
    (``feature_classifier``), d = L; logits rather than penultimate features because
    ``Model.apply`` returns logits only (the ``Model`` API exposes no hidden layer).
    Logits are a class-discriminative embedding: the distance grows when the synthetic
    set's class-conditional structure, confidence or spread differs from the real
    data's, and it is blind to pixel detail the classifier ignores. The thesis's two
    variants are the caller's choice of ``x_real``: all real held-out images (the
    default reading of FID, n_real = all), or M of them ("M vs M", the [ref-code]
    variant, noisier with M <= d samples). Pure and jittable in ``params`` and both
    sets."""
    return frechet_distance(model.apply(params, jnp.asarray(x_synth)),
                            model.apply(params, jnp.asarray(x_real)))


def pooled_examples(split: ClientData):
    """Every client's valid rows of a (host or device) split, stacked in client order:
    (x [n, *X], y int32 [n]) as NumPy arrays (the padding rows dropped); a generated
    split's rows are computed (every client's: mind its size)."""
    from fedjax_fair.core.generated import materialize
    split = materialize(split)
    mask = np.asarray(split.mask, bool)
    x = np.asarray(split.examples["x"])[mask]
    y = np.asarray(split.examples["y"])[mask].astype(np.int32)
    return x, y


def feature_classifier(model: Model, train_split: ClientData, key, steps: int = 2000,
                       lr=1e-3, batch_size: int = 64, weight_decay=0.0):
    """The fixed embedding of ``feature_distance``: a fresh ``model`` (``model.init``
    from ``key``) trained on the clients' pooled real training rows
    (``pooled_examples``), ``steps`` Adam steps of minibatch cross-entropy (the program
    of ``downstream_accuracy``). Returns (params, mean training loss)."""
    H.COUNT.check("steps", steps)
    H.COUNT.check("batch_size", batch_size)
    x, y = pooled_examples(train_split)
    params, loss = _downstream_program(model, int(steps), int(batch_size))(
        jnp.asarray(x), jnp.asarray(y), key, lr, weight_decay)
    return params, float(loss)


# ----------------------------------------------------------------- evaluation: sample grids


def _grid_image(x, y, num_classes: int, per_class: int, value_range):
    """One mosaic [L (h+1) - 1, per_class (w+1) - 1, C] of the first ``per_class``
    samples of each class (rows = classes; missing samples and the 1-pixel gutters are
    blank at the top of the range), clipped to ``value_range`` and rescaled to [0, 1]."""
    x = np.asarray(x, np.float64)
    if x.ndim == 2:  # flat samples: square grey images when D is a square
        side = int(round(math.sqrt(x.shape[1])))
        if side * side != x.shape[1]:
            raise H.FieldError("snapshots", f"flat samples of {x.shape[1]} features are not "
                                            f"square images")
        x = x.reshape(x.shape[0], side, side, 1)
    elif x.ndim == 3:
        x = x[..., None]
    if x.ndim != 4 or x.shape[-1] not in (1, 3):
        raise H.FieldError("snapshots", f"need images [M, H, W] or [M, H, W, 1 | 3], got "
                                        f"{x.shape}")
    lo, hi = value_range
    x = (np.clip(x, lo, hi) - lo) / (hi - lo)
    y = np.asarray(y)
    h, w, c = x.shape[1:]
    grid = np.ones((num_classes * (h + 1) - 1, per_class * (w + 1) - 1, c))
    for cls in range(num_classes):
        rows = np.flatnonzero(y == cls)[:per_class]
        for col, j in enumerate(rows):
            grid[cls * (h + 1):cls * (h + 1) + h, col * (w + 1):col * (w + 1) + w] = x[j]
    return grid


def plot_sample_grid(snapshots, labels, rounds, path: Optional[str], num_classes: int,
                     per_class: int = 10, title: str = "Synthetic samples by class",
                     context: str = "", value_range=(0.0, 1.0), class_names=None,
                     panel_width: float = 2.6, dpi: int = 110):
    """Class-wise grids of synthetic samples (as in the thesis's figures), one panel per snapshot.

    snapshots: a sequence of sample sets [M, H, W], [M, H, W, 1] (grey, e.g. 8x8,
      28x28, 32x32), [M, H, W, 3] (RGB) or [M, H*W] (flat square grey images), e.g.
      D~ after the rounds ``rounds``; labels: int [M], shared by all snapshots, or a
      sequence with one label array per snapshot; rounds: one entry per snapshot, the
      panel's title ("round r"; a string is used as it is).
    Each panel is a mosaic with a row per class (0..num_classes-1, labelled on the
    left) and the first ``per_class`` samples of that class as columns; pixels are
    clipped to ``value_range`` (the data range) and shown on a fixed scale, grey
    images with the grey colour map (black = lo). ``title`` / ``context`` form the
    figure title as in ``reports`` (``context`` on a second line). The figure is
    drawn on a ``matplotlib.figure.Figure`` with the Agg canvas (matplotlib is
    imported here, never pyplot), written to ``path`` as PNG when given, and returned.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    snapshots = list(snapshots)
    rounds = list(rounds)
    if not snapshots or len(rounds) != len(snapshots):
        raise H.FieldError("rounds", f"need one entry per snapshot ({len(snapshots)}), got "
                                     f"{len(rounds)}")
    if isinstance(labels, (list, tuple)) and len(labels) == len(snapshots) and \
            np.ndim(labels[0]) == 1:
        label_sets = [np.asarray(v) for v in labels]
    else:
        label_sets = [np.asarray(labels)] * len(snapshots)
    H.COUNT.check("num_classes", num_classes)
    H.COUNT.check("per_class", per_class)
    grids = [_grid_image(x, y, num_classes, per_class, value_range)
             for x, y in zip(snapshots, label_sets)]
    ratio = grids[0].shape[0] / grids[0].shape[1]
    n = len(grids)
    fig = Figure(figsize=(panel_width * n + 0.4, panel_width * ratio + 0.9),
                 layout="constrained")
    FigureCanvasAgg(fig)
    names = [str(c) for c in range(num_classes)] if class_names is None else list(class_names)
    h = (grids[0].shape[0] + 1) / num_classes
    for i, (grid, r) in enumerate(zip(grids, rounds)):
        ax = fig.add_subplot(1, n, i + 1)
        if grid.shape[-1] == 1:
            ax.imshow(grid[..., 0], cmap="gray", vmin=0.0, vmax=1.0, interpolation="nearest")
        else:
            ax.imshow(grid, interpolation="nearest")
        ax.set_title(r if isinstance(r, str) else f"round {r}", fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([(c + 0.5) * h - 1 for c in range(num_classes)])
        ax.set_yticklabels(names if i == 0 else [], fontsize=7)
        ax.tick_params(length=0)
    if context:  # wrapped to the figure's width (about 13 characters per inch at 10 pt)
        import textwrap
        context = "\n".join(textwrap.wrap(context, max(20, int(13 * fig.get_figwidth()))))
    fig.suptitle(f"{title}\n{context}" if context else title, fontsize=10)
    if path is not None:
        import os
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fig.savefig(path, dpi=dpi)
    return fig
