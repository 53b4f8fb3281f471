"""What the fused-kernel tests share: `lowered_psum` (taco_jax.psum over the fused transport
on a mesh, lowered for CUDA, once per run), `assumed_checked` (the one-launch kernels, or
with GEMM_COVERED the row-parallel GEMMs, selected as if their GPU checks had passed),
`scratch_bytes` (a Mosaic kernel's shared memory as the lowering allocates it) and `rel_l2`
(the `gpu_here` and `all_checked` fixtures are in conftest.py)."""
import contextlib
import functools
import re
from unittest import mock

import numpy as np

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import taco_jax

# A lowering is computed once per run (several tests lower the same call: each a second or
# more of Mosaic GPU lowering); a test that patches what a lowering reads calls `__wrapped__`.
cached = functools.lru_cache(maxsize=None)


# every (kernel, codec, dtype) the one-launch kernels cover
COVERED = tuple((k, c, d) for k in ("one_shot", "two_shot")
                for c in ("taco", "taco-e5m2", "taco-1scale", "echo4")
                for d in ("bfloat16", "float16", "float32"))


# every (kernel, codec, dtype) the row-parallel GEMMs cover (their tile codecs, 16-bit input)
GEMM_COVERED = tuple((k, c, d) for k in ("gemm_all", "gemm_owner") for c in ("taco", "echo4")
                     for d in ("bfloat16", "float16"))


@contextlib.contextmanager
def assumed_checked(triples=COVERED):
    """The fused transport selects the one-launch kernels for `triples` ((kernel, codec name,
    dtype name); default: every one they cover) as if their loopback checks had passed on
    a GPU for the modules emitted now: what a CPU test checks is the lowering the selection
    leads to (the checks themselves run on a GPU, `python -m bench.fused`)."""
    from taco_jax.kernels.fused import checked
    with mock.patch.multiple(checked, JAX=jax.__version__, CHECKED=assumed_table(triples)):
        yield


def assumed_table(triples=COVERED) -> dict:
    """A checked table (`kernels.fused.checked.CHECKED`) holding `triples`, at fingerprints
    that no module has: what selection reads, without the modules' own check."""
    return {t: ((3 if t[0] == "two_shot" else 2, "assumed"),) for t in triples}


@cached
def lowered_psum(shape, names, axis, vma, dtype=jnp.bfloat16, codec="taco", checked=COVERED):
    """HLO text of taco_jax.psum(transport="fused") over `axis` of a mesh `names` → shape,
    lowered for CUDA; every other axis shards the input too. `checked`: the triples the
    selection takes as checked (`assumed_checked`)."""
    with assumed_checked(checked):
        return _lowered_psum(shape, names, axis, vma, dtype, codec)


def _lowered_psum(shape, names, axis, vma, dtype, codec):
    n = int(np.prod(shape))
    mesh = jax.make_mesh(shape, names, devices=jax.devices()[:n])
    spec = P(names)

    def body(v):
        y = taco_jax.psum(v[0], axis, min_bytes=0, transport="fused", codec=codec)
        return y[None]
    out_spec = P(tuple(a for a in names if a != axis)) if vma else spec
    f = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=out_spec, check_vma=vma)
    x = jax.ShapeDtypeStruct((n, 3, 5000), dtype, sharding=NamedSharding(mesh, spec))
    return jax.jit(f).trace(x).lower(lowering_platforms=("cuda",)).as_text()


def peer_addressed(text: str) -> list[bool]:
    """Per Mosaic GPU launch of a lowered module, in order: does it address other devices'
    buffers (XLA's collective metadata, through which remote stores and peer semaphores
    translate their addresses)?"""
    return [re.search(r"uses_xla_collective_metadata = (true|false)", line).group(1) == "true"
            for line in text.splitlines() if "@mosaic_gpu_v2" in line]


def rel_l2(y, exact):
    """‖y − exact‖ / ‖exact‖ in f64."""
    y, exact = np.asarray(y, np.float64), np.asarray(exact, np.float64)
    return np.linalg.norm(y - exact) / np.linalg.norm(exact)


def scratch_bytes(monkeypatch, fn, x) -> int:
    """The shared memory Pallas allocates for the scratch of the (last) Mosaic GPU kernel in
    fn, lowered for CUDA on x (each buffer aligned to 1 KiB; the barriers not counted)."""
    from jax.experimental.mosaic.gpu import core as mgpu_core
    seen = []
    lower = mgpu_core._lower_as_gpu_kernel

    def spy(*a, **k):
        seen.append(k["smem_scratch_shape"][0].shape[0])
        return lower(*a, **k)
    monkeypatch.setattr(mgpu_core, "_lower_as_gpu_kernel", spy)
    jax.jit(fn).trace(x).lower(lowering_platforms=("cuda",))
    assert seen, "no Mosaic GPU kernel was lowered"
    return seen[-1]
