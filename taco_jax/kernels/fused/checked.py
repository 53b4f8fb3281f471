"""What the fused transport selects: a one-launch kernel ("one_shot", "two_shot"; the
row-parallel GEMMs' "gemm_all", "gemm_owner") for a codec and input dtype only where its
loopback checks passed on a GPU for the kernel it emits now.

A configuration (kernel, codec, dtype, P) is known by the fingerprint of what it emits
(`fingerprint`): the Mosaic GPU module of its loopback kernel at its default launch, lowered
for CUDA on any machine (a CPU does), hashed without source locations or names. Two
lowerings with the same fingerprint run the same code, whatever the sources that made them.

`CHECKED` maps each checked (kernel, codec name, dtype name) to the (P, fingerprint) pairs
whose check rows passed on a GPU, and `JAX` names the jax whose lowering the fingerprints
are of. A call is admitted where its triple is in CHECKED, the codec is its name's
registered configuration and the installed jax is JAX; elsewhere the fused transport runs
the separate kernels (`collectives.fused`), and telemetry names the transport "fused
(separate kernels): why". The CPU test `tests/kernels/test_fused_checked.py` recomputes
every fingerprint of the table (`stale`) and fails, naming the configuration, when a change
to the code changes a module the table still claims as checked; a change that emits the
same modules keeps the fused path selected.

Both constants are written by `python -m bench.fused --write-checked` from the committed
check rows (bench/results/fused*.json; the GEMMs' bench/results/gemm_codec_checks*.json),
each row naming the fingerprint it ran at; a GPU run of `bash bench/gpu_run.sh fused_checks`
(the GEMMs': `gemm_codec`) adds rows at the current fingerprints. A triple is checked where
every row of it at a current fingerprint passed, and some ran at a P the collectives take
the kernel at (the one-shot at P = 2, the two-shot at P ≥ 3, the GEMMs at P ≥ 2:
`bench.fused.checked_table`)."""
from __future__ import annotations

import functools
import hashlib

import jax
import jax.numpy as jnp

from taco_jax import codec_registry

# The one-launch all-reduces, and the row-parallel GEMMs of `kernels.gemm` (their two
# launches: the GEMM whose epilogue encodes and stores each tile's wire, then the decode,
# sum and residual add) by exchange: "gemm_all" (every tile to every device: the
# all-reduce), "gemm_owner" (each tile to the owner of its rows: the reduce-scatter).
KERNELS = ("one_shot", "two_shot", "gemm_all", "gemm_owner")
GEMM_KERNELS = ("gemm_all", "gemm_owner")
# The size a fingerprint lowers each device's input at: odd, so the last tile is padded.
FINGERPRINT_ELEMENTS = (1 << 20) + 5
# The GEMMs' (M, K, N) per device: 16 row tiles (M / 64 divisible by every P ≤ 8, so each
# owner has whole tiles), 5 K steps, 3 column tiles.
FINGERPRINT_GEMM = (1024, 320, 768)
RECHECK = "bash bench/gpu_run.sh fused_checks, then python -m bench.fused --write-checked"
RECHECK_GEMM = "bash bench/gpu_run.sh gemm_codec, then python -m bench.fused --write-checked"


def recheck(kernel: str) -> str:
    """The GPU step whose check rows admit `kernel`, then the table's rewrite."""
    return RECHECK_GEMM if kernel in GEMM_KERNELS else RECHECK


def fingerprint(kernel: str, codec, dtype, p: int) -> str:
    """12 hex digits of sha256 over the Mosaic GPU module(s) that `kernel`'s loopback at its
    default launch emits for P devices, this codec and input dtype
    (`_jax_private.mosaic_gpu_modules`: no locations, no names of dump files), lowered for
    CUDA with the installed jax: the all-reduces' on FINGERPRINT_ELEMENTS values a device,
    the GEMMs' (`kernels.gemm.loopback_gemm_allreduce`, both launches) at FINGERPRINT_GEMM.
    Takes a second or two on a CPU; cached per process."""
    return _fingerprint(kernel, codec, jnp.dtype(dtype).name, int(p))


@functools.cache
def _fingerprint(kernel: str, codec, dtype: str, p: int) -> str:
    from taco_jax import _jax_private
    if kernel in GEMM_KERNELS:
        from taco_jax.kernels.gemm import row_parallel
        m, k, n = FINGERPRINT_GEMM
        args = [jax.ShapeDtypeStruct(s, jnp.dtype(dtype)) for s in ((p, m, k), (p, k, n), (m, n))]
        fn = lambda xs, ws, r: row_parallel.loopback_gemm_allreduce(   # noqa: E731
            xs, ws, r, codec, scatter=kernel == "gemm_owner")
    else:
        from taco_jax.kernels.fused import one_shot, two_shot
        launch = {"one_shot": one_shot.one_shot_loopback,
                  "two_shot": two_shot.two_shot_loopback}[kernel]
        args = [jax.ShapeDtypeStruct((p, FINGERPRINT_ELEMENTS), jnp.dtype(dtype))]
        fn = lambda v: launch(v, codec)                                # noqa: E731
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    modules = _jax_private.mosaic_gpu_modules(lowered)
    if not modules:
        raise RuntimeError(f"{kernel} {codec.name} {dtype} P={p} lowered no Mosaic GPU kernel")
    h = hashlib.sha256()
    for text in modules:
        h.update(text.encode() + b"\0")
    return h.hexdigest()[:12]


def unchecked(kernel: str, codec, dtype) -> str | None:
    """Why the collectives do not select `kernel` for this codec and input dtype (None: its
    loopback checks passed on a GPU for the modules in `CHECKED`, lowered by this jax)."""
    name, dt = codec.name, jnp.dtype(dtype).name
    known = name in codec_registry.names() and codec == codec_registry.get(name)
    what = f"{name}" if known else f"{name} (not its registered configuration)"
    if known and (kernel, name, dt) in CHECKED:
        if jax.__version__ == JAX:
            return None
        return (f"the {_what(kernel)} for {name}, {dt} was checked as jax {JAX} lowers it, "
                f"not jax {jax.__version__}")
    return (f"the {_what(kernel)} has no passing loopback checks on a GPU for {what}, {dt} "
            f"as it is emitted now ({recheck(kernel)})")


def _what(kernel: str) -> str:
    if kernel in GEMM_KERNELS:
        return f"row-parallel GEMM kernel (exchange {kernel.split('_')[1]!r})"
    return f"one-launch {kernel.replace('_', '-')} kernel"


def stale(table: dict | None = None) -> list[str]:
    """The configurations of `table` (default CHECKED) whose module this checkout emits
    differs from the one checked, one line each naming it and the GPU step that re-checks
    it; [] where every fingerprint matches. Lowers each configuration (a second or two)."""
    out = []
    for (kernel, name, dt), pairs in sorted((CHECKED if table is None else table).items()):
        codec = codec_registry.get(name)
        for p, checked_fp in pairs:
            now = fingerprint(kernel, codec, dt, p)
            if now != checked_fp:
                out.append(f"{kernel} {name} {dt} P={p}: emits {now}, checked {checked_fp}; "
                           f"re-check it on a GPU: {recheck(kernel)}")
    return out


# -- the table: written by `python -m bench.fused --write-checked` from the check rows
JAX = "0.11.2"
CHECKED = {
    ('one_shot', 'echo4', 'bfloat16'): ((2, '1a9903ee1053'),),
    ('one_shot', 'echo4', 'float16'): ((2, 'cfbdbb0f6e4b'),),
    ('one_shot', 'echo4', 'float32'): ((2, '1f487785ce0a'),),
    ('one_shot', 'taco', 'bfloat16'): ((2, 'eb8dd08b6878'),),
    ('one_shot', 'taco', 'float16'): ((2, '354c0721fb38'),),
    ('one_shot', 'taco', 'float32'): ((2, '1279fdbc7a27'),),
    ('one_shot', 'taco-1scale', 'bfloat16'): ((2, 'f61e0be5bc8d'),),
    ('one_shot', 'taco-1scale', 'float16'): ((2, '2c1373b0e6fb'),),
    ('one_shot', 'taco-1scale', 'float32'): ((2, '7cd8e2283c97'),),
    ('one_shot', 'taco-e5m2', 'bfloat16'): ((2, 'eb48b9ccdcbc'),),
    ('one_shot', 'taco-e5m2', 'float16'): ((2, 'aa94b83d9224'),),
    ('one_shot', 'taco-e5m2', 'float32'): ((2, '40d379b0d1a1'),),
    ('two_shot', 'echo4', 'bfloat16'): ((3, '5c291dac2358'), (4, '553039e87c85'), (8, '39ec38b6dcd7')),
    ('two_shot', 'echo4', 'float16'): ((3, '50d88ae16605'), (4, '847fb94d14e8'), (8, '3201000e8e9b')),
    ('two_shot', 'echo4', 'float32'): ((3, '0450ecb5e0c9'), (4, '6fefc41f3621'), (8, 'e8b82f65ae6c')),
    ('two_shot', 'taco', 'bfloat16'): ((3, 'dd81ce1aa125'), (4, '548df34119e9'), (8, 'bbfc4d4fe4b1')),
    ('two_shot', 'taco', 'float16'): ((3, 'f5e6e59a0962'), (4, '43e154055015'), (8, '9c9860b444b9')),
    ('two_shot', 'taco', 'float32'): ((3, 'da7b897292e4'), (4, '07c5d89e6658'), (8, 'be073cbb4762')),
    ('two_shot', 'taco-1scale', 'bfloat16'): ((3, 'f34f6231102a'), (4, '35e8204f6149'), (8, '78805da2db95')),
    ('two_shot', 'taco-1scale', 'float16'): ((3, 'ffa5b5d963b5'), (4, '222522275414'), (8, '5a86245e1352')),
    ('two_shot', 'taco-1scale', 'float32'): ((3, '1541bd3694cc'), (4, 'aa9f07139733'), (8, '74981cb7514f')),
}
