"""fedjax_fair.hparams: value ranges checked before anything runs."""
from __future__ import annotations

import jax.numpy as jnp
import pytest

from fedjax_fair import hparams as H
from fedjax_fair.algorithms.fedavg import fedavg
from fedjax_fair.models import logistic_regression
from fedjax_fair.core.client import ClientTraining


@pytest.mark.parametrize("value", [1e-50, 1e-46, 1e39, -1e-50])
def test_a_real_value_outside_the_range_as_float32_is_refused(value):
    """1e-50 is positive but 0 in float32, where the computation runs: a 'positive'
    learning rate would train nothing; 1e39 is finite but inf."""
    with pytest.raises(ValueError, match="^client_lr"):
        H.POSITIVE.check("client_lr", value)
    with pytest.raises(ValueError, match="^training.lr"):
        fedavg(logistic_regression((3,), 2), training=ClientTraining(lr=value))


def test_bounds_compare_in_the_same_precision():
    """A value equal to a bound stays inside it after both are rounded to float32;
    smallest positive float32 normal-range values pass; integers are not rounded."""
    assert H.Range(0.0, 0.1).contains(0.1)
    assert not H.Range(0.0, 1.0, high_open=True).contains(0.99999999)  # 1.0 in float32
    assert H.POSITIVE.contains(1e-30)
    assert H.COUNT.contains(2 ** 40)
    assert H.POSITIVE.check("x", jnp.float32(0.0)) is not None  # arrays: unchecked (traced)


def test_the_vocabulary_raises_errors_that_carry_their_field():
    """hparams.count / Range.check / probability and the library's choice checks raise a
    FieldError (a ValueError) naming the field; a value of the wrong type is also a
    TypeError; the command line's ConfigError is the same exception."""
    import pytest
    from fedjax_fair import hparams as H
    from fedjax_fair.cli import config as C
    from fedjax_fair.core.client import check_clip
    with pytest.raises(H.FieldTypeError) as info:
        H.count(1.5, "num_rounds")
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)
    assert info.value.field == "num_rounds"
    with pytest.raises(H.FieldError) as info:
        H.count(0, "eval_every")
    assert info.value.field == "eval_every" and not isinstance(info.value, TypeError)
    assert H.count(0, "budget", minimum=0) == 0
    with pytest.raises(H.FieldError) as info:
        H.POSITIVE.check("client_lr", -1.0)
    assert info.value.field == "client_lr"
    with pytest.raises(H.FieldError) as info:
        H.probability(2.0, "label_noise_rate")
    assert info.value.field == "label_noise_rate"
    with pytest.raises(H.FieldError) as info:
        check_clip(1.0, "sideways")
    assert info.value.field == "clip_mode"
    assert issubclass(C.ConfigError, H.FieldError)
    assert C.config_error(info.value, "other").field == "clip_mode"


def test_the_package_raises_field_errors_for_named_fields():
    """One vocabulary: an error about a named field is a ``FieldError`` (or
    ``FieldTypeError``) carrying ``.field``, never a plain ``ValueError("field: ...")``
    whose field a caller would have to parse back out of the message."""
    import ast
    import pathlib
    import re
    package = pathlib.Path(H.__file__).resolve().parent
    named = re.compile(r"[A-Za-z_][\w.\[\]]*: ")
    plain = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
                    and isinstance(node.exc.func, ast.Name)
                    and node.exc.func.id in ("ValueError", "TypeError") and node.exc.args):
                continue
            message = node.exc.args[0]
            parts = message.values if isinstance(message, ast.JoinedStr) else [message]
            first, second = parts[0], parts[1] if len(parts) > 1 else None
            literal = (isinstance(first, ast.Constant) and isinstance(first.value, str)
                       and named.match(first.value))
            variable = (isinstance(first, ast.FormattedValue)  # f"{field}: ..."
                        and isinstance(first.value, ast.Name)
                        and first.value.id in ("field", "name")
                        and isinstance(second, ast.Constant)
                        and str(second.value).startswith(": "))
            if literal or variable:
                plain.append(f"{path.relative_to(package)}:{node.lineno}")
    assert not plain, plain
