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
    """The "Use" snippet as pasted: it places its own sharded inputs and compresses its psum;
    the result is the product within the codec's error."""
    readme = (ROOT / "README.md").read_text()
    use = readme.split("## Use", 1)[1]
    snippet = re.search(r"```python\n(.*?)```", use, re.S).group(1)
    check = ("\nexact = np.asarray(x) @ np.asarray(w)\n"
             "err = np.linalg.norm(np.asarray(y) - exact) / np.linalg.norm(exact)\n"
             "assert y.shape == exact.shape and 1e-4 < err < 0.05, err\n"
             "print('ok', err)\n")
    r = _run(PRELUDE + snippet + check, tmp_path)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
    assert re.search(r"psum\[tp\] float32\[512, 256\].*: compressed \(taco", r.stdout), r.stdout
