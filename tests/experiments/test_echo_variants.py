"""experiments.echo_variants: its codec variants (roundtrip properties, NaN groups, wire
bytes within 0.30 of bf16's), the variant grammar and each step's byte ratio, the paired
statistics, and the GPU batch's step."""
import os
import shutil
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import echo_variants as ev
from taco_jax import codecs

NEW = ("echo4-g256", "echo4-g64c", "echo4-sr")


@pytest.fixture(scope="module")
def x():
    rng = np.random.default_rng(0)   # heavy-tailed, 7 groups of 64 and a partial one
    return jnp.asarray(rng.standard_t(4, size=(3, 160)).astype(np.float32))


@pytest.mark.parametrize("name", NEW)
def test_roundtrip_zero_nan_and_error(name, x):
    c = codecs.get(name)
    assert float(jnp.abs(c.roundtrip(jnp.zeros((2, 256)))).max()) == 0.0
    y = c.roundtrip(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    rel = float(jnp.linalg.norm(y - x) / jnp.linalg.norm(x))
    echo4 = float(jnp.linalg.norm(codecs.get("echo4").roundtrip(x) - x) / jnp.linalg.norm(x))
    # a 4-bit grid: larger groups and stochastic rounding cost accuracy, smaller groups gain
    assert 0.02 < rel < (0.3 if name == "echo4-sr" else 0.2)
    assert (rel < echo4) == (name == "echo4-g64c")
    bad = c.roundtrip(x.at[1, 3].set(jnp.nan))      # that group decodes NaN, the rest not
    flat = np.isnan(np.asarray(bad)).ravel()
    b = c.block_size
    group = (160 + 3) // b
    assert flat[group * b:(group + 1) * b].all() and flat.sum() == b


@pytest.mark.parametrize("name", NEW)
def test_wire_bytes_within_the_budget(name):
    c = codecs.get(name)
    n = 8 * 128 * 64
    assert c.wire_bytes(n) == n // c.block_size * c.row_bytes
    assert ev.codec_ratio(name, n) <= ev.BYTE_BUDGET
    assert ev.codec_ratio("echo4-g64c", n) == 35 / 128      # 32 B of codes + bf16 s + u8 z


def test_compact_scale_spans_the_group():
    c = codecs.get("echo4-g64c")
    g = jnp.linspace(-1.0, 3.0, 64)[None]                  # the max sits on the grid's end
    y = c.roundtrip(g)
    step = float(y.max() - y.min()) / 15
    assert float(jnp.abs(y - g).max()) <= 0.5 * step * (1 + 2 ** -6)


def test_stochastic_rounding_is_unbiased_and_reproducible():
    # 64 groups with the grid of [-1, 1], each holding 0.3 up to a last-bit change: a fresh
    # dither for each, as the next call's values would get
    v = jnp.full((64, 128), 0.3) + jnp.arange(64)[:, None] * 3e-8
    v = v.at[:, :2].set(jnp.array([1.0, -1.0]))
    c = codecs.get("echo4-sr")
    once = c.roundtrip(v)
    np.testing.assert_array_equal(once, c.roundtrip(v))
    nearest = codecs.get("echo4").roundtrip(v)
    assert abs(float(once[:, 5].mean()) - 0.3) < 0.01 < abs(float(nearest[:, 5].mean()) - 0.3)
    assert len(set(np.asarray(once[:, 5]).tolist())) == 2          # the two grid neighbours
    u = ev.dither(jnp.linspace(-1, 1, 4096).reshape(32, 128), 0)
    assert 0 <= float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.02


def test_variant_grammar():
    v = ev.parse_variant("echo4+feedback,head=taco,lr=1.1667")
    assert (v.fwd, v.bwd, v.head, v.feedback, v.feedback_bwd) == ("echo4", "echo4", "taco",
                                                                  True, False)
    assert v.lr_scale == pytest.approx(1.1667)
    v = ev.parse_variant("echo4/taco+feedback-bwd")
    assert (v.fwd, v.bwd, v.feedback, v.feedback_bwd) == ("echo4", "taco", True, True)
    for bad, msg in (("echo4+fb", "feedback"), ("echo4,lr", "option"), ("nope", "unknown codec"),
                     ("none+feedback", "compressing forward")):
        with pytest.raises(ValueError, match=msg):
            ev.parse_variant(bad)
    for name in ev.VARIANTS:
        ev.parse_variant(name)


def test_wire_ratio_per_step():
    n = 8 * 128 * 64
    assert ev.wire_ratio(ev.parse_variant("echo4"), 4, n) == pytest.approx(72 / 256)
    assert ev.wire_ratio(ev.parse_variant("none"), 4, n) == 1.0
    head = ev.wire_ratio(ev.parse_variant("echo4,head=taco"), 4, n)    # 16 + 1 sites
    assert head == pytest.approx((16 * 72 / 256 + 264 / 512) / 17) and head <= ev.BYTE_BUDGET
    assert ev.wire_ratio(ev.parse_variant("echo4/taco"), 4, n) > ev.BYTE_BUDGET


def _row(name, seed, loss):
    return {"variant": f"{name}@seed{seed}", "codec": name, "feedback": "+feedback" in name,
            "seed": seed, "final_val_loss": loss, "val_batch_losses": [], "wire_ratio": 0.28}


def test_paired_ranking_and_contrasts():
    rows = []
    for s, base in enumerate([2.0, 2.1, 2.2]):
        rows += [_row("none", s, base), _row("echo4", s, base * (1.002 + s * 1e-4)),
                 _row("echo4+feedback", s, base * 1.001), _row("tah4", s, base * 1.0015)]
    out = ev.summarize(rows, ["none", "echo4", "echo4+feedback", "tah4"])
    assert [e["variant"] for e in out["ranked"]] == ["echo4+feedback", "tah4", "echo4"]
    e = {e["variant"]: e for e in out["ranked"]}
    assert e["echo4"]["mean_pct"] == pytest.approx(0.21)
    lo, hi = e["echo4"]["ci90_pct"]
    assert lo < 0.21 < hi and e["echo4"]["n"] == 3
    vs = e["tah4"]["vs"]                                   # the codec variant against echo4
    assert vs["b"] == "echo4" and vs["mean_pct"] == pytest.approx(-0.06)
    sep = {(c["a"], c["b"]): c for c in out["separation"]}
    assert sep["echo4", "echo4+feedback"]["mean_pct"] == pytest.approx(0.11)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_batch_runs_the_protocol(tmp_path):
    script = Path(__file__).resolve().parents[2] / "bench" / "gpu_run.sh"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(f'#!/usr/bin/env bash\necho "$*" >> "{tmp_path}/calls"\n')
    (bin_dir / "python").chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
           "GIT_COMMIT": "0" * 40}
    r = subprocess.run(["bash", str(script), "echo4_variants"], capture_output=True,
                       text=True, env=env, cwd=tmp_path, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    call = next(c for c in (tmp_path / "calls").read_text().splitlines()
                if "experiments.echo_variants" in c)
    for part in ("--preset fidelity", "--tp 8", "--seeds 0 1 2 3 4 5", "--eval-batches 0",
                 "--variants none ", "--json bench/results/echo4_variants_tp8.json"):
        assert part in call, (part, call)
    assert jax.devices()      # the module's import left the backend usable
