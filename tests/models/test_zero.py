"""ZeRO-1 over "data" (parallel.zero=1, models/zero.py): with every codec none it trains as
the replicated optimizer does (losses and parameters, fp32), on data x pipe x tp = 2x1x2
and 4x2x1; the optimizer state per device is 1/data of it; with 4-bit weight differences
(recipe.codec_wd=int4-sym) the run learns, the replicas stay identical across data ranks
and lag the master by one quantized difference; a run resumes bit for bit; bad settings and
a checkpoint of the other layout fail naming the values."""
import functools
import math

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

import taco_jax
import train
from models import parallel
from train import config as config_lib
from train.checkpoint import Checkpointer

from codec_bounds import FACTOR, assert_blockwise_close, block_norms, roundtrip_error
from run_cases import CORPUS, cache  # noqa: F401 (cache: the shared corpus fixture)

# optim.eps=1e-3: Adam's first steps move every parameter by about ±lr whatever the size of
# its gradient, so gradients near zero that differ in the last bits between meshes would
# move their parameters apart by up to 2·lr; with this eps such gradients move them in
# proportion, and runs on two meshes can be compared at fp32 tolerance (one compile fewer)
SMALL = ["model.vocab_size=512", "model.seq_len=32", "model.n_layer=2", "model.d_model=32",
         "train.batch_size=8", "codec=none", "recipe.min_bytes=0", "optim.warmup_steps=1",
         "optim.eps=1e-3", "optim.grad_clip=0.5", "train.steps=8", "train.progress=false"]
STEPS = 3
QUANTIZED = ("4x1x2", "parallel.zero=1", "recipe.codec_wd=int4-sym")


def _config(mesh: str, *extra: str) -> config_lib.Config:
    data, pipe, tp = map(int, mesh.split("x"))
    return config_lib.load_config("tiny", [*SMALL, f"parallel.data={data}",
                                           f"parallel.pipe={pipe}", f"parallel.tp={tp}", *extra])


# XLA:CPU's backend optimizations take most of the compile time of these small steps (~3x);
# every program compared here is compiled alike
FAST = {"xla_backend_optimization_level": 0}


@functools.cache
def _program(mesh: str, *extra: str) -> train.loop.Program:
    cfg = _config(mesh, *extra)
    return train.build(cfg, train.loop.build_mesh(cfg))


@functools.cache
def _step(mesh: str, *extra: str):
    """The program's train step, compiled (state donated, as prog.step)."""
    prog = _program(mesh, *extra)
    x = jax.ShapeDtypeStruct((8, 32), np.int32, sharding=NamedSharding(
        prog.mesh, parallel.BATCH_SPEC))
    return prog.step.lower(prog.abstract_state(), x, x).compile(compiler_options=FAST)


def _batch(prog):
    t = np.random.default_rng(0).integers(0, 512, (8, 33)).astype(np.int32)
    return prog.put_batch(t[:, :-1]), prog.put_batch(t[:, 1:])


@functools.cache
def _trained(mesh: str, *extra: str):
    """STEPS steps on one fixed batch -> (losses, grad norms, final params on the host in
    the unpipelined layout)."""
    prog, step = _program(mesh, *extra), _step(mesh, *extra)
    state, batch, losses, norms = prog.init(0), _batch(prog), [], []
    for _ in range(STEPS):
        state, m = step(state, *batch)
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
    params = jax.device_get(state["params"])
    return losses, norms, parallel.unstack_blocks(params) if prog.model.pipe > 1 else params


def _opt_bytes(prog) -> dict:
    """Bytes per device of the optimizer state: {"moments": optax's, "master": ...}."""
    def per_device(tree):
        return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
                   for a in jax.tree.leaves(tree))
    opt = prog.abstract_state()["opt_state"]
    if prog.zero is None:
        return {"moments": per_device(opt), "master": 0}
    return {"moments": per_device(opt["tx"]), "master": per_device(opt.get("master", {}))}


@pytest.mark.parametrize("mesh,rtol,atol", [("2x1x2", 1e-6, 1e-8), ("4x2x1", 1e-5, 1e-7)])
def test_zero1_trains_as_the_replicated_optimizer(mesh, rtol, atol):
    """3 AdamW steps (the global-norm clip at 0.5 active: the norm is ~1; weight decay on
    matrices and embeddings only, LayerNorm scales start at 1) with every codec none: the
    losses and parameters of the replicated optimizer on 2x1x2, at fp32 tolerance (the clip
    norm sums in another order; 4x2x1 computes its gradients in another order too)."""
    prog = _program(mesh, "parallel.zero=1")
    assert prog.zero is not None and not prog.zero.master
    assert {b.decay for b in prog.zero.buckets} == {True, False}
    assert all(b.padded % (prog.model.data * 256) == 0 and b.padded >= b.size
               for b in prog.zero.buckets)
    losses0, norms0, params0 = _trained("2x1x2")
    losses, norms, params = _trained(mesh, "parallel.zero=1")
    np.testing.assert_allclose(losses, losses0, rtol=rtol)
    np.testing.assert_allclose(norms, norms0, rtol=10 * rtol)
    assert losses[-1] < losses[0] and min(norms) > 0.5      # every step clipped
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=rtol, atol=atol),
                 params, params0)


# measured (the model above, Adam's moments per device, ZeRO-1 vs replicated): 2x1x2
# 155,656 vs 308,488 B (0.505), 4x2x1 98,312 vs 372,488 (0.264), 8x1x1 63,496 vs 474,120
# (0.134); the int4-sym master adds 77,824 / 49,152 / 31,744
@pytest.mark.parametrize("mesh", ["2x1x2", "4x2x1", "8x1x1"])
def test_optimizer_state_per_device_is_one_over_data(mesh):
    """Adam's moments per device shrink to 1/data (plus the padding to whole codec blocks
    per rank); a lossy recipe.codec_wd adds the fp32 master, 1/data of the parameters."""
    data = int(mesh.split("x")[0])
    full = _opt_bytes(_program(mesh))
    zero = _opt_bytes(_program(mesh, "parallel.zero=1"))
    assert zero["master"] == 0
    assert 1 / data < zero["moments"] / full["moments"] < 1.05 / data + 0.01
    master = _opt_bytes(_program(mesh, "parallel.zero=1", "recipe.codec_wd=int4-sym"))
    assert master["moments"] == zero["moments"]
    assert master["master"] == pytest.approx(zero["moments"] / 2, rel=1e-3)


def test_quantized_weight_differences():
    """int4-sym weight differences on 4x1x2: the loss falls; every data rank holds the
    same replica, bit for bit; and each step's replica is the previous one plus the
    decoded difference to the new master (so its error is one quantization, never a sum of
    them), while the exact master moves on in the optimizer state."""
    prog, step = _program(*QUANTIZED), _step(*QUANTIZED)
    assert prog.zero.master and prog.optimizer_layout == {"zero": 1, "data": 4, "master": True}
    roundtrip = jax.jit(taco_jax.codecs.get("int4-sym").roundtrip)
    state, batch = prog.init(0), _batch(prog)
    own_of = jax.jit(prog.zero.shards_fn()).lower(state["params"]).compile(FAST)

    def flat(shards):   # every bucket's shards, one vector: the blocks of 128 stay whole
        return np.concatenate([np.asarray(shards[b.name]).reshape(-1)
                               for b in prog.zero.buckets])
    losses, errors = [], []
    for _ in range(5):
        before = flat(jax.device_get(own_of(state["params"])))
        state, m = step(state, *batch)
        losses.append(float(m["loss"]))
        errors.append(float(m["wd_rel_error"]))
        master = flat(jax.device_get(state["opt_state"]["master"]))
        after = flat(jax.device_get(own_of(state["params"])))
        d = master - before
        rt = np.asarray(roundtrip(d))
        # the test's round trip is another program, where a value on a rounding boundary
        # may go the other way: the step moved the replica by it within the codec's error
        # per block of 128...
        tol = FACTOR * roundtrip_error("int4-sym", d, 0)
        assert_blockwise_close(after - before, rt, d, tol, 128, lead=0,
                               what="replica step vs the decoded difference")
        # ...and the replica is off the master by this one quantization, never a sum of them
        # (fp32 rounding of the two additions aside)
        slack = 4 * np.finfo(np.float32).eps * (np.abs(before) + np.abs(master))
        assert np.all(block_norms(after - master, 128, 0)
                      <= 1.5 * block_norms(rt - d, 128, 0) + block_norms(slack, 128, 0))
    assert losses[-1] < losses[0] - 0.05, losses
    assert 0 < max(errors[1:]) < 1e-2, errors           # step 1: lr 0, nothing moved
    assert np.any(after != master)                      # the replica is not the master
    for leaf in jax.tree.leaves(state["params"]):
        by_index: dict = {}
        for shard in leaf.addressable_shards:
            by_index.setdefault(str(shard.index), []).append(np.asarray(shard.data))
        assert all(len(same) % 4 == 0 for same in by_index.values())   # 4 data ranks
        for same in by_index.values():
            for other in same[1:]:
                np.testing.assert_array_equal(other, same[0])


def test_zero1_resumes_bit_exactly(tmp_path):
    """4 steps with int4-sym weight differences, a checkpoint after 2 (master shards and
    sharded moments included); restored, steps 3 and 4 repeat bit for bit."""
    prog, step = _program(*QUANTIZED), _step(*QUANTIZED)
    batch = _batch(prog)
    state = prog.init(0)
    ck = Checkpointer(tmp_path / "ckpt", async_save=False)
    for _ in (1, 2):
        state, _ = step(state, *batch)
    ck.save(2, state, {"data_pos": 2, "name": "tiny", "optimizer": prog.optimizer_layout})
    rows = []
    for _ in (3, 4):
        state, m = step(state, *batch)
        rows.append(jax.device_get(m))
    final = jax.device_get(state)
    restored, _, at = ck.restore_latest(prog.abstract_state(), name="tiny",
                                        optimizer=prog.optimizer_layout)
    ck.close()
    assert at == 2 and int(restored["step"]) == 2
    for row in rows:
        restored, m = step(restored, *batch)
        assert jax.device_get(m) == row
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), final)


@pytest.mark.parametrize("overrides,match", [
    (["parallel.zero=2"], r"parallel.zero=2 must be 0 \(optimizer state replicated over "
                          r"data\) or 1 \(ZeRO-1: sharded over data\)"),
    (["parallel.zero=-1"], r"parallel.zero=-1 must be 0"),
    (["recipe.codec_wd=int4-sym"], r"recipe.codec_wd='int4-sym' compresses ZeRO-1's weight "
                                   r"all-gather, but parallel.zero=0 sends no weights"),
    (["parallel.zero=1", "recipe.codec_wd=int5"], r"recipe.codec_wd='int5'"),
])
def test_bad_zero_configs_fail_clearly(overrides, match):
    with pytest.raises(ValueError, match=match):
        config_lib.load_config("tiny", overrides)


def test_zero1_without_data_parallelism_is_the_replicated_optimizer():
    """data=1: nothing to shard over; the run is that of parallel.zero=0, its checkpoints
    too. `codec=X` leaves the weight all-gather exact."""
    prog = _program("1x1x2", "parallel.zero=1", "recipe.codec_wd=echo4")
    assert prog.zero is None and prog.optimizer_layout == {"zero": 0}
    assert config_lib.load_config("tiny", ["codec=tah4"]).recipe.wd_codec == "none"


def test_checkpoint_of_the_other_layout_fails_naming_both(cache, tmp_path):  # noqa: F811
    """A run resumed with parallel.zero=1 from a checkpoint whose metadata names no layout
    (a parallel.zero=0 run's, or one saved before ZeRO-1 existed) stops before reading any
    array (so a stand-in state will do), naming both layouts; the checkpoint stays."""
    run_dir = tmp_path / "run"
    ck = Checkpointer(run_dir / "ckpt", async_save=False)
    ck.save(3, {"step": jax.numpy.int32(3)}, {"data_pos": 3, "name": "tiny"})
    ck.close()
    cfg = _config("2x1x2", "parallel.zero=1", f"data.paths=[{CORPUS}]",
                  f"data.cache_dir={cache}", f"train.run_dir={run_dir}")
    with pytest.raises(RuntimeError, match=r"step 3: its optimizer state was saved with "
                                           r"parallel.zero=0 \(optimizer state replicated over "
                                           r"data\), but this run has parallel.zero=1 "
                                           r"\(optimizer state sharded over data=2\)"):
        train.run(cfg, resume=True)
    assert (run_dir / "ckpt" / "3").is_dir()
