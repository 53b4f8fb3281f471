"""The README's drop-in snippet and every examples/*.py run as pasted, each in its own
process on the simulated CPU devices it sets up itself."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(code_or_path, tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT),
           "TACO_JAX_CALIBRATION": str(tmp_path / "none.json")}
    args = [sys.executable, str(code_or_path)] if isinstance(code_or_path, Path) else \
        [sys.executable, "-c", code_or_path]
    return subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("example", sorted(p.name for p in (ROOT / "examples").glob("*.py")))
def test_example_runs(example, tmp_path):
    r = _run(ROOT / "examples" / example, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "compressed (taco" in r.stdout, r.stdout


def _use_snippet(readme: str) -> str:
    """The README's "Use" snippet: the first python block under "## Use"."""
    return re.search(r"```python\n(.*?)```", readme.split("## Use", 1)[1], re.S).group(1)


def test_readme_snippet_runs(tmp_path):
    """The "Use" snippet as pasted, on its own: it sets up its simulated devices, places its
    sharded inputs, compresses its psum and prints the site report its last comment shows;
    the result is the product within the codec's error."""
    snippet = _use_snippet((ROOT / "README.md").read_text())
    shown = re.search(r"print\(taco_jax\.telemetry\.site_report\(\)\)\s*# (.*)", snippet)
    assert shown, "the snippet's site_report print carries what it prints as its comment"
    check = ("\nexact = np.asarray(x) @ np.asarray(w)\n"
             "err = np.linalg.norm(np.asarray(y) - exact) / np.linalg.norm(exact)\n"
             "assert y.shape == exact.shape and 1e-4 < err < 0.05, err\n"
             "print('ok', err)\n")
    r = _run(snippet + check, tmp_path)
    assert r.returncode == 0 and r.stdout.splitlines()[-1].startswith("ok"), r.stderr[-3000:]
    report = r.stdout.splitlines()[:-1]
    assert [line.strip() for line in report] == [shown.group(1).strip()], r.stdout
    assert ": compressed (taco" in shown.group(1)
