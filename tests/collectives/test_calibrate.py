"""taco_jax.calibrate: the break-even size of compression on this machine (mechanics only:
CPU timings mean nothing, so the decision rule is tested on given times)."""
import itertools
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from taco_jax import calibrate

ROOT = Path(__file__).resolve().parents[2]


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
    cal = calibrate.calibrate_min_bytes(mesh2d(), "tp", sizes_mib=(1 / 16, 1 / 64), iters=1,
                                        timer=lambda calls, x, **kw: next(times))
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

    def timer(program, x, **kw):
        next(calls)
        return calibrate.time_program(program, x, **kw)
    cal = calibrate.calibrate_min_bytes(mesh2d(), "tp", sizes_mib=(1 / 32,), timer=timer,
                                        iters=2, repeats=1, batches=1)
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
    with pytest.raises(ValueError, match="batches=0"):
        calibrate.calibrate_min_bytes(m, "tp", batches=0)
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


# -- memory, correctness of each transport, what it prints ----------------------------------
def test_held_bytes_is_what_xla_allocates_for_the_programs_timed():
    """Against XLA's memory analysis of the compiled programs, per device: timing holds the
    input, the program's `iters` arguments (the input's copies and their scalars), each of
    `batches` executions' outputs and one execution's temporaries, for the program that
    needs most (here the one with temporaries: a sort); on a host backend all 4 devices'
    of it, with the allocator's and the compiler's share."""
    m = mesh2d()
    per, iters, batches = 4096, 3, 2
    nbytes = per * 2                                    # per device, bf16
    x = jax.ShapeDtypeStruct((2 * per,), jnp.bfloat16, sharding=NamedSharding(m, P("tp")))
    arg = (x, jax.ShapeDtypeStruct((), jnp.bfloat16))

    def sharded(fn, out):
        return jax.jit(jax.shard_map(fn, mesh=m, in_specs=P("tp"), out_specs=out))
    from jax import lax
    programs = [calibrate.jit_calls(calibrate.fresh(f)) for f in (
        sharded(lambda v: lax.psum(v, "tp"), P()),
        sharded(lambda v: jnp.sort(v) + jnp.cumsum(v), P("tp")))]
    analysed = [c.lower([arg] * iters).compile().memory_analysis() for c in programs]
    assert analysed[1].temp_size_in_bytes > 0
    want = max(nbytes + a.argument_size_in_bytes + batches * a.output_size_in_bytes
               + a.temp_size_in_bytes for a in analysed)
    figures = [calibrate.program_bytes(c, arg, iters) for c in programs]
    held = calibrate.held_bytes(nbytes, 2, figures, iters=iters, batches=batches)
    scalars = iters * 8                                 # the `one` arguments, padded
    assert want - scalars <= held <= want, (held, want)
    host = calibrate.held_bytes(nbytes, 2, figures, iters=iters, batches=batches,
                                host_devices=4)
    base = calibrate.HOST_FACTOR * 4 * want + calibrate.HOST_FIXED
    assert base - calibrate.HOST_FACTOR * 4 * scalars <= host <= base


def test_sizes_that_do_not_fit_are_skipped_and_said_so():
    """A size above the budget is not measured, nor any larger one (here: 1/16 MiB fits,
    1/4 and 1 MiB not)."""
    lines = []
    budget = (calibrate.HOST_FIXED + (6 << 20), False, "a test budget")
    cal = calibrate.calibrate_min_bytes(mesh2d(), "tp", sizes_mib=(1, 1 / 16, 1 / 4), iters=1,
                                        batches=1, budget=budget, log=lines.append,
                                        timer=lambda calls, x, **kw: 1.0)
    assert [r["mib"] for r in cal.rows] == [1 / 16]
    words = f"for 4 devices, a test budget: {budget[0] / 2**20:.1f} MiB"
    assert any(line.startswith("0.25 MiB/device: skipped, does not fit (needs") and
               words in line for line in lines), lines
    assert "1 MiB/device: skipped, does not fit (0.25 MiB/device did not)" in lines, lines
    assert any(line.startswith("0.0625 MiB/device: lax.psum") for line in lines), lines


def test_a_calibration_holds_no_more_than_its_budget(tmp_path):
    """The command on 4 simulated devices, under --memory-gib 2, at 4, 64 and 256 MiB per
    device: it finishes, skips what does not fit, and its peak resident memory stays
    within the budget beyond what the bare process (jax, taco_jax, the 4 devices) holds."""
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="4", JAX_PLATFORMS="cpu")

    def peak_kib(*args):      # the child's peak RSS, through a parent that has no other
        report = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
                  "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
        done = subprocess.run([sys.executable, "-c", report, sys.executable, *args], env=env,
                              capture_output=True, text=True, cwd=ROOT, timeout=300)
        *out, last = done.stdout.strip().splitlines()
        rc, kib = map(int, last.split())
        return rc, kib, "\n".join(out) + done.stderr
    bare = peak_kib("-c", "import jax, taco_jax; assert jax.device_count() == 4")
    assert bare[0] == 0, bare[2]
    rc, kib, out = peak_kib("-m", "taco_jax.calibrate", "--sizes-mib", "4", "64", "256",
                            "--memory-gib", "2", "--iters", "1", "--repeats", "1",
                            "--batches", "1", "--cache", str(tmp_path / "cal.json"))
    assert rc == 0, out
    assert "4 MiB/device: lax.psum" in out and "64 MiB/device: skipped, does not fit" in out
    assert "256 MiB/device: skipped, does not fit" in out
    assert kib - bare[1] <= 2 * 2**20, (kib, bare[1], out)


def _meminfo_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("MemAvailable:"))


def test_memory_budget_without_device_statistics_is_a_share_of_host_memory(monkeypatch):
    """CPU devices give no statistics: the budget is HOST_SHARE of the host's available
    memory, for all devices together; that memory is /proc/meminfo's MemAvailable (read
    again here, a moment later: within 20%)."""
    assert jax.devices()[0].memory_stats() is None
    assert abs(calibrate._host_available() / _meminfo_available() - 1) < 0.2
    monkeypatch.setattr(calibrate, "_host_available", lambda: 10 << 30)
    limit, per_device, where = calibrate.memory_budget(jax.devices()[:2])
    assert limit == int(calibrate.HOST_SHARE * (10 << 30)) and not per_device
    assert where == f"{calibrate.HOST_SHARE:g} of the host's available memory (10.0 GiB)"


class _Device:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_memory_budget_with_device_statistics_is_the_least_free_memory(monkeypatch):
    """GPUs: per device, the smallest bytes_limit − bytes_in_use of any; a device without
    statistics (or without a limit) sends the budget back to the host's share."""
    monkeypatch.setattr(calibrate, "_host_available", lambda: 8 << 30)
    gib = 1 << 30
    devs = [_Device({"bytes_limit": 80 * gib, "bytes_in_use": 10 * gib}),
            _Device({"bytes_limit": 80 * gib, "bytes_in_use": 30 * gib}),
            _Device({"bytes_limit": 70 * gib})]
    assert calibrate.memory_budget(devs) == (50 * gib, True,
                                             "free device memory (device.memory_stats())")
    host = (int(calibrate.HOST_SHARE * 8 * gib), False)
    for odd in (None, {}, {"bytes_in_use": gib}):
        assert calibrate.memory_budget([*devs, _Device(odd)])[:2] == host, odd


def test_check_transport_accepts_the_codec_error_and_rejects_misdelivery():
    from jax import lax
    import taco_jax
    m = mesh2d()
    x = jax.device_put(jax.random.normal(jax.random.key(0), (2 * 4096,)),
                       NamedSharding(m, P("tp")))

    def sharded(fn):
        return jax.jit(jax.shard_map(fn, mesh=m, in_specs=P("tp"), out_specs=P()))
    ref = sharded(lambda v: lax.psum(v, "tp"))
    good = sharded(lambda v: taco_jax.psum(v, "tp", codec="taco", min_bytes=0))
    swapped = sharded(lambda v: jnp.roll(taco_jax.psum(v, "tp", codec="taco", min_bytes=0),
                                         2048))           # the two segments swapped
    taco = taco_jax.codecs.get("taco")
    ok, err, bound = calibrate.check_transport(good, ref, x, taco)
    assert ok and 1e-4 < err < bound < 0.2, (err, bound)
    ok, err, bound = calibrate.check_transport(swapped, ref, x, taco)
    assert not ok and err > 1, err
    none = taco_jax.codecs.get("none")
    assert calibrate.check_transport(ref, ref, x, none) == (True, 0.0, 0.0)
    assert not calibrate.check_transport(good, ref, x, none)[0]        # exact means exact


def test_a_transport_that_differs_from_lax_psum_is_never_cached(monkeypatch):
    """psum over the xla transport, made to deliver the segments to the wrong devices:
    rejected at the first size, timed at none, absent from every row and from the cache."""
    real = calibrate.psum

    def misdelivering(v, axis, **kw):
        return jnp.roll(real(v, axis, **kw), v.size // 2)
    monkeypatch.setattr(calibrate, "psum", misdelivering)
    lines, timed = [], []

    def timer(program, x, **kw):
        timed.append(program)
        return 10.0 * len(timed)
    cal = calibrate.calibrate_min_bytes(mesh2d(), "tp", sizes_mib=(1 / 64, 1 / 16), iters=1,
                                        timer=timer, log=lines.append)
    assert len(timed) == 2 * 2                     # prep and lax.psum per size, no taco
    assert all(set(r) == {"mib", "lax_us"} for r in cal.rows), cal.rows
    assert cal.min_bytes == calibrate.NEVER and cal.route(2**30) == "lax"
    assert len(cal.rejected) == 1 and "xla transport rejected at 0.015625 MiB" in cal.rejected[0]
    assert "not cached: xla transport rejected" in cal.table()
    assert any("differs from lax.psum" in line for line in lines), lines


def test_main_prints_each_size_and_what_a_cpu_calibration_means(tmp_path, capsys):
    cache = tmp_path / "cal.json"
    assert calibrate.main(["--sizes-mib", "0.015625", "0.0625", "--iters", "2",
                           "--repeats", "1", "--batches", "1", "--cache", str(cache)]) == 0
    out = capsys.readouterr().out
    assert "CPU backend's timings" in out and "this machine only" in out
    assert "fused transport: not timed here (platform 'cpu'" in out
    assert "[taco_jax.calibrate] 0.015625 MiB/device: lax.psum" in out
    assert "[taco_jax.calibrate] 0.0625 MiB/device: lax.psum" in out
    assert f"wrote {cache}" in out and cache.exists()
