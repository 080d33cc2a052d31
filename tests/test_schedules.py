"""Round-indexed schedules (schedules.py): values, text parsing, traced base rates."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_fair.cli.parsing import parse_schedule


def _values(text, rate, rounds):
    schedule = parse_schedule(text)(rate)
    return np.asarray([float(schedule(jnp.int32(t))) for t in range(rounds)])


def test_exponential_decays_every_round_or_every_s_rounds():
    np.testing.assert_allclose(_values("exponential:0.99", 0.1, 4),
                               0.1 * 0.99 ** np.arange(4), rtol=1e-6)
    np.testing.assert_allclose(_values("exponential:0.5@3", 2.0, 7),
                               2.0 * 0.5 ** (np.arange(7) // 3), rtol=1e-6)


def test_step_multiplies_at_each_listed_round():
    np.testing.assert_allclose(_values("step:0.1@2,4", 1.0, 6),
                               [1, 1, 0.1, 0.1, 0.01, 0.01], rtol=1e-6)


def test_none_is_constant_and_bad_text_names_the_field():
    assert parse_schedule("none") is None
    for bad in ("exponential:0", "exponential:1.5", "exponential:0.9@0", "step:0.1",
                "step:-1@3", "step:0.1@0", "cosine:1", "exponential:x"):
        with pytest.raises(ValueError, match="^client_lr_schedule: "):
            parse_schedule(bad, "client_lr_schedule")


def test_base_rate_may_be_traced():
    def final_rate(rate):
        return parse_schedule("exponential:0.9@2")(rate)(jnp.int32(5))

    np.testing.assert_allclose(jax.jit(jax.vmap(final_rate))(jnp.array([1.0, 2.0])),
                               [0.81, 1.62], rtol=1e-6)
    np.testing.assert_allclose(jax.grad(final_rate)(1.0), 0.81, rtol=1e-6)


def test_compensated_server_rate_keeps_the_product_constant():
    from fedjax_fair.scenarios.schedules import compensated, exponential
    client = exponential(0.1, 0.5, every=2)
    server = compensated(2.0, client)
    for t in range(7):
        assert float(server(t)) == pytest.approx(2.0 * 0.5 ** -(t // 2))
        assert float(server(t)) * float(client(t)) == pytest.approx(0.2)
    decayed = compensated(lambda t: 2.0 * 0.9 ** t, client)  # a server schedule too
    assert float(decayed(3)) == pytest.approx(2.0 * 0.9 ** 3 / 0.5)
