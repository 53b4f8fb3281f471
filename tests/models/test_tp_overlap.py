"""model.tp_overlap: sequence parallelism's all-gathers and reduce-scatters fused with the
matmuls beside them (taco_jax.all_gather_matmul before QKV and the MLP's up projection,
matmul_reduce_scatter after the attention projection and the MLP's down projection). Loss
and gradients are the unfused model's: to fp32 rounding with codec none, within the
codec's error with taco. The fused sites take the codecs and min_bytes the split ones do;
the option needs sequence parallelism."""
import dataclasses

import jax
import pytest

import taco_jax
from models import parallel
from model_cases import (CFG, _max_rel_err, _tokens, _within_codec_error, tp_sites_since,
                         traced_tp_sites)

# one block: each fused op is P steps of matmul and ppermute, unrolled, forward and backward
SP = dataclasses.replace(CFG, n_layer=1, sequence_parallel=True, min_bytes=0)
TACO = dataclasses.replace(SP, codec_fwd="taco", codec_bwd="taco")
FUSED = {"all_gather_matmul", "matmul_reduce_scatter", "all_gather"}  # + the LM head's gather


def _run(cfg):
    """(loss, gradients, the TP sites traced) of one step at TP 2."""
    mesh = parallel.make_mesh(1, 2)
    model = parallel.shard_gpt(cfg, mesh)
    x, y = (parallel.put_batch(a, mesh) for a in _tokens(cfg))
    before = dict(taco_jax.telemetry.sites())
    loss, grads = jax.jit(model.loss_and_grad_fn())(model.init(0), x, y)
    return float(loss), jax.device_get(grads), tp_sites_since(before)


@pytest.fixture(scope="module")
def split():
    """The unfused sequence-parallel model, codec none."""
    return _run(SP)


def test_overlap_equals_the_split_exactly(split):
    """Codec none: the fused ops' ring moves the values themselves and sums them in another
    order; the column- and row-parallel sites are the fused ops. (Emulated TP:
    tests/models/test_emulate_tp.py.)"""
    loss0, grads0, _ = split
    loss, grads, sites = _run(dataclasses.replace(SP, tp_overlap=True))
    assert abs(loss - loss0) <= 1e-5 * loss0, (loss, loss0)
    assert _max_rel_err(grads, grads0) < 1e-4
    assert {op for op, *_ in sites} == FUSED, sites


def test_compressed_overlap_is_within_the_codecs_error(split):
    """taco both ways: each element is quantized once, as by the split collectives, but in
    other blocks (a chunk of x @ w rather than a segment of the flattened sum), so loss and
    gradients agree within the codec's error: a few times what compression itself changes.
    Measured at TP 2: gradients 3.7% apart (max relative), compression 4.5% from exact."""
    fused = _run(dataclasses.replace(TACO, tp_overlap=True))
    unfused = _run(TACO)
    _within_codec_error(fused[:2], unfused[:2], split[:2])
    assert _max_rel_err(fused[1], split[1]) > 1e-3          # compressed, really
    assert fused[2] == {(op, "taco", True) for op in FUSED}, fused[2]


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
