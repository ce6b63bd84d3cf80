"""The docs site's griffe extension turns Sphinx roles into code spans (issue 43: the API pages
showed ``:func:`...``` raw)."""

import pytest

from tools.griffe_sphinx_roles import rewrite_roles


@pytest.mark.parametrize(("text", "expected"), [
    (":func:`inference.fit_head`", "`inference.fit_head`"),
    (":class:`~inference.gaussian.GaussianPosterior`", "`GaussianPosterior`"),
    (":py:meth:`Accumulator.merge`", "`Accumulator.merge`"),
    (":func:`the factory <inference.fit_head>`", "`the factory`"),
    (":math:`\\sqrt{2}`", "$\\sqrt{2}$"),  # math, typeset by the site's KaTeX
    ("see :mod:`calibration` and :exc:`~bayesfl.errors.ConfigError`.",
     "see `calibration` and `ConfigError`."),
])
def test_a_role_becomes_the_code_span_sphinx_would_show(text, expected):
    assert rewrite_roles(text) == expected


def test_text_without_roles_and_plain_code_spans_are_left_alone():
    text = "A `code span`, a ratio 3:1 and a colon: then `x`."
    assert rewrite_roles(text) == text
