"""Every use of jax's private API in taco_jax, in this one module.

jax offers no public way to do what these functions do. Each was checked on the jax
versions in CHECKED; on another version a function that finds jax's internals changed
raises `JaxInternalsError` naming the installed version and the checked ones, instead of
failing somewhere deep in a trace. Where checked versions differ, the switch between them
is here too.

Contents:
  extend_axis_env        bind a vmap axis name again (custom_vjp backward rules)
  fragmented_array       a Mosaic GPU FragmentedArray from registers (private fields)
  tiled_layout           a canonical Mosaic GPU TiledLayout from a non-canonical spec
  mgpu_store             `ref[...] = value` in a Mosaic GPU kernel, lowered the same on
                         every checked version (planned into tiled SMEM, plain elsewhere)
  mosaic_gpu_modules     the Mosaic GPU kernels of a lowered computation, as MLIR text
"""
from __future__ import annotations

import functools
import inspect

import jax

CHECKED = ("0.11.2", "0.12.0.1", "0.12.1")


class JaxInternalsError(RuntimeError):
    """A private jax API that taco_jax relies on is missing or changed in this jax."""


def _broken(what: str, err: Exception) -> JaxInternalsError:
    return JaxInternalsError(
        f"taco_jax needs jax's private {what}, which jax {jax.__version__} does not provide "
        f"as taco_jax expects ({type(err).__name__}: {err}); taco_jax was checked on jax "
        f"{', '.join(CHECKED)}")


def _require_keywords(fn, names: tuple[str, ...], what: str) -> None:
    """Raise JaxInternalsError unless `fn` accepts every keyword in `names`."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError) as e:
        raise _broken(what, e) from None
    missing = [n for n in names if n not in params]
    if missing:
        raise _broken(what, TypeError(f"no keyword argument {', '.join(missing)}"))


def extend_axis_env(axis_name, size: int):
    """A context that binds `axis_name` with `size` for the code traced inside, as
    `jax.vmap(..., axis_name=...)` does. A custom_vjp backward rule under vmap is traced
    after the vmap's axis is unbound; its collectives need the axis bound again."""
    try:
        from jax._src import core
        return core.extend_axis_env_nd([(axis_name, size)])
    except (ImportError, AttributeError, TypeError) as e:
        raise _broken("jax._src.core.extend_axis_env_nd", e) from None


# -- Mosaic GPU ------------------------------------------------------------------------------
def _mosaic_fa():
    try:
        from jax.experimental.mosaic.gpu import fragmented_array as fa
        return fa
    except ImportError as e:
        raise _broken("jax.experimental.mosaic.gpu.fragmented_array", e) from None


@functools.cache
def _check_fragmented_array() -> None:
    fa = _mosaic_fa()
    what = "FragmentedArray(_registers=, _layout=, _is_signed=)"
    if not hasattr(fa, "FragmentedArray"):
        raise _broken(what, AttributeError("no FragmentedArray"))
    _require_keywords(fa.FragmentedArray.__init__, ("_registers", "_layout", "_is_signed"),
                      what)


def fragmented_array(registers, layout, is_signed: bool | None):
    """A Mosaic GPU `FragmentedArray` made of `registers` (a numpy object array of MLIR
    vector values, shaped `layout.registers_shape(shape)`) in `layout`. `is_signed`: None
    for floats, a bool for integers. Mosaic builds such arrays only through the
    constructor's private fields; kernels that compute in registers (inside
    `plgpu.inline_mgpu`) need it to hand back their results.

    Raises:
      JaxInternalsError: the constructor no longer takes those fields.
      ValueError, TypeError: from Mosaic, for registers that do not fit `layout`.
    """
    _check_fragmented_array()
    return _mosaic_fa().FragmentedArray(_registers=registers, _layout=layout,
                                        _is_signed=is_signed)


@functools.cache
def _check_tiled_layout() -> None:
    fa = _mosaic_fa()
    what = "TiledLayout(..., _check_canonical=False)"
    if not hasattr(getattr(fa, "TiledLayout", None), "canonicalize"):
        raise _broken(what, AttributeError("no TiledLayout.canonicalize"))
    _require_keywords(fa.TiledLayout, ("_check_canonical",), what)


def tiled_layout(tiling, warp_dims, lane_dims, vector_dim):
    """The canonical Mosaic GPU `TiledLayout` equal to the one these fields spell. Mosaic's
    public constructor accepts only canonical specs; a layout with a replicated lane dim
    is easiest written in a non-canonical form, which only the private `_check_canonical`
    flag lets through (to be canonicalized at once).

    Raises:
      JaxInternalsError: TiledLayout no longer takes `_check_canonical` or cannot
        canonicalize.
    """
    _check_tiled_layout()
    return _mosaic_fa().TiledLayout(tiling, warp_dims=warp_dims, lane_dims=lane_dims,
                                    vector_dim=vector_dim, _check_canonical=False
                                    ).canonicalize()


@functools.cache
def _untiling_transform():
    try:
        from jax._src.pallas.mosaic_gpu import core as gpu_core
        return gpu_core.UntilingTransform
    except (ImportError, AttributeError) as e:
        raise _broken("jax._src.pallas.mosaic_gpu.core.UntilingTransform", e) from None


@functools.cache
def _tiling_traced() -> bool:
    """Whether a tiled SMEM ref shows its tiling where the kernel body is traced (a view
    whose transforms hold an UntilingTransform): up to jax 0.12.0.1. From 0.12.1 a scratch
    ref is traced untransformed and its transforms are applied where the kernel is lowered
    (`GPUMemoryRef.get_ref_transforms`)."""
    try:
        from jax._src.pallas.mosaic_gpu import core as gpu_core
        ref_type = gpu_core.GPUMemoryRef
    except (ImportError, AttributeError) as e:
        raise _broken("jax._src.pallas.mosaic_gpu.core.GPUMemoryRef", e) from None
    if hasattr(ref_type, "get_ref_transforms"):
        return False
    _untiling_transform()
    return True


def _is_tiled(ref) -> bool:
    """Whether `ref` is a view of a tiled (and swizzled) SMEM buffer, where the traced ref
    shows it (`_tiling_traced`)."""
    cls = _untiling_transform()
    return any(isinstance(t, cls) for t in getattr(ref, "transforms", ()))


def mgpu_store(ref, value, *, tiled: bool = False) -> None:
    """`ref[...] = value` inside a Mosaic GPU kernel (Lane semantics), lowered as jax
    0.11.2 lowers it on every checked version.

    Args:
      ref: the destination. `tiled=True`: a view of a tiled (and swizzled) SMEM buffer;
        the store gets Mosaic's bank-conflict-free transfer plan. `tiled=False` (the
        default): any other ref (GMEM, untiled SMEM); a plain store of each register
        vector, without a plan.
      value: the registers to store (a Mosaic GPU array of `ref`'s shape).
      tiled: what `ref` is. The caller states it: from jax 0.12.1 a ref's tiling is
        applied where the kernel is lowered and cannot be seen where the store is traced.
        jax 0.12 plans untiled stores too and then refuses layouts that it cannot prove
        aligned to swizzle tiles or 32-byte sectors (e.g. rows 264 bytes apart), although
        the plain stores are correct: `plgpu.store(..., optimized=False)` keeps them plain.

    Raises:
      ValueError: `tiled` is not what `ref` is, on a jax whose traced refs show it
        (0.11.2, 0.12.0.1).
      JaxInternalsError: jax's Mosaic GPU refs no longer carry their transforms as
        taco_jax expects.
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu
    if _tiling_traced() and _is_tiled(ref) != tiled:
        raise ValueError(f"mgpu_store({tiled=}) into a ref that is "
                         f"{'not ' if tiled else ''}a view of a tiled SMEM buffer")
    store = getattr(plgpu, "store", None)
    if store is None or tiled:     # jax 0.11: `[...] =` stores untiled refs plainly
        ref[...] = value
    else:
        store(ref, value, optimized=False)


def mosaic_gpu_modules(lowered) -> list[str]:
    """The Mosaic GPU kernels of a computation lowered for CUDA (`jax.jit(f).trace(...)
    .lower(lowering_platforms=("cuda",))`), each as its module's MLIR text without source
    locations or its dump file name: what the kernel computes, and nothing of where or in
    which process it was lowered. jax serializes each kernel into its custom call's backend
    config (`module`, MLIR bytecode); this reads it back in a context with the Mosaic GPU
    dialect registered.

    Raises:
      JaxInternalsError: the custom calls no longer carry their module as taco_jax expects.
    """
    import re
    try:
        from jax._src.interpreters import mlir
        from jax._src.lib.mlir import ir
        from jax.experimental.mosaic.gpu import dialect
    except ImportError as e:
        raise _broken("Mosaic GPU's MLIR dialect and context", e) from None
    stablehlo = lowered.compiler_ir("stablehlo")
    blobs = []

    def walk(op):
        for region in op.regions:
            for block in region:
                for inner in block:
                    if inner.name == "stablehlo.custom_call" and ir.StringAttr(
                            inner.attributes["call_target_name"]).value.startswith(
                                "mosaic_gpu"):
                        try:
                            config = ir.DictAttr(inner.attributes["mhlo.backend_config"])
                            blobs.append(ir.StringAttr(config["module"]).value_bytes)
                        except (KeyError, ValueError) as e:
                            raise _broken("the Mosaic GPU custom call's backend_config "
                                          "module", e) from None
                    walk(inner)
    walk(stablehlo.operation)
    ctx = mlir.make_ir_context()
    dialect.register_dialect(ctx)
    ctx.allow_unregistered_dialects = True
    texts = []
    with ctx:
        for blob in blobs:
            text = ir.Module.parse(blob).operation.get_asm(enable_debug_info=False)
            # the dump file name counts the kernels lowered so far in this process
            texts.append(re.sub(r'mosaic_gpu\.dump_basename = "[^"]*",? ?', "", text))
    return texts
