"""Installing like a library: the presets ship as package data of the wheel, every import of
installed code is a declared dependency (lower bounds; the tested pins in constraints.txt,
which CI installs with), and the tools of the checkout run as modules."""
import ast
import fnmatch
import importlib.metadata
import importlib.resources
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from train import config as config_lib

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
INSTALLED = ("taco_jax", "models", "train", "configs")      # the wheel's packages
CHECKOUT_ONLY = ("experiments", "bench", "tests")


def _name(requirement: str) -> str:
    """'jax[cuda13]>=0.11.2' -> 'jax' (normalized as pip compares names)."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement)[0]).lower()


def _third_party_imports(package: str) -> set[str]:
    """Top-level names imported anywhere in the package's sources, stdlib excluded."""
    names = set()
    for f in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"__future__"}


def _declared(*extras: str) -> set[str]:
    project = PYPROJECT["project"]
    reqs = list(project["dependencies"])
    for e in extras:
        reqs += project["optional-dependencies"][e]
    return {_name(r) for r in reqs}


def _distributions(imports: set[str]) -> set[str]:
    dists = importlib.metadata.packages_distributions()
    return {_name(d) for name in imports for d in dists.get(name, [name])}


def test_presets_are_package_data():
    names = config_lib.preset_names()
    assert names == sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))
    assert {"tiny", "small", "350m", "comm_heavy"} <= set(names)
    for name in names:
        packaged = importlib.resources.files("configs") / f"{name}.yaml"
        assert packaged.is_file()
        assert config_lib.resolve_preset(name).read_text() == packaged.read_text()
        assert config_lib.load_config(name).name == name
    assert config_lib.load_config(ROOT / "configs" / "small.yaml").name == "small"   # a path
    tools = PYPROJECT["tool"]["setuptools"]
    include = tools["packages"]["find"]["include"]
    for pkg in INSTALLED:
        assert any(fnmatch.fnmatch(pkg, pat) for pat in include), pkg
        assert (ROOT / pkg / "__init__.py").is_file(), pkg
    for pkg in CHECKOUT_ONLY:
        assert not any(fnmatch.fnmatch(pkg, pat) for pat in include), pkg
    assert "*.yaml" in tools["package-data"]["configs"]


def test_dependencies_are_declared_and_pinned():
    deps = PYPROJECT["project"]["dependencies"]
    assert all(">=" in d and "==" not in d for d in deps), deps
    assert {"jax", "flax", "optax", "orbax-checkpoint"} <= {_name(d) for d in deps}
    assert "jax>=0.11.2" in deps and "flax>=0.12.10" in deps
    assert "jax[cuda13]>=0.11.2" in PYPROJECT["project"]["optional-dependencies"]["cuda"]
    installed = _third_party_imports("taco_jax") | _third_party_imports("models") \
        | _third_party_imports("train")
    assert _distributions(installed - set(INSTALLED)) <= _declared(), installed
    experiments = _third_party_imports("experiments") - set(INSTALLED) - set(CHECKOUT_ONLY)
    assert "scipy" in experiments
    assert _distributions(experiments) <= _declared("experiments")
    assert "scipy" in _declared("test")               # the tests import the drivers
    pins = {_name(line): line.split("==")[1].strip()
            for line in (ROOT / "constraints.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")}
    for dist in _declared("test", "experiments"):
        assert dist in pins, f"{dist} has no tested version in constraints.txt"
    assert pins["jax"] == "0.11.2" and pins["jaxlib"] == "0.11.2"


def test_ci_installs_the_pins_and_runs_the_readme_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "set -euo pipefail" in ci            # pytest's exit 5 (no tests ran) fails CI
    assert "pip install -q -c constraints.txt -e '.[test]'" in ci
    command = ".venv/bin/python -m pytest -q tests"
    assert ci.rstrip().splitlines()[-1] == command
    assert command in (ROOT / "README.md").read_text()


def test_tools_run_as_modules():
    """`python -m <tool> --help` from the checkout, with no sys.path edits in the tools."""
    tools = ["train", "train.plot", "experiments.ablation", "experiments.fidelity",
             "experiments.grad_error", "bench.train_step"]
    for tool in tools:
        src = ROOT / (tool.replace(".", "/") + ("/__main__.py" if tool == "train" else ".py"))
        assert "sys.path" not in src.read_text(), src
    script = ("import runpy, sys\n"
              f"for tool in {tools!r}:\n"
              "    sys.argv = [tool, '--help']\n"
              "    try:\n"
              "        runpy.run_module(tool, run_name='__main__', alter_sys=True)\n"
              "    except SystemExit as e:\n"
              "        assert e.code in (0, None), (tool, e.code)\n"
              "    print('ok', tool)\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert [line for line in out.stdout.splitlines() if line.startswith("ok ")] == [
        f"ok {t}" for t in tools]
