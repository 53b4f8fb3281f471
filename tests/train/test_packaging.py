"""Installing like a library: the wheel holds taco_jax alone and requires only what it imports;
the GPT, the training program (presets in configs/), experiments and benchmarks run from a
checkout with their dependencies in extras (lower bounds; the tested pins in constraints.txt
and constraints-latest.txt, which CI installs with), and the tools run as modules."""
import ast
import fnmatch
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from train import config as config_lib

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
INSTALLED = ("taco_jax",)      # the wheel's packages
CHECKOUT_ONLY = ("models", "train", "configs", "experiments", "bench", "tools", "tests")
PINS = ("constraints.txt", "constraints-latest.txt")


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
    """Distributions required by the package with these extras ("taco_jax[train]" inside an
    extra is followed)."""
    project = PYPROJECT["project"]
    names, todo, seen = {_name(r) for r in project["dependencies"]}, list(extras), set()
    while todo:
        extra = todo.pop()
        seen.add(extra)
        for r in project["optional-dependencies"][extra]:
            if _name(r) == _name(project["name"]):
                todo += [e.strip() for e in re.search(r"\[(.*)\]", r)[1].split(",")
                         if e.strip() not in seen]
            else:
                names.add(_name(r))
    return names


def _pins(path: str) -> dict[str, str]:
    return {_name(line): line.split("==")[1].strip()
            for line in (ROOT / path).read_text().splitlines()
            if line.strip() and not line.startswith("#")}


def _distributions(imports: set[str]) -> set[str]:
    dists = importlib.metadata.packages_distributions()
    return {_name(d) for name in imports for d in dists.get(name, [name])}


def test_presets_are_found_from_any_directory(tmp_path, monkeypatch):
    names = config_lib.preset_names()
    assert names == sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))
    assert {"tiny", "small", "350m", "comm_heavy"} <= set(names)
    monkeypatch.chdir(tmp_path)                 # not the checkout: found beside train/
    for name in names:
        preset = ROOT / "configs" / f"{name}.yaml"
        for spelling in (name, f"{name}.yaml", f"configs/{name}.yaml"):
            assert config_lib.resolve_preset(spelling).read_text() == preset.read_text()
        assert config_lib.load_config(name).name == name
    assert config_lib.load_config(ROOT / "configs" / "small.yaml").name == "small"   # a path
    with pytest.raises(ValueError, match="'nope'"):
        config_lib.resolve_preset("nope")


def test_the_wheel_holds_taco_jax_alone():
    tools = PYPROJECT["tool"]["setuptools"]
    include = tools["packages"]["find"]["include"]
    for pkg in INSTALLED:
        assert any(fnmatch.fnmatch(pkg, pat) for pat in include), pkg
        assert (ROOT / pkg / "__init__.py").is_file(), pkg
    for pkg in CHECKOUT_ONLY:
        assert not any(fnmatch.fnmatch(pkg, pat) for pat in include), pkg
    assert tools["package-data"] == {"taco_jax": ["py.typed"]}
    assert (ROOT / "taco_jax" / "py.typed").is_file()
    # pytest imports the checkout's packages from the repository root
    assert "." in PYPROJECT["tool"]["pytest"]["ini_options"]["pythonpath"]


def test_dependencies_are_declared_and_pinned():
    deps = PYPROJECT["project"]["dependencies"]
    assert all(">=" in d and "==" not in d for d in deps), deps
    assert "jax>=0.11.2" in deps
    assert "jax[cuda13]>=0.11.2" in PYPROJECT["project"]["optional-dependencies"]["cuda"]
    checkout = set(INSTALLED) | set(CHECKOUT_ONLY)
    library = _third_party_imports("taco_jax") - checkout
    assert _distributions(library) == _declared(), library      # exactly what it imports
    for extra, packages in [("train", ("models", "train", "bench", "examples")),
                            ("experiments", ("experiments",)), ("test", ("tests",))]:
        imports = set().union(*map(_third_party_imports, packages)) - checkout
        imports -= {f.stem for f in (ROOT / "tests").rglob("*.py")}  # the tests' own modules
        assert _distributions(imports) <= _declared(extra), (extra, imports)
    assert {"flax", "optax", "orbax-checkpoint"} <= _declared("train")
    assert {"scipy", "pytest", "hypothesis", "flax"} <= _declared("test")
    for path in PINS:
        pins = _pins(path)
        for dist in _declared("test", "experiments"):
            assert dist in pins, f"{dist} has no tested version in {path}"
    assert _pins("constraints.txt")["jax"] == "0.11.2"
    old, new = _pins("constraints.txt"), _pins("constraints-latest.txt")
    assert old.keys() <= new.keys() and new["jax"] != old["jax"], new


def test_ci_runs_the_suite_on_both_pins():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "set -euo pipefail" in ci            # pytest's exit 5 (no tests ran) fails CI
    for path in PINS:
        assert f"suite {path} " in ci, path
    assert "pip wheel --no-deps" in ci
    readme = (ROOT / "README.md").read_text()
    assert ".venv/bin/python -m pytest -q tests" in readme
    for path in PINS:
        assert path in readme and f"jax {_pins(path)['jax']}" in readme, path


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
