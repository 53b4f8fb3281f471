"""taco_jax.__version__ is the installed distribution's version (pyproject.toml's); the two
pin sets CI tests (constraints.txt, constraints-latest.txt) name the same packages, at jax
versions taco_jax._jax_private was checked on; tools/refresh_latest.py writes the newest
set from a pip report, its header kept. No network."""
import importlib.metadata
import tomllib
from pathlib import Path

import pytest

import taco_jax
from taco_jax import _jax_private
from tools import refresh_latest

ROOT = Path(__file__).resolve().parent.parent


def test_version_is_the_distributions():
    assert taco_jax.__version__ == importlib.metadata.version("taco_jax")


def test_version_is_pyprojects():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert taco_jax.__version__ == pyproject["project"]["version"]


def test_the_pin_sets_name_the_same_packages_at_checked_jax_versions():
    (_, old), (header, new) = (refresh_latest.read_pins(ROOT / f) for f in
                               ("constraints.txt", "constraints-latest.txt"))
    assert list(map(refresh_latest.canonical, old)) == list(map(refresh_latest.canonical, new))
    assert header and all(line.startswith("#") for line in header)
    for pins in (old, new):
        assert pins["jax"] == pins["jaxlib"] and pins["jax"] in _jax_private.CHECKED


def test_refresh_resolves_the_test_extra_and_pins_in_order():
    specs = refresh_latest.project_requirements()
    assert "jax>=0.11.2" in specs and "pytest>=8" in specs and "scipy>=1.15" in specs
    assert "flax>=0.12.10" in specs and not any("taco_jax" in s for s in specs)
    report = {"install": [{"metadata": {"name": "PyYAML", "version": "6.1"}},
                          {"metadata": {"name": "jax", "version": "9.0"}},
                          {"metadata": {"name": "ml-dtypes", "version": "1.0"}}]}
    versions = refresh_latest.resolved(report)
    text = refresh_latest.render(["# head"], ["jax", "ml_dtypes", "PyYAML"], versions)
    assert text == "# head\njax==9.0\nml_dtypes==1.0\nPyYAML==6.1\n"
    with pytest.raises(SystemExit, match="no scipy"):
        refresh_latest.render([], ["jax", "scipy"], versions)


@pytest.mark.parametrize("a,b,newer", [
    ("0.12.1", "0.12.0.1", True), ("0.12.0.1", "0.12.0", True), ("0.12.1", "0.12.1", False),
    ("0.12.0", "0.12.1", False), ("0.12.1", None, True)])
def test_check_compares_versions(a, b, newer):
    assert refresh_latest.newer(a, b) is newer
