"""A Qwen2.5-style decoder in Flax NNX on the GPT's Megatron tensor-parallel layers.

`model.arch: qwen` (models/arch.py). What differs from models/gpt.py's GPT-2:
  - RMSNorm (scale only, statistics in fp32) instead of LayerNorm;
  - a SwiGLU MLP: gate and up projections in one column-parallel matmul, silu(gate) * up,
    the down projection row-parallel; no MLP biases;
  - rotary position embeddings (`model.rope_theta`) on Q and K instead of a learned position
    table;
  - grouped-query attention: `model.n_kv_head` key/value heads, each shared by
    n_head / n_kv_head consecutive query heads; optional Q/K/V biases (`model.qkv_bias`,
    Qwen2.5 has them); no attention-output bias.

Everything tensor-parallel is the GPT's: the sub-layers are `gpt._TPSublayer`s, which
give only their column-parallel kernel (Q and the KV heads side by side; gate and up), the
computation between the matmuls and the row-parallel kernel, and inherit Megatron f before
the one and g after the other with their codecs (with sequence parallelism the all-gather
and reduce-scatter, with `model.tp_overlap` fused with the matmuls); the block is
`gpt.Block` (its forward order, Echo feedback sites); the LM head, vocab-parallel
cross-entropy, pipeline stages, data parallelism, ZeRO-1 and emulated TP come from
`gpt.GPT` and models/parallel.py unchanged. So each block has the GPT's four TP sites and
the same codecs.

Grouped-query attention over "tp" (GPTConfig.validate checks that one of the two holds):
  - n_kv_head % tp == 0: the KV heads split with their query groups (rank r holds query
    heads [r·H/tp, (r+1)·H/tp) and KV heads [r·K/tp, (r+1)·K/tp), the ones they use);
  - tp % n_kv_head == 0 (tp > n_kv_head): the KV weights are replicated over "tp" (their
    `tp_heads` metadata, read by `parallel.param_specs`) and each rank slices the one KV
    head its query heads share. The weights being invariant over "tp", their gradients
    come out summed over it: under shard_map's check_vma the slice of an invariant array at
    a varying index is cast to varying (whose transpose is a psum), under emulated TP the
    unbatched weights' gradients are summed by vmap, as for every replicated parameter.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from taco_jax.collectives import members

from models.gpt import GPT, TP, Block, GPTConfig, _normal, _TPSublayer, sequence_part

RMS_EPS = 1e-6  # Qwen2.5's rms_norm_eps


class RMSNorm(nnx.Module):
    """fp32 residual stream in, compute dtype out: x / rms(x) · scale."""

    def __init__(self, cfg: GPTConfig):
        self.cfg = cfg
        self.scale = nnx.Param(np.ones((cfg.d_model,), np.float32))

    def __call__(self, x):
        x = x.astype(jnp.float32)  # statistics in fp32, as LayerNorm's
        y = x * lax.rsqrt(jnp.square(x).mean(-1, keepdims=True) + RMS_EPS) * self.scale[...]
        return y.astype(self.cfg.compute_dtype)


def rope(x, theta: float):
    """Rotary position embedding of x (B, T, H, hd) at positions 0..T-1, in fp32, returned
    in x's dtype. Channel i and i + hd/2 form a pair rotated by the angle
    pos · theta^(-2i/hd) (the "rotate half" layout of Qwen2 and LLaMA in HF transformers,
    so their checkpoints' Q/K weights apply unpermuted)."""
    t, hd = x.shape[1], x.shape[-1]
    inv_freq = 1.0 / theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)  # (hd/2,)
    angle = jnp.arange(t, dtype=jnp.float32)[:, None] * inv_freq               # (T, hd/2)
    angle = jnp.concatenate([angle, angle], -1)[:, None, :]                    # (T, 1, hd)
    xf = x.astype(jnp.float32)
    rotated = jnp.concatenate([-xf[..., hd // 2:], xf[..., :hd // 2]], -1)
    return (xf * jnp.cos(angle) + rotated * jnp.sin(angle)).astype(x.dtype)


class GQAttention(_TPSublayer, nnx.Module):
    """Causal grouped-query self-attention with RoPE: query heads split over "tp" (Q
    column-parallel, output row-parallel), KV heads split with them or replicated (module
    docstring)."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs | np.random.Generator):
        d, h, kv, hd = cfg.d_model, cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.cfg = cfg
        self.q_kernel = nnx.Param(_normal(rngs, (d, h, hd), 0.02), pspec=(None, TP, None))
        # `tp_heads`: with more TP ranks than KV heads the parameter is replicated
        self.kv_kernel = nnx.Param(_normal(rngs, (d, 2, kv, hd), 0.02),
                                   pspec=(None, None, TP, None), tp_heads=kv)
        if cfg.qkv_bias:
            self.q_bias = nnx.Param(np.zeros((h, hd), np.float32), pspec=(TP, None))
            self.kv_bias = nnx.Param(np.zeros((2, kv, hd), np.float32), pspec=(None, TP, None),
                                     tp_heads=kv)
        self.out_kernel = nnx.Param(_normal(rngs, (h, hd, d), 0.02 / math.sqrt(2 * cfg.n_layer)),
                                    pspec=(TP, None, None))

    def bias(self, dt):
        return None  # Qwen's o_proj has no bias

    def kv_weights(self):
        """(kernel (d, 2, k, hd), bias (2, k, hd) or None) of the k KV heads this rank's
        query heads use: its shard as held, or, with the weights replicated (tp >
        n_kv_head), the one head they share, sliced at this rank's position on "tp"."""
        cfg = self.cfg
        w = self.kv_kernel[...]
        b = self.kv_bias[...] if cfg.qkv_bias else None
        hq = self.q_kernel[...].shape[1]              # this rank's query heads
        group = cfg.n_head // cfg.kv_heads            # query heads per KV head
        if w.shape[2] * group == hq:                  # split with the queries (or tp = 1)
            return w, b
        # < hq query heads share one KV head (a static slice under emulated TP: `members`)
        head = lambda me: me * hq // group            # noqa: E731
        w = members.take(w, (TP,), head, 1, 2)
        return w, None if b is None else members.take(b, (TP,), head, 1, 1)

    def column_kernel(self, dt):
        """Q's and this rank's K/V columns side by side: one matmul, (d, (H/tp + 2k)·hd)."""
        d = self.cfg.d_model
        w_kv, _ = self.kv_weights()
        return jnp.concatenate([self.q_kernel[...].reshape(d, -1), w_kv.reshape(d, -1)],
                               axis=1).astype(dt)

    def inner(self, h):
        """(B, T, (H/tp + 2k)·hd) -> the heads' attention output (B, T, H/tp·hd): biases,
        RoPE on Q and K, causal attention of each query head with its group's KV head."""
        cfg, dt = self.cfg, self.cfg.compute_dtype
        b, t = h.shape[:2]
        hq, hd = self.q_kernel[...].shape[1], cfg.head_dim
        q = h[..., :hq * hd].reshape(b, t, hq, hd)
        kv = h[..., hq * hd:].reshape(b, t, 2, -1, hd)                     # (B, T, 2, k, hd)
        if cfg.qkv_bias:
            q, kv = q + self.q_bias[...].astype(dt), kv + self.kv_weights()[1].astype(dt)
        k, v = kv[:, :, 0], kv[:, :, 1]
        q, k = rope(q, cfg.rope_theta), rope(k, cfg.rope_theta)
        # query head j uses KV head j // (H/tp / k): jax's grouping, and HF's repeat_kv
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                         implementation=cfg.attention_impl(dt))
        return y.reshape(b, t, -1)

    def row_kernel(self, dt):
        return self.out_kernel[...].astype(dt).reshape(-1, self.cfg.d_model)  # (H/tp·hd, d)


class SwiGLU(_TPSublayer, nnx.Module):
    """silu(x W_gate) * (x W_up) W_down; hidden units split over "tp" (gate and up in one
    column-parallel matmul, down row-parallel). No biases."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs | np.random.Generator):
        d, ff = cfg.d_model, cfg.ff
        self.cfg = cfg
        self.gate_up_kernel = nnx.Param(_normal(rngs, (d, 2, ff), 0.02), pspec=(None, None, TP))
        self.down_kernel = nnx.Param(_normal(rngs, (ff, d), 0.02 / math.sqrt(2 * cfg.n_layer)),
                                     pspec=(TP, None))

    def bias(self, dt):
        return None

    def column_kernel(self, dt):
        """Gate and up columns side by side: (d, 2·ff/tp)."""
        return self.gate_up_kernel[...].astype(dt).reshape(self.cfg.d_model, -1)

    def inner(self, h):
        """(B, T, 2·ff/tp) -> silu(gate) * up, (B, T, ff/tp)."""
        h = h.reshape(*h.shape[:2], 2, -1)
        return jax.nn.silu(h[:, :, 0]) * h[:, :, 1]

    def row_kernel(self, dt):
        return self.down_kernel[...].astype(dt)  # (ff/tp, d): partial sums over the shards


class QwenBlock(Block):
    """Pre-norm block (`gpt.Block`'s forward and feedback sites) of RMSNorm, grouped-query
    attention and SwiGLU."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs | np.random.Generator):
        self.cfg = cfg
        self.ln1 = RMSNorm(cfg)
        self.attn = GQAttention(cfg, rngs)
        self.ln2 = RMSNorm(cfg)
        self.mlp = SwiGLU(cfg, rngs)


class Qwen(GPT):
    """The decoder: token embedding (no position table: RoPE), Qwen blocks, final RMSNorm,
    untied vocab-parallel LM head. Forward pass, LM head and loss are `gpt.GPT`'s.

    `rngs`: nnx.Rngs (jax.random init) or a numpy Generator (host init); `layers`: the
    blocks this module holds (default model.n_layer; 0 for a pipeline's ends)."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs | np.random.Generator,
                 layers: int | None = None):
        self.cfg = cfg
        self.wte = nnx.Param(_normal(rngs, (cfg.vocab_size, cfg.d_model), 0.02))
        n = cfg.n_layer if layers is None else layers
        self.blocks = nnx.List([QwenBlock(cfg, rngs) for _ in range(n)])
        self.ln_f = RMSNorm(cfg)
        self.lm_head = nnx.Param(_normal(rngs, (cfg.d_model, cfg.vocab_size), 0.02),
                                 pspec=(None, TP))

    def embed(self, tokens):
        """tokens (B, T) int32 -> the residual stream (B, T, d) fp32; with sequence
        parallelism this device's part of it, (B, T/tp, d). Positions enter in attention."""
        tokens, _ = sequence_part(tokens, self.cfg)
        return self.wte[...][tokens]
