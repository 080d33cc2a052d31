"""Reference: one FedAvg round as a PyTorch per-client loop, on the GPU when torch sees one.

Run by benchmarks/gpu_targets.py in a subprocess (protocol.py); alone:

    python benchmarks/references/torch_loop.py JOB.json   (then type "round" lines)

How PFLlib, FL-bench and the papers' own simulators train a cohort: one client after
another. For each client: load the global weights into the local model, make an SGD
optimizer, run S steps of batch B on the client's shuffled rows (zero_grad, forward,
cross-entropy, backward, step), and add the client's weights, scaled by n_k / n, to a
running average. The loop of torch_round.py (the CPU reference of
round_throughput.py), with every tensor on ``cuda`` when ``torch.cuda.is_available()``
(else the CPU), the round ending with ``torch.cuda.synchronize()``, and one more
model: ResNet-18 with GroupNorm (CIFAR stem), the same layers as
``fedjax_fair.models.resnet18_gn``. The MLP and the LEAF CNN are torch_round.py's
(their initial parameters copied from the job's .npz); the ResNet keeps PyTorch's
initialisation (the timing depends on the shapes, not the values). Defaults as the
papers' code leaves them: float32, no ``cudnn.benchmark``, no AMP, no compilation.

Job fields beyond job.py's: ``width`` and ``groups`` (ResNet), ``params_file`` may be
absent. Info sent back after setup: ``params``, ``device``, ``torch``,
``first_round_s`` (the first full round: CUDA context, cuDNN and allocator warm-up),
``peak_bytes`` (``torch.cuda.max_memory_allocated`` over that round, the data
included; absent on the CPU).
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import job as J  # noqa: E402
import protocol  # noqa: E402
import torch_round  # noqa: E402


def resnet18_gn(job):
    """ResNet-18, GroupNorm (``groups``) after every convolution, CIFAR stem (3x3
    convolution, stride 1, no max-pool), global average pooling, one linear layer."""
    import torch.nn as nn
    import torch.nn.functional as F
    width, groups = job.get("width", 64), job.get("groups", 2)

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.norm1 = nn.GroupNorm(groups, cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.norm2 = nn.GroupNorm(groups, cout)
            self.down = None
            if stride != 1 or cin != cout:
                self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.GroupNorm(groups, cout))

        def forward(self, x):
            y = F.relu(self.norm1(self.conv1(x)))
            y = self.norm2(self.conv2(y))
            return F.relu(y + (x if self.down is None else self.down(x)))

    layers = [nn.Conv2d(job["input_shape"][2], width, 3, 1, 1, bias=False),
              nn.GroupNorm(groups, width), nn.ReLU()]
    cin = width
    for stage in range(4):
        for block in range(2):
            cout = width * 2 ** stage
            layers.append(Block(cin, cout, 2 if stage > 0 and block == 0 else 1))
            cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, job["num_classes"])]
    return nn.Sequential(*layers)


def build_model(job):
    if job["model"] == "resnet18_gn":
        return resnet18_gn(job)
    model = torch_round.build_model(job)
    if job.get("params_file"):
        torch_round.load_params(model, job)
    return model


def setup(job):
    import torch
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if job.get("torch_threads"):
        torch.set_num_threads(job["torch_threads"])
    x_np, y_np = J.synthetic_data(job, layout="nchw")
    if job["model"] in ("mlp", "logreg"):
        x_np = x_np.reshape(x_np.shape[0], x_np.shape[1], -1)
    x, y = torch.from_numpy(x_np).to(device), torch.from_numpy(y_np).to(device)
    model = build_model(job).to(device)
    local = build_model(job).to(device)
    sizes = job["sizes"]
    base, lr, B, S = job["base_clients"], job["lr"], job["batch"], job["steps"]
    rng = np.random.default_rng(0)

    def one_round():
        torch_round.fedavg_round(model, local, x, y, sizes, base, lr, B, S, rng,
                                 device=device)
        if cuda:
            torch.cuda.synchronize()

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    one_round()
    info = {"params": sum(p.numel() for p in model.parameters()), "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "threads": torch.get_num_threads(), "first_round_s": time.perf_counter() - t}
    if cuda:
        info["peak_bytes"] = int(torch.cuda.max_memory_allocated())
    return one_round, info


if __name__ == "__main__":
    import torch  # noqa: F401  (imported once, before the first job)
    protocol.serve(setup)
