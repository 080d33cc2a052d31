"""The 2-D toy's energy model, shared by tests/test_fedevg.py and tests/test_fedevg_toy.py."""
import flax.linen as nn

from fedjax_fair.models.base import from_flax
from fedjax_fair.models.resnet import SpectralDense


class SNMLP(nn.Module):
    """MLP 2-64-64-2, SiLU, spectral-normalised last layer."""

    @nn.compact
    def __call__(self, x):
        for width in (64, 64):
            x = nn.silu(nn.Dense(width)(x))
        return SpectralDense(2)(x)


TOY_MODEL = from_flax(SNMLP(), (2,), 2, "toy_snmlp")
