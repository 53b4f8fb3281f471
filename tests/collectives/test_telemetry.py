"""telemetry: what the sites count (backward halves, loop bodies) and ppermute's error
records. CPU, 4 simulated devices; the site tests only trace."""
import logging

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

import taco_jax
from taco_jax import codecs, telemetry

CHAIN = [(0, 1), (1, 2), (2, 3)]


def mesh4():
    return jax.make_mesh((4,), ("tp",), devices=jax.devices()[:4])


def on_mesh(fn, vma=True):
    """fn on each device's row of a (4, ...) array, as a shard_map."""
    return jax.shard_map(lambda b: fn(b[0])[None], mesh=mesh4(), in_specs=P("tp"),
                         out_specs=P("tp"), check_vma=vma)


def sharded(x):
    return jax.device_put(jnp.asarray(x), jax.NamedSharding(mesh4(), P("tp")))


def new_sites(fn, x):
    """{site: calls} that tracing fn(x) adds (nothing compiles)."""
    with jax.set_mesh(mesh4()):
        _, traced = telemetry.traced_sites(jax.make_jaxpr(fn), jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=jax.NamedSharding(mesh4(), P("tp"))))
    return dict(traced)


def site(op, shape, codec="tah4", compressed=True, p=4):
    return telemetry.Site(op, shape, "float32", ("tp",), codec, compressed,
                          "" if compressed else "codec 'none'", p, "xla" if compressed else "")


# -- backward halves -------------------------------------------------------------------------
@pytest.mark.parametrize("codec", ["tah4", "taco", "none"])
def test_wire_bytes_backward_is_what_each_transpose_sends(codec):
    """ppermute's transpose is the reverse send; all_gather's a psum_scatter of the
    gathered cotangent, psum_scatter's an all_gather of its part: backward=True adds
    exactly the transpose's own forward bytes."""
    c, on = codecs.get(codec), codec != "none"
    n = 3 * 1000                                               # not whole blocks
    send = site("ppermute", (3, 1000), codec, on)
    fwd = c.wire_bytes(n) if on else 4 * n
    assert telemetry.wire_bytes(send) == fwd
    assert telemetry.wire_bytes(send, backward=True) == 2 * fwd
    gather, scatter = site("all_gather", (3, 1000), codec, on), site(
        "psum_scatter", (4 * 3, 1000), codec, on)                  # gathers / scatters n
    for fwd_site, transpose in ((gather, scatter), (scatter, gather)):
        assert telemetry.wire_bytes(fwd_site, backward=True) == (
            telemetry.wire_bytes(fwd_site) + telemetry.wire_bytes(transpose))
    for op in ("psum", "pvary"):                       # one all-reduce either way
        s = site(op, (3, 1000), codec, on)
        assert telemetry.wire_bytes(s, backward=True) == telemetry.wire_bytes(s) > 0


@pytest.mark.parametrize("codec", ["taco", "none"])
def test_psum_under_check_vma_false_counts_its_transpose(codec):
    """Under check_vma=False JAX transposes psum to psum and pvary is the identity (no
    site): the backward all-reduce is psum's, and wire_bytes(backward=True) counts it;
    under check_vma=True the site sends once (its transpose broadcasts)."""
    x = jnp.zeros((4, 3, 1024), jnp.float32)

    def block(v):          # g then f: psum's output is invariant, pvary's input must be
        return taco_jax.pvary(taco_jax.psum(v, "tp", codec=codec, min_bytes=0), "tp",
                              codec=codec, min_bytes=0)

    for vma in (False, True):
        found = new_sites(on_mesh(block, vma), x)
        by_op = {s.op: s for s in found}
        assert ("pvary" in by_op) is vma, found
        s = by_op["psum"]
        assert s.vma is vma and s.compressed is (codec != "none")
        assert telemetry.wire_bytes(s, backward=True) == (1 if vma else 2) * (
            telemetry.wire_bytes(s)) > 0


# -- loop bodies -----------------------------------------------------------------------------
def scanned(length, declare=None, codec="taco"):
    def body(c, _):
        return taco_jax.psum(c, "tp", codec=codec, min_bytes=0), None

    def fn(v):
        if declare is None:
            return lax.scan(body, v, None, length=length)[0]
        with telemetry.repeated(declare):
            return lax.scan(body, v, None, length=length)[0]
    return on_mesh(fn, vma=False)


def checked(fn, x):
    """({site: calls} that tracing fn(x) adds, check_loops' warnings)."""
    with jax.set_mesh(mesh4()):
        warned, traced = telemetry.traced_sites(telemetry.check_loops, fn, jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=jax.NamedSharding(mesh4(), P("tp"))))
    return dict(traced), warned


def test_site_in_a_scan_counts_once_per_trace_and_check_loops_warns(caplog):
    x = jnp.ones((4, 512))
    with caplog.at_level(logging.WARNING, logger="taco_jax"):
        counts = new_sites(scanned(5, codec="echo4"), x)
    assert list(counts.values()) == [1]
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]   # tracing: silent
    with caplog.at_level(logging.WARNING, logger="taco_jax"):
        counts, warned = checked(scanned(5, codec="echo4"), x)
    assert list(counts.values()) == [1]
    assert len(warned) == 1 and "lax.scan(length=5) body" in warned[0], warned
    assert "runs 5 times per call" in warned[0] and "telemetry.repeated" in warned[0]
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert logged == warned


@pytest.mark.parametrize("codec", ["taco", "none"])
def test_check_loops_is_silent_for_a_declared_loop(codec):
    """Compressed or plain (the body's psum is lax's own), a declared scan is not warned
    about; the plain route's scan is still found, as the undeclared case shows."""
    x = jnp.ones((4, 512))
    counts, warned = checked(scanned(5, declare=5, codec=codec), x)
    assert list(counts.values()) == [5] and warned == []
    assert len(checked(scanned(3, codec=codec), x)[1]) == 1


def test_repeated_declares_the_loop_and_nests(caplog):
    x = jnp.ones((4, 512))
    with caplog.at_level(logging.WARNING, logger="taco_jax"):
        assert list(new_sites(scanned(5, declare=5, codec="int4-sym"), x).values()) == [5]

        def nested(v):           # 3 outer iterations of a declared 5-step scan
            with telemetry.repeated(3):
                return lax.fori_loop(0, 3, lambda i, c: scanned_body(c), v)

        def scanned_body(c):
            with telemetry.repeated(5):
                return lax.scan(lambda a, _: (taco_jax.psum(a, "tp", codec="int4-sym",
                                                            min_bytes=0), None),
                                c, None, length=5)[0]
        assert list(new_sites(on_mesh(nested, vma=False), x).values()) == [15]
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    with pytest.raises(ValueError, match="times=0"):
        with telemetry.repeated(0):
            pass


def test_an_undifferentiated_block_counts_forward_sends_only():
    """repeated(n, differentiated=False) (a schedule that runs its backward elsewhere):
    pvary sends nothing there, ppermute's calls are marked as running no transpose, psum
    counts as ever; train's step bytes then leave the marked transposes out."""
    from train.loop import step_wire_bytes
    x = jnp.ones((4, 512))

    def fn(v):
        with telemetry.repeated(3, differentiated=False):
            v = taco_jax.pvary(v, "tp", codec="int4-sym", min_bytes=0)
            v = taco_jax.ppermute(v, "tp", CHAIN, codec="int4-sym", min_bytes=0)
            return taco_jax.psum(v, "tp", codec="int4-sym", min_bytes=0)
    got = new_sites(on_mesh(fn, vma=False), x)
    assert sorted((s.op, n) for s, n in got.items()) == [("ppermute", 3), ("psum", 3)]
    send = next(s for s in got if s.op == "ppermute")
    assert telemetry.undifferentiated(send) == 3
    wire = {s.op: telemetry.wire_bytes(s) for s in got}
    assert step_wire_bytes([(send, 3)]) == 3 * wire["ppermute"]      # not doubled
    assert step_wire_bytes([(send, 5)]) == 5 * wire["ppermute"] + 2 * wire["ppermute"]


def test_a_caller_that_counts_the_iterations_itself_is_not_warned(caplog):
    """The caller notes the body's sites the other 4 times (as the GPT's pipeline counts
    its ticks): counted 5 times, no warning."""
    def body(c, _):
        before = dict(telemetry.sites())
        y = taco_jax.psum(c, "tp", codec="taco-1scale", min_bytes=0)
        for s, n in telemetry.sites():
            for _ in range(4 * (n - before.get(s, 0))):
                telemetry.note_site(s.op, s.shape, s.dtype, s.axes, s.codec, None, s.p,
                                    s.transport, s.vma)
        return y, None

    fn = on_mesh(lambda v: lax.scan(body, v, None, length=5)[0], vma=False)
    with caplog.at_level(logging.WARNING, logger="taco_jax"):
        counts, warned = checked(fn, jnp.ones((4, 512)))
    assert list(counts.values()) == [5] and warned == []
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_while_loop_body_warns_of_an_unknown_count():
    def fn(v):
        return lax.while_loop(lambda c: c[0] < 3.0,
                              lambda c: taco_jax.psum(c, "tp", codec="block-fp8",
                                                      min_bytes=0) * 0 + c + 1.0, v)
    _, warned = checked(on_mesh(fn, vma=False), jnp.zeros((4, 256)))
    assert len(warned) == 1 and "lax.while_loop body" in warned[0], warned
    assert "an unknown number of times" in warned[0]


def test_check_loops_sees_nested_scans():
    """3 iterations of a 5-step scan: the sites must count multiples of 15."""
    def fn(v, declare):
        def inner(c):
            return lax.scan(lambda a, _: (taco_jax.psum(a, "tp", codec="int4-sym",
                                                        min_bytes=0), None), c, None,
                            length=5)[0]
        if declare:
            with telemetry.repeated(15):
                return lax.fori_loop(0, 3, lambda i, c: inner(c), v)
        with telemetry.repeated(5):     # the inner loop only
            return lax.fori_loop(0, 3, lambda i, c: inner(c), v)
    x = jnp.ones((4, 512))
    assert checked(on_mesh(lambda v: fn(v, True), vma=False), x)[1] == []
    warned = checked(on_mesh(lambda v: fn(v, False), vma=False), x)[1]
    assert len(warned) == 1 and "lax.scan(length=3) > lax.scan(length=5)" in warned[0], warned


def test_traced_sites_counts_only_this_call():
    """Sites traced before the call do not count; the call's result and keyword arguments
    pass through; a jitted function traced before records none."""
    x = sharded(np.ones((4, 8, 64), np.float32))
    f = jax.jit(on_mesh(lambda v: taco_jax.psum(v, "tp", codec="int4-sym", min_bytes=0) * 2,
                        vma=False))
    with jax.set_mesh(mesh4()):
        first, traced = telemetry.traced_sites(lambda a, *, k: f(a) + k, x, k=1.0)
        again, repeat = telemetry.traced_sites(f, x)
    assert [(s.op, s.shape, s.codec, n) for s, n in traced] == [("psum", (8, 64), "int4-sym",
                                                                 1)]
    assert repeat == [] and np.isfinite(np.asarray(first)).all()
    report = telemetry.site_report(traced)                    # these sites only
    assert report.startswith("   1 × psum") and "int4-sym" in report and "\n" not in report
    assert telemetry.site_report([]) == "no taco_jax collective traced"
    np.testing.assert_array_equal(np.asarray(first), np.asarray(again) + 1.0)


# -- ppermute's error records ----------------------------------------------------------------
def test_collect_records_ppermute_errors_forward_and_backward():
    """One record per compressed send and per executed iteration (a scan of 2 sends of
    256 values): forward, then the reverse sends of the cotangents, each against the exact
    send over all receivers."""
    x = np.random.default_rng(0).standard_normal((4, 2, 256)).astype(np.float32)
    w = np.random.default_rng(1).standard_normal((2, 256)).astype(np.float32)
    send = lambda v: taco_jax.ppermute(v, "tp", CHAIN, codec="tah4", min_bytes=0)

    def loss(v):
        with telemetry.repeated(2):
            ys = lax.scan(lambda c, row: (c, send(row)), 0.0, v)[1]
        return jnp.sum(ys * w)

    with jax.set_mesh(mesh4()), telemetry.collect() as log:
        g = jax.jit(on_mesh(lambda v: jax.grad(loss)(v)))(sharded(x))
        jax.block_until_ready(g)
        jax.effects_barrier()
    recs = log.records
    assert len(recs) == 4 and {r["op"] for r in recs} == {"ppermute"}
    assert all(r["wire_bytes"] == codecs.get("tah4").wire_bytes(256) and
               r["bf16_bytes"] == 2 * 256 and r["nonfinite"] == 0 for r in recs)
    assert all(0.02 < r["rel_error"] < 0.2 for r in recs), recs
    # the first record: row 0's send, over receivers 1..3
    with jax.set_mesh(mesh4()):
        y = np.asarray(jax.jit(on_mesh(send))(sharded(x[:, 0])))
    ref = np.zeros_like(y)
    ref[1:] = x[:3, 0]
    assert recs[0]["rel_error"] == pytest.approx(
        np.linalg.norm(y - ref) / np.linalg.norm(ref), rel=1e-4)


def test_collect_records_gather_and_scatter_errors_forward_and_backward():
    """all_gather and psum_scatter record their errors like a send: the gradient of a
    gather runs the compressed psum_scatter, and each record matches the exact f32
    collective over all devices."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 3, 256)).astype(np.float32)
    w = rng.standard_normal((4, 3, 256)).astype(np.float32)
    gather = lambda v: taco_jax.all_gather(v, "tp", codec="taco", min_bytes=0)

    def loss(v):
        return jnp.sum(gather(v) * w)

    with jax.set_mesh(mesh4()), telemetry.collect() as log:
        g = jax.jit(on_mesh(lambda v: jax.grad(loss)(v)))(sharded(x))
        jax.block_until_ready(g)
        jax.effects_barrier()
    recs = {r["op"]: r for r in log.records}
    assert len(log.records) == 2 and set(recs) == {"all_gather", "psum_scatter"}
    row = codecs.get("taco").row_bytes
    assert recs["all_gather"]["wire_bytes"] == 3 * 3 * row            # 3 blocks to 3 peers
    assert recs["psum_scatter"]["wire_bytes"] == 3 * 3 * row          # 3 segments of 3 blocks
    assert recs["all_gather"]["bf16_bytes"] == 2 * 3 * 3 * 256
    assert all(0.005 < r["rel_error"] < 0.1 and r["nonfinite"] == 0 for r in log.records)
    with jax.set_mesh(mesh4()):
        y = np.asarray(jax.jit(on_mesh(gather))(sharded(x)))        # (4, 4, 3, 256)
    ref = np.broadcast_to(x[None], y.shape)
    assert recs["all_gather"]["rel_error"] == pytest.approx(
        np.linalg.norm(y - ref) / np.linalg.norm(ref), rel=1e-4)


def test_capture_hands_over_what_ppermute_sends_and_gets_back():
    """capture(all_devices=True): "fwd" each device's sent tensor, "bwd" the cotangent of
    what it received (what its reverse send carries), whatever the route (codec none)."""
    x = np.random.default_rng(2).standard_normal((4, 256)).astype(np.float32)
    w = np.random.default_rng(3).standard_normal((4, 256)).astype(np.float32)
    send = lambda v: taco_jax.ppermute(v, "tp", CHAIN, codec="none")
    with jax.set_mesh(mesh4()), telemetry.capture(all_devices=True) as cap:
        fn = on_mesh(lambda v: jax.grad(lambda u: jnp.sum(send(u) * w[0]))(v))
        jax.block_until_ready(jax.jit(fn)(sharded(x)))
        jax.effects_barrier()
    got = {(r["kind"], r["device"]): r["value"] for r in cap.records if r["op"] == "ppermute"}
    assert len(got) == 8
    for d in range(4):
        np.testing.assert_array_equal(got["fwd", d], x[d])
        np.testing.assert_array_equal(got["bwd", d], w[0])   # every device's cotangent
