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


def test_check_rates_refuses_rates_that_overflow_or_vanish():
    """The device's float32 rates at both ends of the run: a step factor that
    overflows float32 is refused naming the field, a rate that decays to 0 is refused
    where it is divided by (``positive``), a well-behaved schedule passes."""
    from fedjax_fair.hparams import FieldError
    from fedjax_fair.scenarios.schedules import check_rates, exponential, step
    check_rates(exponential(0.1, 0.9), 100, "client_lr_schedule")
    with pytest.raises(FieldError, match="^client_lr_schedule: "):
        check_rates(step(0.1, 1e30, [1, 2]), 4, "client_lr_schedule")
    check_rates(exponential(0.1, 0.5), 400, "client_lr_schedule")  # 0 is a rate, >= 0
    with pytest.raises(FieldError, match="^compensate_server_lr: "):
        check_rates(exponential(0.1, 0.5), 400, "compensate_server_lr", positive=True)


@pytest.mark.parametrize("make, field", [
    (lambda S: S.exponential(-0.1, 0.9), "rate"),
    (lambda S: S.exponential(0.1, float("nan")), "gamma"),
    (lambda S: S.exponential(0.1, 0.9, every=0), "every"),
    (lambda S: S.step(0.1, float("inf"), [2]), "factor"),
    (lambda S: S.step(0.1, -2.0, [2]), "factor"),
    (lambda S: S.step(0.1, 0.5, [-1]), "boundaries"),
])
def test_schedule_factories_refuse_negative_or_non_finite_numbers(make, field):
    """A schedule whose rates could go negative or non-finite is refused when built,
    naming the argument; a traced base rate is never checked (vmap / grad over it)."""
    from fedjax_fair.hparams import FieldError
    from fedjax_fair.scenarios import schedules as S
    with pytest.raises(FieldError, match=f"^{field}: "):
        make(S)
    rates = jax.vmap(lambda r: S.exponential(r, 0.5)(2))(jnp.asarray([0.1, 0.2]))
    np.testing.assert_allclose(rates, [0.025, 0.05])
