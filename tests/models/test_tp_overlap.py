"""model.tp_overlap: sequence parallelism's all-gathers and reduce-scatters fused with the
matmuls beside them (taco_jax.all_gather_matmul before QKV and the MLP's up projection,
matmul_reduce_scatter after the attention projection and the MLP's down projection). Loss
and gradients are the unfused model's: bit for bit with codec none at TP 2, within one
quantization's error with taco. The fused sites take the codecs and min_bytes the split
ones do; the option needs sequence parallelism."""
import collections
import contextlib
import dataclasses

import jax
import numpy as np
import pytest

import taco_jax
from models import parallel
from taco_jax.collectives import matmul as matmul_lib
from model_cases import BATCH, CFG, _max_rel_err, _rel, _tokens, traced_tp_sites

# one block: each fused op is P steps of matmul and ppermute, unrolled, forward and backward
SP = dataclasses.replace(CFG, n_layer=1, sequence_parallel=True, min_bytes=0)
TACO = dataclasses.replace(SP, codec_fwd="taco", codec_bwd="taco")
FUSED = {"all_gather_matmul", "matmul_reduce_scatter", "all_gather"}  # + the LM head's gather
# the "tp" calls of one step of one block: a column- and a row-parallel site in each of its
# two sub-layers, and the LM head's all-gather, which stays a separate op
SPLIT_CALLS = {"all_gather": 3, "psum_scatter": 2}
FUSED_CALLS = {"all_gather_matmul": 2, "matmul_reduce_scatter": 2, "all_gather": 1}


def _run(cfg, collect=False, tp=2, emulate=False):
    """(loss, gradients, {(op, codec, compressed): calls} of the "tp" sites traced, the
    telemetry records of the collectives' errors where `collect`) of one step at TP `tp`
    (on as many CPU devices, or emulated on one)."""
    if emulate:
        mesh = parallel.make_emulation_mesh(1)
        model = parallel.shard_gpt(cfg, mesh, emulate_tp=tp)
    else:
        mesh = parallel.make_mesh(1, tp)
        model = parallel.shard_gpt(cfg, mesh)
    x, y = (parallel.put_batch(a, mesh) for a in _tokens(cfg))
    step = jax.jit(model.loss_and_grad_fn())
    with taco_jax.telemetry.collect() if collect else contextlib.nullcontext() as log:
        (loss, grads), found = taco_jax.telemetry.traced_sites(step, model.init(0), x, y)
        jax.block_until_ready(grads)
        jax.effects_barrier()
    calls = collections.Counter()
    for site, n in found:
        if site.axes == ("tp",):
            calls[site.op, site.codec, site.compressed] += n
    return float(loss), jax.device_get(grads), calls, log.records if collect else None


def _calls(calls, codec):
    """{(op, codec, compressed): n}: with codec none the split collectives are lax's and the
    fused ops run their steps with the values on the wire (a site compressed "in steps")."""
    steps = ("all_gather_matmul", "matmul_reduce_scatter")
    return {(op, codec, codec != "none" or op in steps): n for op, n in calls.items()}


@pytest.fixture(scope="module")
def split():
    """The unfused sequence-parallel model, codec none."""
    return _run(SP)


def test_overlap_equals_the_split_exactly(split):
    """Codec none at TP 2, bit for bit: the fused ops multiply the same rows of x by the
    same flattened kernels as the split sub-layer's matmuls, and each device adds the two
    devices' partial sums, which commute. (At TP 4 the last bits differ: the ring adds the
    P − 1 peers' chunks before its own, lax's reduce-scatter in device order.) Every
    sub-layer's all-gather and reduce-scatter is fused: the LM head's all-gather is the one
    left. (Emulated TP: tests/models/test_emulate_tp.py.)"""
    loss0, grads0, calls0, _ = split
    loss, grads, calls, _ = _run(dataclasses.replace(SP, tp_overlap=True))
    assert loss == loss0, (loss, loss0)
    jax.tree.map(np.testing.assert_array_equal, grads, grads0)
    assert calls0 == _calls(SPLIT_CALLS, "none"), calls0
    assert calls == _calls(FUSED_CALLS, "none"), calls


def test_compressed_overlap_is_within_one_quantizations_error(split):
    """taco both ways: each element is quantized once, as by the split collectives, but in
    other blocks (a chunk of x @ w rather than a segment of the flattened sum): each fused
    op's error against the exact collective (telemetry's record) is the split op's, and so
    is the gradients' error against the exact model. A second quantization of the summed
    chunks raises matmul_reduce_scatter's 1.8x. Measured at TP 2: all_gather_matmul 0.99x
    all_gather's, matmul_reduce_scatter 0.99x psum_scatter's, gradients 1.00x (‖·‖
    relative, 2.1% from exact), loss 1.4x (one number: 5.4e-4 against 3.8e-4)."""
    exact = split
    fused = _run(dataclasses.replace(TACO, tp_overlap=True), collect=True)
    unfused = _run(TACO, collect=True)

    def error(run, op):
        return np.mean([r["rel_error"] for r in run[3] if r["op"] == op])
    for ours, theirs in (("all_gather_matmul", "all_gather"),
                         ("matmul_reduce_scatter", "psum_scatter")):
        assert error(fused, ours) <= 1.1 * error(unfused, theirs), (
            ours, error(fused, ours), error(unfused, theirs))
    assert _rel(fused[1], exact[1]) <= 1.1 * _rel(unfused[1], exact[1]), (
        _rel(fused[1], exact[1]), _rel(unfused[1], exact[1]))
    assert abs(fused[0] - exact[0]) <= 2 * abs(unfused[0] - exact[0]), (fused[0], unfused[0],
                                                                        exact[0])
    assert _max_rel_err(fused[1], exact[1]) > 1e-3          # compressed, really
    assert fused[2] == _calls(FUSED_CALLS, "taco"), fused[2]


def test_compressed_overlap_encodes_each_element_once(monkeypatch):
    """The quantizations of one step at TP 4, counted (abstract trace: nothing compiles):
    each fused op encodes what it sends once and forwards the codes unchanged, never a
    decoded value again. A sub-layer's all_gather_matmul encodes its x in the forward pass
    and again in the backward, which re-makes the forward's codes (the same bytes) to
    gather x for dw; its backward's matmul_reduce_scatter the P − 1 chunks of dx it sends;
    matmul_reduce_scatter the P − 1 chunks of its output it sends (its own chunk never),
    its backward's all_gather_matmul the cotangent's shard once. Every one is a
    (B, T/P, d) shard."""
    p, encoded = 4, collections.Counter()

    def counted(v, codec):
        if not codec.is_identity:
            encoded[v.shape] += 1
        return encode(v, codec)
    encode = matmul_lib._encode
    monkeypatch.setattr(matmul_lib, "_encode", counted)
    assert traced_tp_sites(dataclasses.replace(TACO, tp_overlap=True), tp=p) == {
        (op, "taco", True) for op in FUSED}
    per_sublayer = (1 + 1 + (p - 1)) + ((p - 1) + 1)    # all_gather_matmul, m._r._scatter
    shard = (BATCH, SP.seq_len // p, SP.d_model)
    assert encoded == {shard: 2 * per_sublayer}, encoded
def test_fused_sites_take_the_split_ones_codecs():
    """codec_bwd at the all-gather (the column-parallel input), codec_fwd at the
    reduce-scatter, each left None: the recipe's; min_bytes as the split sites' (abstract
    trace: nothing compiles)."""
    sites = traced_tp_sites
    default = dataclasses.replace(SP, codec_fwd=None, codec_bwd=None, min_bytes=None,
                                  tp_overlap=True)
    with taco_jax.config(codec="fp8", min_bytes=1 << 30):        # above every site here
        assert sites(default) == {(op, "fp8", False) for op in FUSED}
        assert sites(dataclasses.replace(default, codec_bwd="taco", min_bytes=0)) == {
            ("all_gather_matmul", "taco", True), ("matmul_reduce_scatter", "fp8", True),
            ("all_gather", "taco", True)}


def test_tp_overlap_needs_sequence_parallelism():
    with pytest.raises(ValueError, match=r"model.tp_overlap=True needs "
                                         r"model.sequence_parallel=True"):
        dataclasses.replace(CFG, tp_overlap=True).validate(tp=2)


def test_overlap_at_tp4_emulated_with_echo4(split):
    """TP 4 emulated on one device (jax.vmap; the same program as 4 CPU devices to 1e-7,
    measured), echo4 (4-bit codes) both ways: the step runs, its loss is finite, and loss
    and gradients are within echo4's error of the exact step (the TP 2 split step with codec
    none: the same to fp32 rounding at any TP), as the unfused step's are: measured
    gradients 0.173 from exact (unfused on 4 devices 0.172), loss 1.6e-4 relative (2.1e-4).
    One compile: the unfused step's error is the measured figure, not run here."""
    exact = split
    cfg = dataclasses.replace(SP, codec_fwd="echo4", codec_bwd="echo4", tp_overlap=True)
    loss, grads, calls, _ = _run(cfg, tp=4, emulate=True)
    assert np.isfinite(loss)
    assert abs(loss - exact[0]) <= 5e-4 * exact[0], (loss, exact[0])
    assert 0.05 < _rel(grads, exact[1]) < 0.2, _rel(grads, exact[1])
    assert calls == _calls(FUSED_CALLS, "echo4"), calls


def test_tp_overlap_rejects_error_feedback():
    """model.feedback's state is threaded through the all-reduce sites of plain TP; with
    sequence parallelism (so with tp_overlap) there are none: the option is refused."""
    cfg = dataclasses.replace(CFG, sequence_parallel=True, tp_overlap=True, feedback=True,
                              codec_fwd="echo4", codec_bwd="echo4")
    with pytest.raises(ValueError, match=r"model.feedback=True is not supported with "
                                         r"model.sequence_parallel=True"):
        cfg.validate(tp=4)
