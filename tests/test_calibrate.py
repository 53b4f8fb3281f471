"""taco_jax.calibrate: the break-even size of compression on this machine (mechanics only:
CPU timings mean nothing, so the decision rule is tested on given times)."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from taco_jax import calibrate


def rows(*ratios, sizes=(1, 4, 16, 64)):
    return [{"mib": m, "lax_us": 100.0, "xla_us": 100.0 * r, "ratio": r}
            for m, r in zip(sizes, ratios)]


def test_decide_min_bytes():
    mib = 2**20
    assert calibrate.decide_min_bytes(rows(1.2, 1.0, 0.9, 0.8), 0.97) == 16 * mib
    assert calibrate.decide_min_bytes(rows(0.5, 0.6, 0.7, 0.8), 0.97) == 1 * mib
    # the largest size loses: never, whatever smaller sizes did (noise)
    assert calibrate.decide_min_bytes(rows(0.5, 0.6, 0.7, 1.0), 0.97) == calibrate.NEVER
    # a win below a loss does not count: the threshold only moves down from the top
    assert calibrate.decide_min_bytes(rows(0.9, 1.1, 0.9, 0.9), 0.97) == 16 * mib
    assert calibrate.decide_min_bytes(rows(0.9, 0.9, float("nan"), 0.9), 0.97) == 64 * mib
    assert calibrate.decide_min_bytes(rows(0.99, 0.99, 0.99, 0.99), 0.97) == calibrate.NEVER
    assert calibrate.decide_min_bytes(rows(0.99, 0.99, 0.99, 0.99), 1.0) == 1 * mib


def mesh2d():
    return jax.make_mesh((2, 2), ("data", "tp"), devices=jax.devices()[:4])


def test_calibrate_with_given_times():
    """Each size is timed as (prep, lax, taco); the prep time is subtracted from both."""
    times = iter([10.0, 110.0, 130.0,      # 1/64 MiB: lax 100, taco 120 -> 1.2
                  10.0, 210.0, 150.0])     # 1/16 MiB: lax 200, taco 140 -> 0.7
    cal = calibrate.calibrate_min_bytes(mesh2d(), "tp", sizes_mib=(1 / 16, 1 / 64),
                                     timer=lambda fn, x, **kw: next(times))
    assert [r["mib"] for r in cal.rows] == [1 / 64, 1 / 16]
    assert [round(r["xla_ratio"], 3) for r in cal.rows] == [1.2, 0.7]
    assert cal.rows[0]["lax_us"] == 100.0 and cal.rows[1]["xla_us"] == 140.0
    assert cal.min_bytes == 2**20 // 16
    assert "from 0.0625 MiB per device" in cal.table()
    assert [cal.route(int(r["mib"] * 2**20)) for r in cal.rows] == ["lax", "xla"]


def test_calibrate_runs_on_simulated_devices():
    """The real timer on a 2-D mesh, psum over one axis: both programs compile and run, and
    the answer is one of the sizes or NEVER, consistent with the measured rows."""
    calls = itertools.count()

    def timer(fn, x, **kw):
        next(calls)
        return calibrate.time_calls(fn, x, iters=2, repeats=1, batches=1)
    cal = calibrate.calibrate_min_bytes(mesh2d(), "tp", sizes_mib=(1 / 32,), timer=timer)
    assert next(calls) == 3 and len(cal.rows) == 1
    r = cal.rows[0]
    assert r["mib"] == 1 / 32 and r["lax_us"] != 0
    assert cal.min_bytes == calibrate.decide_min_bytes(cal.rows, cal.margin, "xla_ratio")
    assert cal.min_bytes in (calibrate.NEVER, 2**20 // 32)


def test_calibrate_rejects_bad_arguments():
    m = mesh2d()
    with pytest.raises(ValueError, match="axis_name='model'"):
        calibrate.calibrate_min_bytes(m, "model")
    with pytest.raises(ValueError, match="nothing to calibrate"):
        calibrate.calibrate_min_bytes(m, "tp", codec="none")
    with pytest.raises(ValueError, match="tacoo"):
        calibrate.calibrate_min_bytes(m, "tp", codec="tacoo")
    with pytest.raises(ValueError, match="sizes_mib"):
        calibrate.calibrate_min_bytes(m, "tp", sizes_mib=(0,))
    with pytest.raises(ValueError, match="dtype"):
        calibrate.calibrate_min_bytes(m, "tp", dtype=jnp.int32)
    one = jax.make_mesh((1, 4), ("tp", "data"), devices=jax.devices()[:4])
    assert calibrate.calibrate_min_bytes(one, "tp").min_bytes == calibrate.NEVER


def test_time_calls_keeps_every_call():
    """The straight-line timer's program holds `iters` separate calls (none merged by CSE
    or dropped as dead), returns all outputs, and times something."""
    fn = lambda v: jnp.sin(v) * 2
    xs = [jnp.full(64, float(i)) for i in range(5)]
    calls = calibrate.jit_calls(fn)
    assert calls.lower(xs).compile().as_text().count("sine(") == 5
    outs = calls(xs)
    assert len(outs) == 5
    np.testing.assert_allclose(np.asarray(outs[3]), np.sin(3.0) * 2, rtol=1e-6)
    assert calibrate.time_calls(fn, xs[1], iters=3, repeats=1, batches=2) > 0
