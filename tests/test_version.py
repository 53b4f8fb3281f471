"""taco_jax.__version__ is the installed distribution's version (pyproject.toml's)."""
import importlib.metadata
import tomllib
from pathlib import Path

import taco_jax

ROOT = Path(__file__).resolve().parent.parent


def test_version_is_the_distributions():
    assert taco_jax.__version__ == importlib.metadata.version("taco_jax")


def test_version_is_pyprojects():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert taco_jax.__version__ == pyproject["project"]["version"]
