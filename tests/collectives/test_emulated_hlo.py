"""Emulated tensor parallelism runs each device's work, no more: compiled under
jax.vmap(axis_name="tp"), the compressed ops and an emulated training step hold no gather
and no scatter that a device of a real mesh would not run. A device's offsets come from its
index on the axis; under vmap a dynamic slice, a dynamic update slice or a ppermute computed
per member is a gather or a scatter over every member, where on a mesh it is a copy or a
send. Compiled, not run: CPU, P = 8 members for the ops, TP 4 for the steps."""
import dataclasses
import re

import pytest

import jax
import jax.numpy as jnp

import taco_jax
from taco_jax import codecs
from taco_jax.collectives import fused
from taco_jax.kernels import fused as kernels

from model_cases import CFG, _tokens

P = 8
X = (8, 64)                   # a member's tensor: two taco blocks, one segment of each of P


def hlo_ops(text: str, name: str) -> int:
    """How many instructions of opcode `name` a compiled HLO module has."""
    return len(re.findall(rf"= \S+ {name}\(", text))


def where(text: str) -> list[str]:
    """The gathers and scatters of a compiled module, with the op that made each."""
    return [m.group(0)[:200] for m in re.finditer(r"= \S+ (gather|scatter)\(.*", text)]


def counts(text: str) -> tuple[int, int]:
    return hlo_ops(text, "gather"), hlo_ops(text, "scatter")


def compiled(member, shapes, in_axes, vma: bool) -> str:
    """The vmapped member function with its vjp (cotangent: the output), compiled."""
    args = [jax.ShapeDtypeStruct(((P,) if ax == 0 else ()) + s, jnp.float32)
            for s, ax in zip(shapes, in_axes)]
    f = jax.vmap(member, in_axes=in_axes, axis_name="tp")

    def step(*a):
        y, vjp = jax.vjp(f, *a)
        return y, vjp(y)
    with taco_jax.config(vmap_check_vma=vma):
        return jax.jit(step).lower(*args).compile().as_text()


def state(r):
    return taco_jax.FeedbackState(r)


RING = [(i, (i + 1) % P) for i in range(P)]
CHAIN = [(i, i + 1) for i in range(P - 1)]          # member 0 receives nothing
# name: (member fn (x, *rest; keyword args), shapes, in_axes, vmap_check_vma)
OPS = {
    "psum": (lambda x, **kw: taco_jax.psum(x, "tp", **kw), [X], (0,), False),
    "pvary vma": (lambda x, w, **kw: taco_jax.pvary(x, "tp", **kw) * w, [X, X], (None, 0),
                  True),
    "all_gather": (lambda x, **kw: taco_jax.all_gather(x, "tp", **kw), [X], (0,), False),
    "all_gather invarying tiled": (
        lambda x, **kw: taco_jax.all_gather(x, "tp", axis=1, tiled=True, to="invarying",
                                            **kw), [X], (0,), True),
    "psum_scatter tiled": (lambda x, **kw: taco_jax.psum_scatter(x, "tp", tiled=True, **kw),
                           [X], (0,), False),
    "ppermute ring": (lambda x, **kw: taco_jax.ppermute(x, "tp", RING, **kw), [X], (0,),
                      False),
    "ppermute chain": (lambda x, **kw: taco_jax.ppermute(x, "tp", CHAIN, **kw), [X], (0,),
                       False),
    "psum_with_feedback": (lambda x, r, **kw: taco_jax.psum_with_feedback(x, "tp", state(r),
                                                                          **kw),
                           [X, X], (0, 0), False),
    "pvary_with_feedback vma": (
        lambda x, w, r, **kw: taco_jax.pvary_with_feedback(x, "tp", state(r), **kw)[0] * w,
        [X, X, X], (None, 0, 0), True),
}
# lax's own all_gather(to="invarying") does not run under vmap (codec "none" takes it)
UNDER_LAX = {"all_gather invarying tiled"}


@pytest.mark.parametrize("codec", ["none", "taco"])
@pytest.mark.parametrize("op", list(OPS))
def test_emulated_op_indexes_statically(op, codec):
    """Each op, forward and backward, at P = 8 with min_bytes=0 (taco compresses, "none"
    takes lax's collective): no gather, no scatter; the codec has neither of its own."""
    if codec == "none" and op in UNDER_LAX:
        pytest.skip("lax.all_gather(to='invarying') does not run under jax.vmap")
    fn, shapes, in_axes, vma = OPS[op]
    text = compiled(lambda *a: fn(*a, codec=codec, min_bytes=0), shapes, in_axes, vma)
    assert counts(text) == (0, 0), where(text)
    assert hlo_ops(text, "parameter") > 0                   # the pattern sees instructions


def test_emulated_fused_loopback_hands_each_member_its_row(monkeypatch):
    """The fused transport's loopback (its kernel stood in for by a sum: the layout is
    what is checked): member d's row of the kernel's (P, …) result, statically."""
    monkeypatch.setitem(fused.LOOPBACK_KERNELS, kernels.two_shot_loopback,
                        lambda xs, codec: jnp.broadcast_to(xs.sum(0), xs.shape) * 1.0)
    monkeypatch.setitem(fused.LOOPBACK_KERNELS, kernels.one_shot_loopback,
                        lambda xs, codec: jnp.broadcast_to(xs.sum(0), xs.shape) * 1.0)
    taco = codecs.get("taco")
    text = compiled(lambda x: fused.loopback(x, "tp", taco, P, False), [X], (0,), False)
    assert counts(text) == (0, 0), where(text)


# The tiny GPT's step at TP 4, one layer; (gathers, scatters) a device runs too: the
# embedding's lookup and the cross-entropy's pick of the target logit, and their transposes
DEVICE = (2, 2)
STEPS = {
    # each member embeds its part of the sequence; all-gathers and reduce-scatters
    "gpt sequence parallel": dict(codec_fwd="taco", codec_bwd="taco", sequence_parallel=True),
    # the compressed psums (two-shot) and pvarys; TP 4 > 2 KV heads: each member slices
    # the KV head its query heads share
    "qwen taco": dict(arch="qwen", n_kv_head=2, codec_fwd="taco", codec_bwd="taco",
                      rope_theta=100.0),
}


@pytest.mark.parametrize("name", list(STEPS))
def test_emulated_training_step_indexes_statically(name):
    """The loss-and-gradient step of the tiny GPT (and the Qwen-style decoder) under
    emulated TP 4, compressed with min_bytes=0, compiled: a device's gathers and scatters
    only."""
    from models import parallel      # noqa: PLC0415 (the models are a checkout package)
    cfg = dataclasses.replace(CFG, n_layer=1, min_bytes=0, **STEPS[name])
    mesh = parallel.make_emulation_mesh(1)
    model = parallel.shard_gpt(cfg, mesh, emulate_tp=4)
    params = model.init(0)
    x, y = (parallel.put_batch(a, mesh) for a in _tokens(cfg))
    text = jax.jit(model.loss_and_grad_fn()).lower(params, x, y).compile().as_text()
    assert counts(text) == DEVICE, where(text)
