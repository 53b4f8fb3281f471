"""models/qwen.py: RoPE, RMSNorm, SwiGLU and grouped-query attention against plain numpy/jnp
references; the whole decoder, loss and gradients, against a plain-jnp model at TP = 1 (also
without Q/K/V biases, with 1 and n_head KV heads, in bf16 compute), and
on TP meshes (KV heads split at tp = 2, replicated at tp = 4) with data parallelism,
pipeline stages, sequence parallelism (model.tp_overlap's fused collective matmuls) and
emulated TP, exact with codec none and within
taco's error; the configurations grouped-query attention cannot split fail naming n_head,
n_kv_head and tp; and the qwen-tiny preset trains a few steps."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import train
from models import arch, parallel, qwen
from models.gpt import GPTConfig
from train import config as config_lib

from model_cases import _max_rel_err, _rel, _tokens
from run_cases import _overrides, cache  # noqa: F401 (cache: the shared corpus fixture)

# Odd sizes: head_dim 6, 2 query heads per KV head, d_ff 40, vocab 68.
QCFG = GPTConfig(arch="qwen", vocab_size=68, seq_len=12, n_layer=2, n_head=4, n_kv_head=2,
                 d_model=24, d_ff=40, dtype="float32", codec_fwd="none", codec_bwd="none",
                 attention="xla", rope_theta=100.0)


# ---------------------------------------------------------------------------------------------
# references, plain numpy / jnp

def _rope_reference(x, theta):
    """Channels (i, i + hd/2) as one complex number, turned by pos · theta^(-2i/hd)."""
    t, hd = x.shape[1], x.shape[-1]
    z = x[..., :hd // 2] + 1j * x[..., hd // 2:]
    angle = np.arange(t)[:, None] * theta ** (-np.arange(0, hd, 2) / hd)
    z = z * np.exp(1j * angle)[None, :, None, :]
    return np.concatenate([z.real, z.imag], -1)


def _rms_reference(x, scale, xp=np):
    return x / xp.sqrt(xp.mean(x * x, -1, keepdims=True) + qwen.RMS_EPS) * scale


def _attention_reference(h, p, cfg, xp=np):
    """Grouped-query causal attention, the KV heads repeated for their query groups."""
    q = xp.einsum("btd,dhe->bthe", h, p["q_kernel"]) + p.get("q_bias", 0.0)
    kv = xp.einsum("btd,dkhe->btkhe", h, p["kv_kernel"]) + p.get("kv_bias", 0.0)
    k, v = kv[:, :, 0], kv[:, :, 1]
    hd, group = cfg.head_dim, cfg.n_head // cfg.kv_heads
    rot = (lambda a: _rope_reference(a, cfg.rope_theta)) if xp is np else (
        lambda a: qwen.rope(a, cfg.rope_theta))
    q, k = rot(q), rot(k)
    k, v = xp.repeat(k, group, axis=2), xp.repeat(v, group, axis=2)
    s = xp.einsum("bqhe,bkhe->bhqk", q, k) / np.sqrt(hd)
    t = h.shape[1]
    s = xp.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
    w = xp.exp(s - s.max(-1, keepdims=True))
    w = w / w.sum(-1, keepdims=True)
    y = xp.einsum("bhqk,bkhe->bqhe", w, v)
    return xp.einsum("bthe,hed->btd", y, p["out_kernel"])


def _swiglu_reference(h, p, xp=np):
    a = xp.einsum("btd,dkf->btkf", h, p["gate_up_kernel"])
    gate, up = a[:, :, 0], a[:, :, 1]
    return (gate / (1 + xp.exp(-gate)) * up) @ p["down_kernel"]


def _loss_reference(params, tokens, targets, cfg):
    """The decoder in plain jnp on the global parameters (its RoPE is the model's, tested
    against the complex reference on its own)."""
    x = params["wte"][tokens]
    for i in range(cfg.n_layer):
        b = params["blocks"][i]
        x = x + _attention_reference(_rms_reference(x, b["ln1"]["scale"], jnp), b["attn"],
                                     cfg, jnp)
        x = x + _swiglu_reference(_rms_reference(x, b["ln2"]["scale"], jnp), b["mlp"], jnp)
    logits = _rms_reference(x, params["ln_f"]["scale"], jnp) @ params["lm_head"]
    picked = jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
    return (jax.nn.logsumexp(logits, -1) - picked).mean()


def _params(module):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(module)))


# ---------------------------------------------------------------------------------------------
# the pieces, at TP = 1 (outside any mesh: no collective runs)

def test_rope_matches_the_complex_reference():
    x = np.random.default_rng(0).standard_normal((2, 7, 3, 6)).astype(np.float32)
    got = np.asarray(qwen.rope(jnp.asarray(x), 100.0))
    np.testing.assert_allclose(got, _rope_reference(x, 100.0), rtol=1e-5, atol=1e-5)
    # a rotation: norms kept, and q·k depends on the positions' difference alone
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), np.linalg.norm(x, axis=-1),
                               rtol=1e-5)
    same = np.broadcast_to(x[:, :1], x.shape)            # one vector at every position
    r = np.asarray(qwen.rope(jnp.asarray(same), 100.0))
    dots = np.einsum("bqhe,bkhe->bhqk", r, r)
    np.testing.assert_allclose(dots[..., 1:, 1:], dots[..., :-1, :-1], rtol=1e-4, atol=1e-5)


def test_rmsnorm_swiglu_and_gqa_match_their_references():
    rng = np.random.default_rng(1)
    cfg = dataclasses.replace(QCFG, n_layer=1)
    block = qwen.QwenBlock(cfg, rng)
    p = _params(block)
    p["ln1"]["scale"] = rng.standard_normal(cfg.d_model).astype(np.float32)
    p["attn"]["q_bias"] = rng.standard_normal((cfg.n_head, cfg.head_dim)).astype(np.float32)
    p["attn"]["kv_bias"] = rng.standard_normal((2, cfg.kv_heads, cfg.head_dim)
                                               ).astype(np.float32)
    state = nnx.state(block)
    nnx.replace_by_pure_dict(state, p)
    nnx.update(block, state)
    x = rng.standard_normal((2, cfg.seq_len, cfg.d_model)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(block.ln1(jnp.asarray(x))),
                               _rms_reference(x, p["ln1"]["scale"]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(block.mlp.partial(jnp.asarray(x))),
                               _swiglu_reference(x, p["mlp"]), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(block.attn.partial(jnp.asarray(x))),
                               _attention_reference(x, p["attn"], cfg), rtol=1e-4, atol=1e-6)
    # Qwen2.5 without QKV biases: no such parameters
    plain = qwen.GQAttention(dataclasses.replace(cfg, qkv_bias=False), rng)
    assert sorted(_params(plain)) == ["kv_kernel", "out_kernel", "q_kernel"]


# ---------------------------------------------------------------------------------------------
# the decoder on meshes

def _run(cfg, data=1, tp=1, pipe=1, emulate=0, codec="none"):
    """-> (loss, grads as numpy in the one-device layout, params) of one batch."""
    cfg = dataclasses.replace(cfg, codec_fwd=codec, codec_bwd=codec, min_bytes=0)
    if emulate:
        mesh = parallel.make_emulation_mesh(data)
        model = parallel.shard_gpt(cfg, mesh, emulate_tp=emulate)
    else:
        mesh = parallel.make_mesh(data, tp, pipe=pipe)
        model = parallel.shard_gpt(cfg, mesh, microbatches=2 if pipe > 1 else 1)
    params = model.init(0)
    x, y = (parallel.put_batch(a, mesh) for a in _tokens(cfg))
    loss, grads = jax.jit(model.loss_and_grad_fn())(params, x, y)
    grads, params = jax.device_get((grads, params))
    if pipe > 1:
        grads, params = parallel.unstack_blocks(grads), parallel.unstack_blocks(params)
    return float(loss), grads, params


@pytest.fixture(scope="module")
def reference():
    """The one-device model's loss and gradients, and the plain-jnp model's on its params."""
    loss, grads, params = _run(QCFG)
    x, y = _tokens(QCFG)
    ref = jax.jit(jax.value_and_grad(_loss_reference), static_argnums=3)
    ref_loss, ref_grads = ref(params, x, y, QCFG)
    return loss, grads, float(ref_loss), jax.device_get(ref_grads)


def test_one_device_matches_the_plain_model(reference):
    loss, grads, ref_loss, ref_grads = reference
    assert abs(loss - ref_loss) < 1e-5 * ref_loss, (loss, ref_loss)
    assert abs(loss - np.log(QCFG.vocab_size)) < 0.1, loss    # near-uniform at init
    assert _max_rel_err(grads, ref_grads) < 1e-4
    assert all(np.any(g != 0) for g in jax.tree.leaves(grads))  # nothing detached


def _against_the_plain_model(cfg):
    """(loss, reference loss, max relative gradient error) of the one-device model against
    the plain-jnp one on its parameters (in f32)."""
    loss, grads, params = _run(cfg)
    x, y = _tokens(cfg)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(_loss_reference), static_argnums=3)(
        params, x, y, dataclasses.replace(cfg, dtype="float32"))
    return loss, float(ref_loss), grads, jax.device_get(ref_grads)


@pytest.mark.parametrize("change", [
    dict(qkv_bias=False, n_kv_head=1),   # Qwen2.5 without Q/K/V biases; multi-query attention
    dict(n_kv_head=4),                   # one KV head per query head (as n_kv_head=0)
], ids=["no-qkv-bias-kv1", "kv=heads"])
def test_variants_match_the_plain_model(change):
    """One block of each: the one-device model against the plain one, loss and gradients,
    with the parameters the variant has (no biases; 1 or n_head KV heads)."""
    cfg = dataclasses.replace(QCFG, n_layer=1, **change)
    loss, ref_loss, grads, ref_grads = _against_the_plain_model(cfg)
    assert abs(loss - ref_loss) < 1e-5 * ref_loss, (loss, ref_loss)
    assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
    assert _max_rel_err(grads, ref_grads) < 1e-4
    attn = grads["blocks"][0]["attn"]
    assert ("q_bias" in attn) == ("kv_bias" in attn) == cfg.qkv_bias
    assert attn["kv_kernel"].shape[2] == cfg.kv_heads


def test_one_kv_head_replicated_over_tp2_equals_one_device():
    """n_kv_head = 1 at TP 2 (emulated): the one KV head replicated on both ranks, its
    gradient summed over them."""
    cfg = dataclasses.replace(QCFG, n_kv_head=1, n_layer=1)
    loss0, grads0, _ = _run(cfg)
    loss, grads, _ = _run(cfg, emulate=2)
    assert abs(loss - loss0) < 1e-5 * loss0, (loss, loss0)
    assert _max_rel_err(grads, grads0) < 1e-4


def test_bf16_compute_is_the_plain_model_within_bf16_rounding():
    """dtype bfloat16 (fp32 parameters and residual stream, bf16 matmuls and attention):
    loss within 0.1% and gradients within 1% (relative L2; 0.3% seen) of the f32 plain
    model on the same parameters, and not equal to it (the dtype is used)."""
    cfg = dataclasses.replace(QCFG, dtype="bfloat16", n_layer=1)
    loss, ref_loss, grads, ref_grads = _against_the_plain_model(cfg)
    assert abs(loss - ref_loss) < 1e-3 * ref_loss, (loss, ref_loss)
    err = _rel(grads, ref_grads)
    assert 1e-4 < err < 1e-2, err


@pytest.mark.parametrize("data,pipe,tp,emulate,sp", [
    (2, 2, 2, 0, False),     # KV heads split with their queries; pipeline; data parallel
    (2, 1, 4, 0, False),     # tp > n_kv_head: KV weights replicated, gradients summed
    (1, 1, 4, 0, True),      # ... with sequence parallelism, fused with the matmuls
    (1, 1, 0, 4, False),     # ... with TP emulated under vmap
])
def test_tp_meshes_equal_one_device(reference, data, pipe, tp, emulate, sp):
    loss0, grads0, _, _ = reference
    cfg = dataclasses.replace(QCFG, sequence_parallel=sp, tp_overlap=sp)
    loss, grads, _ = _run(cfg, data, tp, pipe, emulate)
    assert abs(loss - loss0) < 1e-5 * loss0, (loss, loss0)
    err = _max_rel_err(grads, grads0)
    assert err < 1e-4, f"max relative gradient error {err:.2e}"


def test_kv_weights_split_or_replicated():
    """The KV weights' partition: split over "tp" with their query heads while tp divides
    n_kv_head, replicated beyond; the query and output weights always split."""
    def specs(tp):
        model = parallel.shard_gpt(QCFG, parallel.make_emulation_mesh(1), emulate_tp=tp)
        return model.tp_specs["blocks"][0]["attn"]
    P = jax.sharding.PartitionSpec
    assert specs(2)["kv_kernel"] == P(None, None, "tp", None)
    assert specs(2)["kv_bias"] == P(None, "tp", None)
    assert specs(4)["kv_kernel"] == specs(4)["kv_bias"] == P()
    assert specs(4)["q_kernel"] == P(None, "tp", None)
    assert specs(4)["out_kernel"] == P("tp", None, None)


def test_taco_at_tp4_within_its_error(reference):
    """taco on every all-reduce (forward and backward, the LM head's too): first-step loss
    within 1% and the gradients' direction kept (cosine > 0.98), as the GPT's."""
    loss0, grads0, _, _ = reference
    loss, grads, _ = _run(QCFG, 1, 4, codec="taco")
    assert abs(loss - loss0) < 1e-2 * loss0, (loss, loss0)
    u, v = (np.concatenate([g.ravel() for g in jax.tree.leaves(t)]) for t in (grads, grads0))
    assert u @ v / (np.linalg.norm(u) * np.linalg.norm(v)) > 0.98
    assert _max_rel_err(grads, grads0) > 1e-4        # compressed, really


def test_taco_with_tp_overlap_at_tp2_within_its_error(reference):
    """Sequence parallelism with the collective matmuls (model.tp_overlap), taco on every
    site: the gradients' error against the exact step within 1.1x the serial SP step's
    with taco (measured 0.0857 against 0.0871; an all-gather-matmul 10% off gives more),
    and compressed, really."""
    _, grads0, _, _ = reference
    sp = dataclasses.replace(QCFG, sequence_parallel=True)
    _, grads_sp, _ = _run(sp, 1, 2, codec="taco")
    _, grads, _ = _run(dataclasses.replace(sp, tp_overlap=True), 1, 2, codec="taco")
    err, err_sp = _max_rel_err(grads, grads0), _max_rel_err(grads_sp, grads0)
    assert 1e-4 < err <= 1.1 * err_sp, (err, err_sp)


def test_feedback_and_zero1_trace():
    """Echo feedback through the shared block, and ZeRO-1's train step, at data x tp = 2 x 4
    (abstract evaluation: nothing compiles)."""
    cfg = dataclasses.replace(QCFG, codec_fwd="echo4", codec_bwd="echo4", min_bytes=0,
                              feedback=True, feedback_bwd=True)
    mesh = parallel.make_mesh(2, 4)
    model = parallel.shard_gpt(cfg, mesh)
    x = jax.ShapeDtypeStruct((4, QCFG.seq_len), np.int32,
                             sharding=jax.sharding.NamedSharding(mesh, parallel.BATCH_SPEC))
    loss, grads = jax.eval_shape(model.loss_and_grad_fn(), model.abstract_params(), x, x)
    assert loss.shape == () and jax.tree.structure(grads) == jax.tree.structure(
        model.abstract_params())
    run = config_lib.load_config("qwen-tiny", ["parallel.tp=4", "parallel.data=2",
                                               "parallel.zero=1", "train.batch_size=4",
                                               "model.n_layer=1"])
    prog = train.build(run, mesh)
    assert prog.zero is not None
    state = prog.abstract_state()
    xs = jax.ShapeDtypeStruct((4, run.model.seq_len), np.int32, sharding=x.sharding)
    new, metrics = jax.eval_shape(prog.step, state, xs, xs)
    assert jax.tree.structure(new) == jax.tree.structure(state) and metrics["loss"].shape == ()


@pytest.mark.parametrize("change,tp,match", [
    (dict(n_head=6, n_kv_head=3), 2, r"model.n_head=6, model.n_kv_head=3 and tp=2 do not fit"),
    (dict(n_kv_head=2), 8, r"model.n_head=4, model.n_kv_head=2 and tp=8 do not fit"),
    (dict(n_kv_head=3), 1, r"model.n_kv_head=3 must be >= 0 \(0 = n_head\) and divide "
                           r"model.n_head=4"),
    (dict(d_model=20), 1, r"even head_dim \(model.d_model/model.n_head=5"),
    (dict(rope_theta=0.0), 1, r"model.rope_theta=0.0 > 0"),
    (dict(arch="llama"), 1, r"model.arch='llama' must be one of \['gpt', 'qwen'\]"),
    (dict(arch="gpt"), 1, r"model.n_kv_head=2 and model.qkv_bias=True need model.arch=qwen"),
])
def test_bad_configs_fail_naming_the_values(change, tp, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(QCFG, **change).validate(tp=tp)
    with pytest.raises(ValueError, match=r"model.arch='llama'"):
        arch.decoder(dataclasses.replace(QCFG, arch="llama"))


def test_qwen_tiny_trains(cache, tmp_path):  # noqa: F811 (the fixture)
    """The preset's model (n_kv_head 2: replicated at TP = 4), taco on every all-reduce,
    4 steps on data x tp = 2 x 4: the loss falls."""
    cfg = config_lib.load_config("qwen-tiny", _overrides(
        cache, tmp_path / "run", "model.n_head=4", "model.d_model=32", "model.d_ff=88",
        "parallel.tp=4", "parallel.data=2", "train.steps=4", "train.eval_every=0",
        "train.ckpt_every=0", "train.codec_error=false", "optim.lr=1e-2"))
    assert cfg.model.arch == "qwen" and cfg.model.n_kv_head == 2
    summary = train.run(cfg)
    losses = [r["loss"] for r in train.metrics.read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    assert summary["arch"] == "qwen" and summary["codec_fwd"] == "taco"
    assert summary["sites"]["compressed"] > 0
    assert len(losses) == 4 and losses[-1] < losses[0], losses
