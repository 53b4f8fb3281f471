"""The "fused" transport: compressed bytes move by in-kernel stores into the peers' memory.

On GPUs of one process (NVLink or PCIe peer access), Pallas Mosaic GPU kernels write
straight into their peers' receive buffers (`plgpu.remote_ref`, TMA stores) and signal them
with semaphores: no NCCL call, no all-to-all / all-gather launch. Only unicast stores are
used (never NVLink multicast). Peers are addressed by mesh axis name, so the axis may sit in
a mesh with other axes (a (data, pipe, tp) mesh); Mosaic needs the mesh's devices listed as
0..n−1 in order.

Schedules, by axis size P (`allreduce`):
  * one launch (`one_launch`), where its kernel covers the codec and dtype and its
    loopback checks passed on a GPU for the module it emits now (`kernels.fused.checked`,
    per kernel, codec and dtype): at P = 2 the one-shot (`kernels.fused.one_shot`:
    each device encodes its tiles, stores them into its own and the peer's receive
    buffers, signals per tile and decodes both contributions in device order; one
    quantization per element), at P ≥ 3 the two-shot (`kernels.fused.two_shot`: segments
    to their owners, the owners' sums encoded once and stored to every device; at most
    two quantizations). Every device decodes the same bytes: bit-identical results.
  * otherwise the schedules of `two_shot` with `exchange` (an all-gather or all-to-all by
    remote stores) carrying the bytes between the separate compress and decode kernels;
    codec "none" is the exact one-shot. Telemetry names such an all-reduce's transport
    "fused (separate kernels): <why not one launch>".
Under `jax.vmap` (emulated tensor parallelism) on a GPU the one-launch kernels run as their
loopback (`loopback`): the vmap members are the virtual devices of one launch, so an
emulated step runs the same kernels and protocol; the other schedules keep their kernels
and leave the exchange to the vmap (telemetry names the transport "fused (loopback)" and
"fused (exchange emulated)", an all-reduce's "fused (separate kernels, exchange emulated):
<why>").

XLA zeroes a kernel's semaphores and runs a cross-device barrier before it (the kernels
never set `skip_device_barrier`), so no store reaches a peer whose previous call is still
reading its receive buffer.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from taco_jax import telemetry
from taco_jax.collectives import axes as axes_lib, members
from taco_jax.kernels import fused as kernels
from taco_jax.kernels.fused import checked
from taco_jax.kernels.fused.exchange import TILE_BYTES, exchange_kernel
from taco_jax.kernels.mosaic import BLOCK, ROWS


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
    """Why the fused transport cannot run over `axes` here (None: it can). Trace time.
    The device order of the mesh is checked where the mesh is concrete
    (`mesh_unavailable_reason`; Mosaic's lowering refuses any other order). An axis bound
    by `jax.vmap` (emulated tensor parallelism) takes the loopback: the members are the
    virtual devices of one launch on this GPU (`loopback`)."""
    if len(axes) != 1:
        return "a tuple of axes (the fused kernels address peers along one axis)"
    if axes_lib.emulated(axes) and jax.default_backend() != "gpu":
        return (f"axis bound by jax.vmap on platform {jax.default_backend()!r} (the "
                f"loopback over vmap members needs a GPU)")
    return _platform_reason()


def mesh_unavailable_reason(mesh) -> str | None:
    """`unavailable_reason` for a concrete mesh, outside tracing (calibration)."""
    ids = [d.id for d in mesh.devices.flat]
    if ids != list(range(len(ids))):
        return (f"mesh devices {ids} are not 0..{len(ids) - 1} in order (Mosaic GPU "
                f"addresses peers by mesh position)")
    return _platform_reason()


# -- one launch ---------------------------------------------------------------------------
def one_launch_kernel(p: int) -> str:
    """The one-launch all-reduce at axis size P: the one-shot at P = 2 (each element
    quantized once), the two-shot beyond (at most twice, 2(P − 1)/P of the codes sent)."""
    return "one_shot" if p == 2 else "two_shot"


def one_launch_reason(codec, p: int, dtype) -> str | None:
    """Why `one_launch` does not run this all-reduce (None: it does): its kernel does not
    cover the codec, P or dtype (`kernels.fused.unsupported`), or does but its loopback
    checks have not passed on a GPU for this kernel, codec and dtype as it is emitted now
    (`kernels.fused.checked`)."""
    if p < 2:
        return f"P={p}"
    kernel = one_launch_kernel(p)
    return kernels.unsupported(codec, p, dtype) or checked.unchecked(kernel, codec, dtype)


def one_launch_wire_bytes(codec, p: int, n: int) -> int:
    """Bytes one device sends in one call of `one_launch` on n values: the one-shot sends
    its codes to its peer; the two-shot P − 1 of its P segments, then its owned segment's
    codes to P − 1 peers (whole tiles of 64 rows of 256 values per segment; a row is
    256 / B codec blocks on the wire)."""
    n_blocks = -(-n // codec.block_size)
    if one_launch_kernel(p) == "one_shot":
        return (p - 1) * n_blocks * codec.row_bytes
    seg_rows = -(-max(n, 1) // (p * ROWS * BLOCK)) * ROWS
    return 2 * (p - 1) * seg_rows * (BLOCK // codec.block_size) * codec.row_bytes


def one_launch(x, axis, codec, p: int, vma: bool):
    """The compressed all-reduce of x over `axis` in one kernel (`one_launch_kernel`): over
    a mesh axis, the peers' memory by remote stores; over a jax.vmap axis, the loopback
    (`loopback`)."""
    if axes_lib.emulated(axes_lib.as_tuple(axis)):
        y = loopback(x, axis, codec, p, vma)
    else:
        mat = getattr(jax.typeof(x), "manual_axis_type", None)
        if mat is not None and vma:       # every device holds the same bits after it
            mat = mat.update(varying=frozenset(mat.varying) - {axis})
        kernel = (kernels.one_shot_allreduce if one_launch_kernel(p) == "one_shot"
                  else kernels.two_shot_allreduce)
        y = kernel(x, axis, p, codec, out_mat=mat)
    if telemetry.enabled():
        telemetry.report("psum", x, y, axis, codec,
                         wire_bytes=one_launch_wire_bytes(codec, p, x.size))
    return y


# -- the loopback over the members of a jax.vmap axis --------------------------------------
def loopback(x, axis, codec, p: int, vma: bool):
    """`one_launch` for emulated tensor parallelism: the P members of the vmap axis `axis`
    are the P virtual devices of one launch of the same kernel on this GPU (its loopback:
    device d's receive buffers and semaphores are slices of one buffer), so an emulated
    step runs the kernels, tile math and protocol a P-GPU step runs. Under vmap x is every
    member's input; the members' inputs travel as one (P, …) array. Member d gets row d of
    the kernel's (P, …) result; under the check_vma convention (vma) the result is one
    value shared by the members, as a psum's is there, so its cotangent arrives summed:
    row 0 (the kernel's loopback checks assert all rows are the same bits)."""
    xs = lax.all_gather(x, axis)          # under vmap: the members' inputs, one array
    kernel = (kernels.one_shot_loopback if one_launch_kernel(p) == "one_shot"
              else kernels.two_shot_loopback)
    ys = LOOPBACK_KERNELS.get(kernel, kernel)(xs, codec)
    return ys[0] if vma else members.to_members(ys, axes_lib.as_tuple(axis))


# The loopback's kernels by the function a test may stand in for them (a CPU test runs the
# same collective code with the kernels' jnp models, which Mosaic GPU cannot interpret).
LOOPBACK_KERNELS: dict = {}


def exchange(send, axis, p: int, *, gather: bool, vma: bool):
    """`two_shot.lax_exchange` by in-kernel stores: gather=True: send (…) → (P, …), row j
    from device j; gather=False: send (P, …) → (P, …), row j = device j's send[me]. Any
    dtype: the bytes travel as they are."""
    lead = () if gather else send.shape[:1]
    item_shape = send.shape[len(lead):]
    if send.size == 0:
        return jnp.zeros((p, *item_shape), send.dtype)
    raw = lax.bitcast_convert_type(send, jnp.uint8) if send.dtype != jnp.uint8 else send
    flat = raw.reshape(*lead, -1)                                    # (m,) or (P, m)
    width = flat.shape[-1]
    pad = (-width) % TILE_BYTES
    if pad:
        flat = jnp.pad(flat, [(0, 0)] * len(lead) + [(0, pad)])
    mat = getattr(jax.typeof(send), "manual_axis_type", None)
    if mat is not None and vma and gather:    # every device holds the same bytes after it
        mat = mat.update(varying=frozenset(mat.varying) - {axis})
    got = exchange_kernel(flat, axis, p, gather, mat)
    if pad:
        got = got[:, :width]                                         # (P, width)
    if send.dtype != jnp.uint8:
        got = lax.bitcast_convert_type(
            got.reshape(p, *item_shape, send.dtype.itemsize), send.dtype)
    return got.reshape(p, *item_shape)
