"""The top-level package is lazy (PEP 562): ``import bayesfl`` loads nothing else, and every
public name still works as with eager imports."""

import importlib
import subprocess
import sys
import textwrap
from pathlib import Path

import bayesfl

ROOT = Path(__file__).resolve().parents[2]


def _fresh(code: str) -> str:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout.strip()


def test_every_public_name_is_the_object_of_its_module():
    assert set(bayesfl.__all__) == set(bayesfl._EXPORTS)
    for name in bayesfl.__all__:
        source = importlib.import_module(bayesfl._EXPORTS[name])
        expected = source if name in bayesfl._MODULES else getattr(source, name)
        assert getattr(bayesfl, name) is expected, name
    assert set(bayesfl.__all__) <= set(dir(bayesfl))


def test_importing_the_package_loads_no_submodule_and_no_torch():
    loaded = _fresh("""
        import sys
        import bayesfl
        print(sorted(m for m in sys.modules if m.startswith(("bayesfl.", "torch"))))
    """)
    assert loaded == "[]"


def test_the_simulate_submodule_does_not_shadow_the_simulate_function():
    # importing bayesfl.simulate (the module) first used to be harmless because the eager
    # package rebound the name to the function afterwards; the lazy one must keep it so
    out = _fresh("""
        import sys
        import bayesfl.simulate
        from bayesfl.simulate import SimulationResult
        import bayesfl
        from bayesfl import simulate
        print(callable(simulate), simulate is bayesfl.simulate,
              simulate is sys.modules["bayesfl.simulate"].simulate)
    """)
    assert out == "True True True"


def test_an_unknown_name_is_an_attribute_error_and_submodules_still_import():
    try:
        bayesfl.no_such_name  # noqa: B018
    except AttributeError as err:
        assert "no_such_name" in str(err)
    else:  # pragma: no cover
        raise AssertionError("bayesfl.no_such_name did not raise")
    from bayesfl import errors  # a submodule that is not a public name

    assert errors.ConfigError is bayesfl.ConfigError
