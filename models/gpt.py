"""A GPT-2 style transformer in Flax NNX with Megatron tensor parallelism.

The model is written for the *local* shard of one device inside `jax.shard_map` over a mesh
with axes ("data", "pipe", "tp") (see models/parallel.py, which also pipelines the blocks
over "pipe"). Parameters that are split over "tp" carry their partition as `pspec` metadata;
every size the forward pass needs is read from the local parameter shapes, so the same code
runs at TP = 1, 2, 4, ...

Megatron's conjugate pair (the TACO paper's Fig. 2), per block:
  f = taco_jax.pvary(x, "tp", codec=codec_bwd)  before QKV and MLP-up (column-parallel):
      identity forward, (compressed) all-reduce of the input gradient backward;
  g = taco_jax.psum(y, "tp", codec=codec_fwd)   after attention-out and MLP-down (row-parallel):
      (compressed) all-reduce forward, identity backward.
So each block has two compressed all-reduces forward and two backward. f and g are each
other's transpose: the forward pass sums partial outputs, the backward pass sums partial
input gradients, and nothing else crosses devices. With `sequence_parallel=True` (Megatron-SP)
the stream between them holds this device's part of the sequence and f / g are an all-gather
and a reduce-scatter along it (`_TPSublayer`).

Compression policy has one home, the `taco_jax.config` recipe in effect where the model is
traced; a GPTConfig names only the sites that differ from it (`codec_fwd`, `codec_bwd`,
`codec_head`, `min_bytes`; None = the recipe's). `GPTConfig.sites(recipe)` resolves them
against a recipe given explicitly, so checking a config never depends on the context it is
checked in; the model resolves them against `taco_jax.recipe.current()` when traced.

Error feedback (`feedback=True`, Echo, docs/echo.md): the forward sites (and with
`feedback_bwd=True` the backward ones) go through
`taco_jax.feedback.psum_with_feedback` / `pvary_with_feedback`, and one `FeedbackState`
(zeros at the start of each forward pass, created inside the shard_map) is threaded through
them in forward order, so the error each compressed all-reduce injects into the residual
stream is subtracted at the next one. With backward feedback a compressing `f` site sits *before*
the LayerNorm (on the stream itself, not on LN's output), so a backward site's error lands
directly in the stream's cotangent and the next backward site cancels it, as the forward
sites do; the math is unchanged (LN is replicated: applying it before or after an
identity-forward op gives the same values and, summed over "tp", the same gradients).

Choices (documented in docs/training.md):
  - LM head untied from the token embedding and vocab-parallel (columns split over "tp"), with a
    Megatron vocab-parallel cross-entropy: the (B, T, V) logits never get gathered; the pmax
    and two psums it needs are of (B, T) fp32 values and stay exact lax collectives.
  - Token/position embeddings and LayerNorms are replicated (invariant over "tp").
  - fp32 parameters and residual stream (as PyTorch AMP keeps them); matmuls, attention and
    the all-reduced activations/gradients in `dtype` (bf16 by default); LayerNorm statistics
    and the loss in fp32. No dropout: runs are deterministic, which makes resume bit-exact.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

import taco_jax
from taco_jax.collectives import members

TP = "tp"  # mesh axis of tensor parallelism
DATA = "data"  # mesh axis of data parallelism
PIPE = "pipe"  # mesh axis of pipeline parallelism (models/pipeline.py)
ARCHS = ("gpt", "qwen")  # model.arch: the decoder families (classes: models/arch.py)
_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    # decoder family (models/arch.py): gpt = GPT-2 (LayerNorm, GELU, learned positions);
    # qwen = Qwen2.5 (RMSNorm, SwiGLU, rotary positions, grouped-query attention)
    arch: str = "gpt"
    vocab_size: int = 4096  # model vocabulary; >= tokenizer vocab, divisible by tp
    seq_len: int = 128  # context length (position table size)
    n_layer: int = 4
    n_head: int = 4  # attention heads; divisible by tp (heads are split over "tp")
    d_model: int = 128
    d_ff: int = 0  # MLP hidden size; 0 means 4 * d_model
    dtype: str = "bfloat16"  # compute dtype (params are fp32); auto = fp32 on CPU, else bf16
    # Compression at the TP sites; None = the value of the taco_jax recipe the model is
    # traced under (train/: the run's `recipe:` section), a value wins at its own sites.
    codec_fwd: str | None = None  # codec of the forward all-reduces (g: row-parallel outputs)
    codec_bwd: str | None = None  # codec of the backward all-reduces (f: column-parallel inputs)
    # codec of the LM head's f (the cotangent every parameter's gradient descends from);
    # None = the backward sites' codec
    codec_head: str | None = None
    attention: str = "auto"  # jax.nn.dot_product_attention implementation: auto | xla | cudnn
    min_bytes: int | None = None  # TP all-reduces smaller than this stay lax.psum
    feedback: bool = False  # Echo error feedback at the compressed forward sites (docs/echo.md)
    # also at the backward sites: more accurate per step, yet worse training (docs/echo.md)
    feedback_bwd: bool = False
    # Megatron sequence parallelism: LayerNorms and the residual stream split along the
    # sequence over "tp"; each TP all-reduce becomes a reduce-scatter and an all-gather
    sequence_parallel: bool = False
    # with sequence_parallel: each all-gather and the column-parallel matmul that reads it
    # (QKV, MLP up), each reduce-scatter and the row-parallel matmul that feeds it (attention
    # out, MLP down) as one op, which moves one part of the sequence while it multiplies another
    tp_overlap: bool = False
    # The Qwen family's fields (models/qwen.py); the GPT takes their defaults.
    n_kv_head: int = 0  # key/value heads of grouped-query attention; 0 = n_head
    rope_theta: float = 10000.0  # base of the rotary position embeddings (Qwen2.5: 1e6)
    qkv_bias: bool = True  # biases on Q, K and V (GPT-2 and Qwen2.5 have them)

    def sites(self, recipe: taco_jax.Recipe) -> "SiteCodecs":
        """The compression of each TP site under `recipe`: every None field takes the
        recipe's value. The model calls it with `taco_jax.recipe.current()` where it is
        traced; checks call it with the run's recipe.

        Raises ValueError if model.feedback is on and no feedback site compresses."""
        fwd = recipe.codec if self.codec_fwd is None else self.codec_fwd
        bwd = recipe.codec if self.codec_bwd is None else self.codec_bwd
        head = bwd if self.codec_head is None else self.codec_head
        _check_feedback(self, fwd, bwd)
        return SiteCodecs(fwd=fwd, bwd=bwd, head=head, min_bytes=self.min_bytes,
                          feedback_bwd=(self.feedback and self.feedback_bwd
                                        and not is_exact(bwd)))

    def attention_impl(self, dt) -> str:
        """auto: cuDNN's fused attention on GPU in 16-bit (its supported case), else XLA's."""
        if self.attention != "auto":
            return self.attention
        fused = (jax.default_backend() == "gpu" and dt in (jnp.bfloat16, jnp.float16)
                 and self.head_dim % 8 == 0 and self.head_dim <= 128)
        return "cudnn" if fused else "xla"

    @property
    def ff(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        """Key/value heads: model.n_kv_head, or one per query head (0)."""
        return self.n_kv_head or self.n_head

    @property
    def compute_dtype(self):
        if self.dtype == "auto":  # XLA:CPU's bf16 backward matmuls are ~6x slower than fp32
            return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
        return _DTYPES[self.dtype]

    def validate(self, tp: int = 1, recipe: taco_jax.Recipe | None = None) -> "GPTConfig":
        """Raise ValueError naming the values if this config cannot run with `tp` shards.
        With `recipe` the sites it decides (fields left None) are checked too (feedback
        needs a compressing codec); without it only the fields set here are, and the model
        checks the rest where it is traced. Returns self."""
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name}={getattr(self, name)} must be positive")
        if self.d_ff < 0:
            raise ValueError(f"model.d_ff={self.d_ff} must be >= 0 (0 means 4 * d_model)")
        if self.d_model % self.n_head:
            raise ValueError(f"model.d_model={self.d_model} must be divisible by "
                             f"model.n_head={self.n_head}")
        if self.arch not in ARCHS:
            raise ValueError(f"model.arch={self.arch!r} must be one of {list(ARCHS)}")
        if self.n_kv_head < 0 or self.n_head % self.kv_heads:
            raise ValueError(f"model.n_kv_head={self.n_kv_head} must be >= 0 (0 = n_head) and "
                             f"divide model.n_head={self.n_head}")
        if self.arch == "gpt" and (self.kv_heads != self.n_head or not self.qkv_bias):
            raise ValueError(f"model.n_kv_head={self.n_kv_head} and model.qkv_bias="
                             f"{self.qkv_bias} need model.arch=qwen: the GPT has one key/value "
                             f"head per query head, with biases")
        if self.arch == "qwen" and (self.head_dim % 2 or not self.rope_theta > 0):
            raise ValueError(f"model.arch=qwen needs an even head_dim (model.d_model/"
                             f"model.n_head={self.head_dim}: RoPE rotates pairs of channels) "
                             f"and model.rope_theta={self.rope_theta} > 0")
        if self.dtype not in (*_DTYPES, "auto"):
            raise ValueError(f"model.dtype={self.dtype!r} must be one of "
                             f"{[*_DTYPES, 'auto']}")
        if self.attention not in ("auto", "xla", "cudnn"):
            raise ValueError(f"model.attention={self.attention!r} must be auto, xla or cudnn")
        if self.min_bytes is not None and (isinstance(self.min_bytes, bool)
                                           or not isinstance(self.min_bytes, int)
                                           or self.min_bytes < 0):
            raise ValueError(f"model.min_bytes={self.min_bytes!r} must be an int >= 0, or null "
                             f"(the key left out) for the recipe's threshold")
        if tp <= 0:
            raise ValueError(f"tp={tp} must be positive")
        h, kv = self.n_head, self.kv_heads
        if kv != h and (h % tp or (kv % tp and tp % kv)):
            raise ValueError(f"model.n_head={h}, model.n_kv_head={kv} and tp={tp} do not fit "
                             f"grouped-query attention over TP: n_head must be divisible by "
                             f"tp, and n_kv_head divisible by tp (the KV heads split with "
                             f"their query groups) or tp by n_kv_head (each rank holds the KV "
                             f"head its query heads share)")
        for name, size in (("n_head", self.n_head), ("d_ff", self.ff),
                           ("vocab_size", self.vocab_size)):
            if size % tp:
                raise ValueError(f"model.{name}={size} is not divisible by tp={tp}: "
                                 f"Megatron TP splits it evenly over the 'tp' mesh axis")
        for name in ("codec_fwd", "codec_bwd", "codec_head"):  # the one place names are checked
            value = getattr(self, name)
            if value == "":
                raise ValueError(f"model.{name}='' is not a codec: write null (or leave the key "
                                 f"out) for the recipe's codec")
            if value is None:  # the recipe's, which taco_jax.config checks
                continue
            try:
                taco_jax.codecs.get(value)
            except ValueError as e:
                raise ValueError(f"model.{name}={value!r}: {e}") from None
        if self.feedback_bwd and not self.feedback:
            raise ValueError("model.feedback_bwd=True needs model.feedback=True")
        if self.sequence_parallel and self.seq_len % tp:
            raise ValueError(f"model.seq_len={self.seq_len} is not divisible by tp={tp}: "
                             f"model.sequence_parallel splits the sequence over 'tp'")
        if self.tp_overlap and not self.sequence_parallel:
            raise ValueError("model.tp_overlap=True needs model.sequence_parallel=True: what it "
                             "overlaps with the matmuls are sequence parallelism's all-gathers "
                             "and reduce-scatters (set model.sequence_parallel=true, or "
                             "model.tp_overlap=false)")
        if self.sequence_parallel and self.feedback:
            raise ValueError("model.feedback=True is not supported with "
                             "model.sequence_parallel=True")
        if recipe is not None:
            self.sites(recipe)
        else:  # the sites the recipe does not decide
            _check_feedback(self, self.codec_fwd, self.codec_bwd)
        return self

    def num_params(self) -> int:
        d, ff, v, n = self.d_model, self.ff, self.vocab_size, self.n_layer
        if self.arch == "qwen":  # no position table, no biases but Q/K/V's, untied head
            qkv = (self.n_head + 2 * self.kv_heads) * self.head_dim
            block = 2 * d + (d + self.qkv_bias) * qkv + self.n_head * self.head_dim * d \
                + 3 * d * ff
            return v * d + n * block + d + d * v
        block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * ff + ff) + (ff * d + d)
        return v * d + self.seq_len * d + n * block + 2 * d + d * v


def is_exact(codec) -> bool:
    """Does this codec (a name or a Codec) pass values through unchanged (no error to feed
    back)?"""
    return getattr(taco_jax.codecs.get(codec), "is_identity", False)


def codec_name(codec) -> str:
    """A codec's name, for messages and summaries (a name or a Codec object)."""
    return codec if isinstance(codec, str) else codec.name


@dataclasses.dataclass(frozen=True)
class SiteCodecs:
    """What each TP site of the model does under one recipe (`GPTConfig.sites`)."""

    fwd: Any  # codec of the g sites (row-parallel outputs): a name or a Codec
    bwd: Any  # codec of the f sites (column-parallel inputs)
    head: Any  # codec of the LM head's f
    min_bytes: int | None  # the model's threshold; None: taco_jax reads the recipe's
    # the f sites feed their error back (model.feedback and model.feedback_bwd with a
    # compressing backward codec); the g sites do with model.feedback alone
    feedback_bwd: bool

    @property
    def comm(self) -> dict:
        """Keyword arguments of taco_jax.psum / pvary besides the codec."""
        return {} if self.min_bytes is None else {"min_bytes": self.min_bytes}


def site_codecs(cfg: GPTConfig) -> SiteCodecs:
    """`cfg.sites` under the recipe in effect here (the compression of each TP site):
    called where the model is traced, the recipe that taco_jax's collectives read too."""
    return cfg.sites(taco_jax.recipe.current())


def _check_feedback(cfg: GPTConfig, fwd, bwd) -> None:
    """model.feedback needs a site whose error it can feed back: a compressing forward codec,
    or backward feedback with a compressing backward codec. fwd / bwd: the codecs in effect,
    None where not known (no recipe given): then nothing is concluded from them."""
    if not cfg.feedback or fwd is None or not is_exact(fwd):
        return
    if cfg.feedback_bwd and (bwd is None or not is_exact(bwd)):
        return
    bwd_text = "the recipe's" if bwd is None else repr(codec_name(bwd))
    raise ValueError(f"model.feedback=True needs a compressing codec, but the forward codec "
                     f"{codec_name(fwd)!r} (model.codec_fwd={cfg.codec_fwd!r}) is exact and "
                     f"backward feedback is {'on' if cfg.feedback_bwd else 'off'} "
                     f"(model.feedback_bwd={cfg.feedback_bwd}, backward codec "
                     f"{bwd_text}): there is no error to feed back (set model.feedback=false, or "
                     f"model.feedback_bwd=true with a compressing backward codec)")


# ---------------------------------------------------------------------------------------------
# Layers. `pspec` metadata = the parameter's partition over the mesh (None = replicated dim).

def _normal(rngs: nnx.Rngs | np.random.Generator, shape, std: float):
    if isinstance(rngs, np.random.Generator):  # host init, see ShardedGPT.init: XLA:CPU
        return std * rngs.standard_normal(shape, np.float32)  # takes ~2 s per threefry op
    return std * jax.random.normal(rngs.params(), shape, jnp.float32)


class LayerNorm(nnx.Module):
    """fp32 residual stream in, compute dtype out (the input of the next matmul)."""

    def __init__(self, cfg: GPTConfig):
        self.cfg = cfg
        self.scale = nnx.Param(np.ones((cfg.d_model,), np.float32))
        self.bias = nnx.Param(np.zeros((cfg.d_model,), np.float32))

    def __call__(self, x):
        x = x.astype(jnp.float32)  # statistics in fp32: bf16 variance loses too much
        mean = x.mean(-1, keepdims=True)
        var = jnp.square(x - mean).mean(-1, keepdims=True)
        y = (x - mean) * lax.rsqrt(var + 1e-5) * self.scale[...] + self.bias[...]
        return y.astype(self.cfg.compute_dtype)


class _TPSublayer:
    """Megatron sub-layer: f (pvary) → column-parallel matmul → `inner` → row-parallel
    matmul → g (psum) → + bias. Subclasses give `column_kernel(dt)`, (d, *n): this
    device's columns, several column-parallel matmuls of one input (Q, K and V; a gate and
    an up projection) as one kernel; `inner(h)`, this device's computation between the two
    matmuls, (B, T, *n) -> (B, T, *k); `row_kernel(dt)`, (*k, d); and `bias(dt)` (None: no
    output bias). Both matmuls see the kernels flattened to (d, n) and (k, d), fused or
    not: XLA:CPU sums a contraction over two axes (heads, head_dim) in another order than
    over their product, so the fused ops and the split collectives compute the same bits
    only if both contract the flattened kernels.

    With sequence parallelism x is this device's part of the sequence, (B, T/tp, d): f is
    the all-gather of the sequence (backward: the reduce-scatter of its cotangent), g the
    reduce-scatter of the partial sums back to the parts (backward: an all-gather). Each
    pair shares its site's codec: codec_bwd at f, codec_fwd at g. With `tp_overlap` each
    collective and the matmul beside it are one op, `taco_jax.all_gather_matmul` and
    `taco_jax.matmul_reduce_scatter`, at the same sites with the same codecs: the matmul
    runs on the parts of the sequence that have arrived while the others move."""

    def partial(self, x):
        """x (B, T, d) varying over "tp" -> this device's partial sum of the output."""
        dt = self.cfg.compute_dtype
        w_in, w_out = self.column_kernel(dt), self.row_kernel(dt)
        h = x @ w_in.reshape(w_in.shape[0], -1)                                     # (B, T, n)
        y = self.inner(h.reshape(*h.shape[:2], *w_in.shape[1:]))
        y = y.reshape(*y.shape[:y.ndim - (w_out.ndim - 1)], -1)                  # (B, T, k)
        return y @ w_out.reshape(-1, w_out.shape[-1])

    def overlapped(self, x, sites: "SiteCodecs"):
        """Sequence parallelism's f, the sub-layer and its g, each collective fused with
        its matmul: x (B, T/tp, d) -> this device's part of the sum (B, T/tp, d), no bias."""
        dt = self.cfg.compute_dtype
        w_in, w_out = self.column_kernel(dt), self.row_kernel(dt)
        h = taco_jax.all_gather_matmul(x, w_in.reshape(w_in.shape[0], -1), TP, axis=1,
                                       codec=sites.bwd, **sites.comm)            # (B, T, n)
        y = self.inner(h.reshape(*h.shape[:2], *w_in.shape[1:]))
        y = y.reshape(*y.shape[:y.ndim - (w_out.ndim - 1)], -1)                  # (B, T, k)
        return taco_jax.matmul_reduce_scatter(y, w_out.reshape(-1, w_out.shape[-1]), TP,
                                              scatter_dimension=1, codec=sites.fwd,
                                              **sites.comm)

    def __call__(self, x):  # x: (B, T, d), invariant over "tp"; (B, T/tp, d) with SP
        sites, dt = site_codecs(self.cfg), self.cfg.compute_dtype
        if self.cfg.tp_overlap:  # sequence parallel (GPTConfig.validate)
            return add_bias(self.overlapped(x, sites), self.bias(dt))
        if self.cfg.sequence_parallel:
            x = taco_jax.all_gather(x, TP, axis=1, tiled=True, codec=sites.bwd, **sites.comm)
            y = taco_jax.psum_scatter(self.partial(x), TP, scatter_dimension=1, tiled=True,
                                      codec=sites.fwd, **sites.comm)
            return add_bias(y, self.bias(dt))
        x = taco_jax.pvary(x, TP, codec=sites.bwd, **sites.comm)  # Megatron f
        y = taco_jax.psum(self.partial(x), TP, codec=sites.fwd, **sites.comm)  # Megatron g
        return add_bias(y, self.bias(dt))


def add_bias(y, bias):
    """y + bias, or y for a sub-layer without an output bias (bias None)."""
    return y if bias is None else y + bias


class Attention(_TPSublayer, nnx.Module):
    """Causal self-attention; heads split over "tp" (QKV column-, output row-parallel)."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        d, h, hd = cfg.d_model, cfg.n_head, cfg.head_dim
        self.cfg = cfg
        self.qkv_kernel = nnx.Param(_normal(rngs, (d, 3, h, hd), 0.02),
                                    pspec=(None, None, TP, None))
        self.qkv_bias = nnx.Param(np.zeros((3, h, hd), np.float32), pspec=(None, TP, None))
        # GPT-2: residual projections scaled by 1/sqrt(2 * n_layer).
        self.out_kernel = nnx.Param(_normal(rngs, (h, hd, d), 0.02 / math.sqrt(2 * cfg.n_layer)),
                                    pspec=(TP, None, None))
        self.out_bias = nnx.Param(np.zeros((d,), np.float32))

    def bias(self, dt):
        return self.out_bias[...].astype(dt)

    def column_kernel(self, dt):
        return self.qkv_kernel[...].astype(dt)  # (d, 3, H/tp, hd)

    def inner(self, qkv):
        """(B, T, 3, H/tp, hd) -> the heads' attention output (B, T, H/tp, hd)."""
        cfg, dt = self.cfg, self.cfg.compute_dtype
        qkv = qkv + self.qkv_bias[...].astype(dt)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # (B, T, H/tp, hd)
        return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                            implementation=cfg.attention_impl(dt))

    def row_kernel(self, dt):
        return self.out_kernel[...].astype(dt)  # (H/tp, hd, d)


class MLP(_TPSublayer, nnx.Module):
    """GELU MLP; hidden units split over "tp" (up column-, down row-parallel)."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        d, ff = cfg.d_model, cfg.ff
        self.cfg = cfg
        self.up_kernel = nnx.Param(_normal(rngs, (d, ff), 0.02), pspec=(None, TP))
        self.up_bias = nnx.Param(np.zeros((ff,), np.float32), pspec=(TP,))
        self.down_kernel = nnx.Param(_normal(rngs, (ff, d), 0.02 / math.sqrt(2 * cfg.n_layer)),
                                     pspec=(TP, None))
        self.down_bias = nnx.Param(np.zeros((d,), np.float32))

    def bias(self, dt):
        return self.down_bias[...].astype(dt)

    def column_kernel(self, dt):
        return self.up_kernel[...].astype(dt)  # (d, ff/tp)

    def inner(self, h):
        """(B, T, ff/tp) -> the hidden activations (B, T, ff/tp)."""
        return jax.nn.gelu(h + self.up_bias[...].astype(self.cfg.compute_dtype),
                           approximate=True)

    def row_kernel(self, dt):
        return self.down_kernel[...].astype(dt)  # (ff/tp, d): partial sums over the shards


def f_site(x, ln, sites: SiteCodecs, state, codec=None):
    """LayerNorm + Megatron f with error feedback -> (ln(x) varying over "tp", state).
    Identity forward; backward, the all-reduce of the cotangent (the backward codec)
    subtracts the error the later backward site left and leaves its own. The site sits
    *before* `ln`, on the stream itself, so its error lands directly in the stream's
    cotangent, where the next backward site cancels it. Without backward feedback
    (model.feedback_bwd=false, the default, or an exact backward codec): plain pvary after
    `ln` (as without feedback), and the state passes through. codec: this site's codec
    (default sites.bwd; the LM head passes sites.head); an exact one also means plain pvary."""
    codec = sites.bwd if codec is None else codec
    if not sites.feedback_bwd or is_exact(codec):
        return taco_jax.pvary(ln(x), TP, codec=codec, **sites.comm), state
    u, state = taco_jax.feedback.pvary_with_feedback(x, TP, state, codec=codec, **sites.comm)
    return ln(u), state


def g_site(y, sites: SiteCodecs, state):
    """Megatron g with error feedback: all-reduce (forward codec) of y minus this device's
    share of the previous site's error -> (sum, state holding this site's error share)."""
    if is_exact(sites.fwd):
        return taco_jax.psum(y, TP, codec=sites.fwd, **sites.comm), state
    return taco_jax.feedback.psum_with_feedback(y, TP, state, codec=sites.fwd, **sites.comm)


def feedback_zeros(x) -> taco_jax.feedback.FeedbackState:
    """A fresh FeedbackState for the stream x (varying over "tp" and over "data")."""
    return taco_jax.feedback.zeros_like(x, TP)


class Block(nnx.Module):
    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.ln1 = LayerNorm(cfg)
        self.attn = Attention(cfg, rngs)
        self.ln2 = LayerNorm(cfg)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x, state=None):
        """x: (B, T, d) fp32 residual stream; branches add in compute dtype. With a
        FeedbackState (model.feedback): -> (x, state), the state threaded through the
        block's four sites in forward order."""
        if state is None:
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))
        sites = site_codecs(self.cfg)
        for ln, branch in ((self.ln1, self.attn), (self.ln2, self.mlp)):
            h, state = f_site(x, ln, sites, state)
            y, state = g_site(branch.partial(h), sites, state)
            x = x + add_bias(y, branch.bias(self.cfg.compute_dtype))
        return x, state


class GPT(nnx.Module):
    """`rngs`: nnx.Rngs (jax.random init) or a numpy Generator (host init, no compilation).
    `layers`: the blocks this module holds (default model.n_layer); a pipeline's module of
    embeddings and head holds none, its blocks living in stacked per-stage arrays
    (models/parallel.py)."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs | np.random.Generator,
                 layers: int | None = None):
        self.cfg = cfg
        self.wte = nnx.Param(_normal(rngs, (cfg.vocab_size, cfg.d_model), 0.02))
        self.wpe = nnx.Param(_normal(rngs, (cfg.seq_len, cfg.d_model), 0.01))
        n = cfg.n_layer if layers is None else layers
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(n)])
        self.ln_f = LayerNorm(cfg)
        self.lm_head = nnx.Param(_normal(rngs, (cfg.d_model, cfg.vocab_size), 0.02),
                                 pspec=(None, TP))

    def embed(self, tokens):
        """tokens (B, T) int32 -> the residual stream (B, T, d) fp32, as in AMP; with
        sequence parallelism this device's part of it, (B, T/tp, d) (its tokens are
        embedded: the embeddings' gradients are then summed over "tp" as the other
        replicated parameters' are, rather than the stream's cotangent)."""
        tokens, part = sequence_part(tokens, self.cfg)
        return self.wte[...][tokens] + part(self.wpe[...], 0)

    def head(self, x):
        """Stream (B, T, d) -> local logits (B, T, V/tp) fp32: final LayerNorm, the LM
        head's f (with sequence parallelism the all-gather of the sequence), the
        vocab-parallel matmul."""
        sites = site_codecs(self.cfg)
        if self.cfg.sequence_parallel:
            x = taco_jax.all_gather(self.ln_f(x), TP, axis=1, tiled=True, codec=sites.head,
                                    **sites.comm)
        else:
            x = taco_jax.pvary(self.ln_f(x), TP, codec=sites.head, **sites.comm)
        return self.logits(x)

    def logits(self, x):
        """f's output (B, T, d), varying over "tp" -> this device's vocab shard of logits."""
        return jnp.einsum("btd,dv->btv", x, self.lm_head[...].astype(self.cfg.compute_dtype),
                          preferred_element_type=jnp.float32)

    def __call__(self, tokens):
        """tokens (B, T) int32 -> local logits (B, T, V/tp) fp32, vocab shard of this device."""
        cfg = self.cfg
        x = self.embed(tokens)
        if cfg.feedback:  # per-pass state: zeros here, dropped at the end (docs/training.md)
            state = feedback_zeros(x)
            for block in self.blocks:
                x, state = block(x, state)
            # f of the LM head: first backward site
            sites = site_codecs(cfg)
            x, _ = f_site(x, self.ln_f, sites, state, codec=sites.head)
            return self.logits(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def loss(self, tokens, targets):
        """Mean next-token cross-entropy over this device's tokens (invariant over "tp")."""
        return vocab_parallel_xent(self(tokens), targets).mean()


def sequence_part(tokens, cfg: GPTConfig):
    """tokens (B, T) int32 -> (the tokens this device embeds, `part`): all of them, or with
    sequence parallelism its part of the sequence, (B, T/tp); part(v, dim) is the same
    part of the first T positions of v along `dim` (a table of positions). Under emulated
    TP a member's part is a static slice (`members.take`): one at an offset from its index
    would be a gather over every member. Raises ValueError if T exceeds model.seq_len or
    (sequence parallelism) tp does not divide it."""
    t = tokens.shape[1]
    if t > cfg.seq_len:
        raise ValueError(f"sequence length {t} > model.seq_len={cfg.seq_len}")
    if not cfg.sequence_parallel:
        return tokens, lambda v, dim: lax.slice_in_dim(v, 0, t, axis=dim)
    n = lax.axis_size(TP)
    if t % n:
        raise ValueError(f"sequence length {t} is not divisible by tp={n} "
                         f"(model.sequence_parallel)")
    k = t // n

    def part(v, dim):
        return members.take(v, (TP,), lambda me: me * k, k, dim)
    return part(tokens, 1), part


def vocab_parallel_xent(logits, targets, axis: str = TP):
    """Cross-entropy with logits split over `axis` along the vocabulary (Megatron).

    logits: (B, T, V/P) fp32, this device's vocab shard [i*V/P, (i+1)*V/P); targets: (B, T).
    Returns (B, T) losses, identical on every device of `axis`.
    """
    v_local = logits.shape[-1]
    start = lax.axis_index(axis) * v_local
    # The max only stabilises exp; logsumexp does not depend on it, so no gradient through it.
    m = lax.pmax(lax.stop_gradient(logits.max(-1)), axis)  # (B, T)
    sum_exp = lax.psum(jnp.exp(logits - m[..., None]).sum(-1), axis)
    local = targets - start
    mine = (local >= 0) & (local < v_local)
    picked = jnp.take_along_axis(logits, jnp.clip(local, 0, v_local - 1)[..., None], -1)[..., 0]
    target_logit = lax.psum(jnp.where(mine, picked, 0.0), axis)
    return m + jnp.log(sum_exp) - target_logit
