"""constraints-latest.txt: the packages constraints.txt pins, at the newest versions the
package index serves.

  python tools/refresh_latest.py           rewrite constraints-latest.txt (its header kept)
  python tools/refresh_latest.py --check   one line if the index serves a newer jax than
                                           constraints-latest.txt pins; never fails

The refresh resolves what `pip install -e '.[test]'` installs with nothing pinned (the
requirements of pyproject.toml's test extra, and every package constraints.txt names) in
one `pip install --dry-run --ignore-installed --report`, with the pip and Python this runs
under (Python >= 3.12, as the package requires), and pins each package of constraints.txt
(and any that only constraints-latest.txt names) at the version pip chose. Nothing is
installed. The check asks the index for jax alone, with a short timeout: without a network
it says so in one line and exits 0, so CI stays deterministic.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PINS = ROOT / "constraints.txt"
LATEST = ROOT / "constraints-latest.txt"
CHECK_TIMEOUT_S = 20          # the whole check, however pip is configured


def canonical(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path) -> tuple[list[str], dict[str, str]]:
    """(the leading comment lines, {name as written: version}) of a constraints file."""
    header, pins = [], {}
    for line in path.read_text().splitlines():
        if not pins and line.startswith("#"):
            header.append(line)
        elif line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[name.strip()] = version.strip()
    return header, pins


def project_requirements(pyproject: Path = ROOT / "pyproject.toml",
                         extras: tuple[str, ...] = ("test",)) -> list[str]:
    """The requirement specifiers `pip install -e '.[test]'` resolves: the dependencies and
    those of `extras`, the project's references to its own extras followed."""
    project = tomllib.loads(pyproject.read_text())["project"]
    name, optional = canonical(project["name"]), project.get("optional-dependencies", {})
    specs, seen, todo = list(project["dependencies"]), set(), list(extras)
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for spec in optional[extra]:
            own = re.fullmatch(r"([A-Za-z0-9_.-]+)\[([^\]]+)\]", spec.strip())
            if own and canonical(own[1]) == name:
                todo += [e.strip() for e in own[2].split(",")]
            else:
                specs.append(spec)
    return specs


def pip_report(requirements: list[str], *pip_args: str, timeout: float | None = None) -> dict:
    """pip's installation report for `requirements` resolved from scratch (nothing
    installed). Raises subprocess.CalledProcessError or TimeoutExpired."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
         "--quiet", "--report", "-", *pip_args, *requirements],
        check=True, capture_output=True, text=True, timeout=timeout).stdout
    return json.loads(out)


def resolved(report: dict) -> dict[str, str]:
    """{canonical name: version} of what a pip report installs."""
    return {canonical(i["metadata"]["name"]): i["metadata"]["version"]
            for i in report["install"]}


def render(header: list[str], names: list[str], versions: dict[str, str]) -> str:
    """The constraints file: `header`, then `name==version` for each of `names`.
    Raises SystemExit naming packages the resolution lacks."""
    missing = [n for n in names if canonical(n) not in versions]
    if missing:
        raise SystemExit(f"the resolution installs no {', '.join(missing)}: "
                         f"constraints.txt names packages that '.[test]' no longer needs")
    return "\n".join(header + [f"{n}=={versions[canonical(n)]}" for n in names]) + "\n"


def refresh() -> None:
    if sys.version_info < (3, 12):
        raise SystemExit(f"run with Python >= 3.12 (the package's requires-python); "
                         f"this is {sys.version.split()[0]}")
    _, pins = read_pins(PINS)
    header, latest = read_pins(LATEST)
    names = list(pins) + [n for n in latest
                          if canonical(n) not in {canonical(p) for p in pins}]
    try:
        report = pip_report(project_requirements() + names)
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"pip could not resolve the newest versions:\n{e.stderr}")
    LATEST.write_text(render(header, names, resolved(report)))
    changed = {n: (latest.get(n), v) for n, v in read_pins(LATEST)[1].items()
               if latest.get(n) != v}
    print(f"{LATEST.name}: " + (", ".join(f"{n} {a} -> {b}" for n, (a, b) in changed.items())
                                if changed else "already the newest"))


def check() -> None:
    """One line: whether the index serves a newer jax than constraints-latest.txt pins."""
    pinned = read_pins(LATEST)[1].get("jax")
    try:
        newest = resolved(pip_report(["jax"], "--no-deps", "--timeout", "5", "--retries", "0",
                                     timeout=CHECK_TIMEOUT_S))["jax"]
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError, ValueError,
            KeyError) as e:
        print(f"newest-versions check skipped: the package index did not answer "
              f"({type(e).__name__})")
        return
    if newer(newest, pinned):
        print(f"warning: the package index serves jax {newest}, newer than "
              f"{LATEST.name}'s {pinned}: run python tools/refresh_latest.py")


def newer(a: str, b: str | None) -> bool:
    """Whether version `a` is newer than `b` (None: no pin)."""
    if b is None:
        return True
    try:
        from packaging.version import Version
        return Version(a) > Version(b)
    except ImportError:
        key = lambda v: [int(x) if x.isdigit() else -1 for x in v.split(".")]  # noqa: E731
        return key(a) > key(b)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="warn in one line if the index serves a newer jax; never fails")
    args = ap.parse_args(argv)
    check() if args.check else refresh()


if __name__ == "__main__":
    main()
