"""The "fused" transport: compressed bytes move by in-kernel stores into the peers' memory.

On GPUs of one process (NVLink or PCIe peer access), a Pallas Mosaic GPU kernel writes
each device's wire buffer straight into its peers' receive buffers (`plgpu.remote_ref`, TMA
stores) and signals them with semaphores: no NCCL call, no all-to-all / all-gather launch.
Only unicast stores are used (never NVLink multicast).

Schedules, by axis size P:
  * P = 2, one-shot: each device compresses its whole tensor once, pushes it to the peer,
    and both decode the two buffers and sum them in device order (`decode_sum`): one
    quantization per element, one exchange, bit-identical results.
  * P ≥ 3, two-shot: the segments of the compressed tensor go to their owners (an
    all-to-all by remote stores), each owner decodes P − 1 copies, adds its exact part and
    re-encodes once (`kernels.reduce`), and the sums go to everyone (an all-gather by
    remote stores): at most two quantizations per element, as the xla transport's.

`exchange` is the communication kernel; the schedules (`two_shot.one_shot`,
`two_shot.two_shot`) take it as an argument, so the same schedules run with lax's
all-gather / all-to-all in its place (`two_shot.lax_exchange`), which is how they are
tested on CPU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from taco_jax.collectives import axes as axes_lib

LINE = 256                   # bytes per row of the byte view (TMA copies ≤ 256 per dim)
TILE_ROWS = 128              # rows per TMA copy: 32 KiB of shared memory per program
TILE_BYTES = TILE_ROWS * LINE
MAX_PROGRAMS = 132           # one program per SM of an H100 / H200
# A ready handshake before the first remote store (`exchange`); off as in jax's own collective
# kernels until two GPUs measure both (`python -m bench.fused` times each).
HANDSHAKE = False


# -- availability ---------------------------------------------------------------------
def _platform_reason() -> str | None:
    if jax.default_backend() != "gpu":
        return f"platform {jax.default_backend()!r} (needs GPUs)"
    if jax.process_count() > 1:
        # A mesh over several processes would need NCCL symmetric memory and multicast
        # addresses for its arguments; NVLink multicast is not used.
        return "several processes (needs one process driving every GPU of the axis)"
    return None


def unavailable_reason(axes: tuple) -> str | None:
    """Why the fused transport cannot run over `axes` here (None: it can). Trace time."""
    if axes_lib.emulated(axes):
        return "axis bound by jax.vmap, not by a mesh"
    if len(axes) != 1:
        return "a tuple of axes (the fused kernels address peers along one axis)"
    mesh = jax.sharding.get_abstract_mesh()
    if any(size > 1 for name, size in mesh.shape.items() if name not in axes):
        return "other mesh axes of size > 1 (the fused kernels address peers on 1-D meshes)"
    return _platform_reason()


def mesh_unavailable_reason(mesh) -> str | None:
    """`unavailable_reason` for a concrete mesh, outside tracing (calibration)."""
    if sum(size > 1 for size in mesh.shape.values()) > 1:
        return "other mesh axes of size > 1"
    ids = [d.id for d in mesh.devices.flat]
    if ids != sorted(ids):
        return "mesh devices not in id order (Mosaic GPU addresses peers by mesh index)"
    return _platform_reason()


# -- the communication kernel -----------------------------------------------------------
def _exchange_body(send_ref, recv_ref, smem, bar, sem, ready, *, axis, p, gather, tiles, nprog,
                   handshake):
    """Program b copies tiles b, b + nprog, … (TILE_ROWS rows of LINE bytes): for each peer,
    through shared memory into the peer's receive buffer (slot `me`); then signals that
    peer's program b and waits for all P − 1 peers' program b. When every program has
    passed its wait, recv is complete. handshake: first signal every peer's program b on
    `ready` and wait for theirs, so no store reaches a peer whose kernel has not started
    (as jax's remote-copy tests do; jax's collective kernels rely on XLA instead)."""
    me = lax.axis_index(axis)
    b = lax.axis_index("prog")
    if handshake and p > 1:
        for k in range(1, p):
            pl.semaphore_signal(ready, 1, device_id=(me + k) % p)
        pl.semaphore_wait(ready, p - 1)
    for k in range(p):                       # k = 0: this device's own slot, locally
        dst = (me + k) % p
        src = send_ref if gather else send_ref.at[dst]
        out = recv_ref if k == 0 else plgpu.remote_ref(recv_ref, dst)

        @pl.loop(b, tiles, step=nprog)
        def _(i):
            rows = pl.ds(pl.multiple_of(i * TILE_ROWS, TILE_ROWS), TILE_ROWS)
            plgpu.copy_gmem_to_smem(src.at[rows], smem, bar)
            plgpu.barrier_wait(bar)
            plgpu.copy_smem_to_gmem(smem, out.at[me, rows])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # smem reusable
    plgpu.wait_smem_to_gmem(0)            # every store has landed before the signals
    for k in range(1, p):
        pl.semaphore_signal(sem, 1, device_id=(me + k) % p)
    if p > 1:
        pl.semaphore_wait(sem, p - 1)


def _kernel_exchange(send, axis, p: int, gather: bool, out_mat, handshake: bool = False):
    """send (m,) or (P, m) uint8, m a multiple of TILE_BYTES → (P, m)."""
    m = send.shape[-1]
    lines = send.reshape(*send.shape[:-1], m // LINE, LINE)         # (…, rows, LINE)
    tiles = m // TILE_BYTES
    nprog = min(MAX_PROGRAMS, tiles)
    body = functools.partial(_exchange_body, axis=axis, p=p, gather=gather, tiles=tiles,
                             nprog=nprog, handshake=handshake)
    shape = (p, m // LINE, LINE)
    out = (jax.ShapeDtypeStruct(shape, jnp.uint8) if out_mat is None else
           jax.ShapeDtypeStruct(shape, jnp.uint8, manual_axis_type=out_mat))
    kernel = plgpu.kernel(
        body, out_type=out,
        scratch_types=[plgpu.SMEM((TILE_ROWS, LINE), jnp.uint8), plgpu.Barrier(),
                       plgpu.SemaphoreType.REGULAR, plgpu.SemaphoreType.REGULAR],
        grid=(nprog,), grid_names=("prog",))
    return kernel(lines).reshape(p, m)


def exchange(send, axis, p: int, *, gather: bool, vma: bool, handshake: bool | None = None):
    """`two_shot.lax_exchange` by in-kernel stores: gather=True: send (…) → (P, …), row j
    from device j; gather=False: send (P, …) → (P, …), row j = device j's send[me]. Any
    dtype: the bytes travel as they are. handshake: a ready signal between the programs
    before the first remote store (None: HANDSHAKE)."""
    handshake = HANDSHAKE if handshake is None else handshake
    lead = () if gather else send.shape[:1]
    item_shape = send.shape[len(lead):]
    raw = lax.bitcast_convert_type(send, jnp.uint8) if send.dtype != jnp.uint8 else send
    flat = raw.reshape(*lead, -1)                                    # (m,) or (P, m)
    width = flat.shape[-1]
    pad = (-width) % TILE_BYTES
    if pad:
        flat = jnp.pad(flat, [(0, 0)] * len(lead) + [(0, pad)])
    mat = getattr(jax.typeof(send), "manual_axis_type", None)
    if mat is not None and vma and gather:    # every device holds the same bytes after it
        mat = mat.update(varying=frozenset(mat.varying) - {axis})
    got = _kernel_exchange(flat, axis, p, gather, mat, handshake)[:, :width]   # (P, width)
    if send.dtype != jnp.uint8:
        got = lax.bitcast_convert_type(
            got.reshape(p, *item_shape, send.dtype.itemsize), send.dtype)
    return got.reshape(p, *item_shape)
