"""Reference: one FedAvg round as a PyTorch sequential loop, how the papers' own code runs.

Run by benchmarks/round_throughput.py in a subprocess (protocol.py); alone:

    python benchmarks/references/torch_round.py JOB.json   (then type "round" lines)

The same network as the JAX job (same layers and widths; NCHW convolutions; the
initial parameters copied from the job's .npz, so the same init scale), the same
cohort sizes, S local steps of batch B, plain SGD, FedAvg's size-weighted mean. The
loop is the usual one of the fair-FL reference codes (FedProx, q-FFL, DITTO,
FedLab-style simulators): for each client, load the global weights into the local
model, make an SGD optimizer, run the steps (zero_grad, forward, cross-entropy,
backward, step), and add the client's weights, scaled by n_k / n, to a running
average. Written without avoidable overhead: the client's rows are indexed straight
from tensors (no DataLoader, which costs more per batch), the average is accumulated
in place (not K stored state dicts).

Threads: ``torch.set_num_threads`` is the machine's core count, as the papers' code
leaves it. On a shared machine PyTorch's OpenMP workers spin at every barrier while
another job holds a core, which made the 2-thread MLP round 7x slower than 1 thread
(load 8 on 2 cores); so, unless ``job["torch_threads"]`` fixes the count, the warm-up
times a few clients with the core count and with 1 thread and keeps the faster
(reported as ``threads``).
"""
from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import job as J  # noqa: E402
import protocol  # noqa: E402


def build_model(job):
    import torch.nn as nn
    c, h, w = job["input_shape"][2], job["input_shape"][0], job["input_shape"][1]
    classes = job["num_classes"]
    if job["model"] == "cnn":
        ch1, ch2 = job["channels"]
        layers = [nn.Conv2d(c, ch1, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                  nn.Conv2d(ch1, ch2, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                  nn.Linear(ch2 * (h // 4) * (w // 4), job["dense"]), nn.ReLU(),
                  nn.Linear(job["dense"], classes)]
    else:
        widths = [h * w * c] + list(job.get("hidden", []) if job["model"] == "mlp" else [])
        layers = [nn.Flatten()]
        for a, b in zip(widths[:-1], widths[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        layers.append(nn.Linear(widths[-1], classes))
    return nn.Sequential(*layers)


def load_params(model, job) -> None:
    """Copies the JAX initial parameters (flax names, NHWC) into the torch model."""
    import torch
    p = dict(np.load(job["params_file"]))
    convs = [m for m in model if isinstance(m, torch.nn.Conv2d)]
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        for m, name in zip(convs, J.layer_names(p, "Conv_")):
            m.weight.copy_(torch.from_numpy(p[name + "/kernel"].transpose(3, 2, 0, 1).copy()))
            m.bias.copy_(torch.from_numpy(p[name + "/bias"]))
        names = J.layer_names(p, "Dense_")
        for i, (m, name) in enumerate(zip(linears, names)):
            k = p[name + "/kernel"]
            if i == 0 and convs:  # NHWC flattening (h, w, c) -> NCHW flattening (c, h, w)
                ch = convs[-1].out_channels
                side = int(round((k.shape[0] / ch) ** 0.5))
                k = k.reshape(side, side, ch, -1).transpose(2, 0, 1, 3).reshape(k.shape[0], -1)
            m.weight.copy_(torch.from_numpy(np.ascontiguousarray(k.T)))
            m.bias.copy_(torch.from_numpy(p[name + "/bias"]))


def fedavg_round(model, local, x, y, sizes, base, lr, B, S, rng, clients=None, device=None):
    """One FedAvg round as PyTorch simulators write it: each client in turn (all, or
    ``clients``) loads the global model into ``local``, takes ``S`` SGD steps of batch
    ``B`` on its rows (client k's data is ``x[k % base]``), and its weights join the
    average with weight n_k / n; ``model`` then holds the average. ``device``: where
    the row indices go (the data's device)."""
    import torch
    import torch.nn.functional as F
    total = float(sum(sizes))
    global_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    avg = {k: torch.zeros_like(v) for k, v in global_state.items()}
    for k in (range(len(sizes)) if clients is None else clients):
        n = sizes[k]
        local.load_state_dict(global_state)
        opt = torch.optim.SGD(local.parameters(), lr=lr)
        rows = torch.from_numpy(J.epoch_rows(rng, n, B, S))
        if device is not None:
            rows = rows.to(device)
        xk, yk = x[k % base][rows], y[k % base][rows]
        for s in range(S):
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(local(xk[s * B:(s + 1) * B]), yk[s * B:(s + 1) * B])
            loss.backward()
            opt.step()
        with torch.no_grad():
            for name, v in local.state_dict().items():
                avg[name].add_(v, alpha=n / total)
    model.load_state_dict(avg)


def setup(job):
    import torch
    import time
    threads = job.get("torch_threads") or os.cpu_count()
    torch.set_num_threads(threads)
    x_np, y_np = J.synthetic_data(job, layout="nchw")
    if job["model"] != "cnn":
        x_np = x_np.reshape(x_np.shape[0], x_np.shape[1], -1)
    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)
    model = build_model(job)
    load_params(model, job)
    local = build_model(job)
    sizes = job["sizes"]
    base, lr, B, S = job["base_clients"], job["lr"], job["batch"], job["steps"]
    rng = np.random.default_rng(0)

    def one_round(clients=None):
        fedavg_round(model, local, x, y, sizes, base, lr, B, S, rng, clients)

    warm = range(min(4, len(sizes)))
    one_round(clients=warm)  # warm-up (allocator, thread pool)
    if not job.get("torch_threads") and threads > 1:
        best = {}
        for n in (threads, 1, threads, 1):
            torch.set_num_threads(n)
            t = time.perf_counter()
            one_round(clients=warm)
            best[n] = min(best.get(n, float("inf")), time.perf_counter() - t)
        threads = min(best, key=best.get)
        torch.set_num_threads(threads)
    load_params(model, job)  # the timed rounds start from the job's parameters
    d = sum(p.numel() for p in model.parameters())
    return one_round, {"params": d, "threads": threads, "torch": torch.__version__}


if __name__ == "__main__":
    import torch  # noqa: F401  (imported once, before the first job)
    protocol.serve(setup)
