"""Numeric options: NumberRule says what a value must be and refuses everything else."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from inference.errors import InferenceError, InvalidInputError
from inference.options import (
    COUNT,
    FINITE,
    NUMERIC_OPTIONS,
    POSITIVE,
    SEED,
    UNIT_INTERVAL_OPEN_LEFT,
    NumberRule,
)


def test_rules_describe_themselves_in_words():
    assert POSITIVE.describe() == "a finite number > 0"
    assert COUNT.describe() == "an integer >= 1"
    assert UNIT_INTERVAL_OPEN_LEFT.describe() == "a finite number in (0, 1]"
    assert FINITE.describe() == "a finite number"
    assert NumberRule(high=2.5, high_open=True).describe() == "a finite number < 2.5"


@pytest.mark.parametrize(("rule", "value", "want"), [
    (POSITIVE, 1e-300, 1e-300), (POSITIVE, 3, 3.0), (POSITIVE, np.float32(0.5), 0.5),
    (COUNT, np.int64(7), 7), (COUNT, 10**30, 10**30), (UNIT_INTERVAL_OPEN_LEFT, 1, 1.0),
    (FINITE, -2.5, -2.5), (SEED, 2**64 - 1, 2**64 - 1),
])
def test_valid_values_come_back_as_python_numbers(rule, value, want):
    got = rule.parse(value, "x")
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize(("rule", "value"), [
    (POSITIVE, 0.0), (POSITIVE, -1), (POSITIVE, math.inf), (POSITIVE, math.nan),
    (POSITIVE, 10**400), (FINITE, -math.inf), (COUNT, 0), (COUNT, 2.0), (COUNT, np.float64(3)),
    (COUNT, True), (POSITIVE, np.bool_(True)), (POSITIVE, "1.0"), (POSITIVE, None),
    (POSITIVE, [1.0]), (UNIT_INTERVAL_OPEN_LEFT, 0), (UNIT_INTERVAL_OPEN_LEFT, 1.5),
    (SEED, -5), (SEED, 2**64),
])
def test_everything_else_is_an_invalid_input_error_naming_the_option(rule, value):
    wanted = re.escape(rule.describe())
    with pytest.raises(InvalidInputError, match=f"^step must be {wanted}; got "):
        rule.parse(value, "step")


def test_option_errors_are_inference_errors_and_value_errors():
    with pytest.raises(InferenceError) as caught:
        POSITIVE.parse(math.inf, "clip")
    assert isinstance(caught.value, ValueError)


def test_the_table_covers_every_numeric_option_of_the_feature_heads():
    import inspect

    from inference.factory import FEATURE_HEAD_KINDS, fitting_function

    for kind in FEATURE_HEAD_KINDS:
        for name, parameter in inspect.signature(fitting_function(kind)).parameters.items():
            if name in ("features", "labels", "num_classes"):
                continue
            numeric = any(word in str(parameter.annotation).split(" | ")
                          for word in ("int", "float"))
            assert not numeric or name in NUMERIC_OPTIONS, (kind, name)
