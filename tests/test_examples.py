"""The README's drop-in snippet and every examples/*.py run, each in its own process with
4 simulated CPU devices."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRELUDE = "import jax\njax.config.update('jax_num_cpu_devices', 4)\n"


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


def test_readme_snippet_runs(tmp_path):
    readme = (ROOT / "README.md").read_text()
    use = readme.split("## Use", 1)[1]
    snippet = re.search(r"```python\n(.*?)```", use, re.S).group(1)
    check = ("\nimport numpy as np\nfrom jax.sharding import NamedSharding\n"
             "x = jax.device_put(np.ones((8, 64), np.float32), NamedSharding(mesh, P(None, 'tp')))\n"
             "w = jax.device_put(np.ones((64, 16), np.float32), NamedSharding(mesh, P('tp', None)))\n"
             "y = row_parallel(x, w)\nassert y.shape == (8, 16) and float(y[0, 0]) == 64.0\n"
             "print('ok')\n")
    r = _run(PRELUDE + snippet + check, tmp_path)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
