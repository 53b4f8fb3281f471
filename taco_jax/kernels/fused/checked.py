"""What the fused transport selects: a one-launch kernel ("one_shot", "two_shot") for a codec
and input dtype only where its loopback checks passed on a GPU at this library's kernel
sources.

`CHECKED` holds the (kernel, codec name, dtype name) triples whose checks passed and
`SOURCES` the kernel sources hash they ran at (`kernel_sources_hash`: the files that
determine what the one-launch kernels compute, `KERNEL_SOURCES`). A call is admitted where
its triple is in CHECKED, SOURCES is this library's hash and the codec is its name's
registered configuration; elsewhere the fused transport runs the separate kernels
(`collectives.fused`), and telemetry names the transport "fused (separate kernels): why".
Any change to a kernel source leaves nothing checked until a GPU checks it again.

Both constants are written by `python -m bench.fused --write-checked` from the committed
check rows (bench/results/fused*.json), each row naming the kernel sources hash it ran at;
a GPU run of `bash bench/gpu_run.sh fused_checks` adds the rows at the current hash. A
triple is checked where the loopback check rows of that kernel, codec and dtype at the
hash, at the kernel's default launch, all pass and some ran at a P the collectives take the
kernel at (the one-shot at P = 2, the two-shot at P ≥ 3: `bench.fused.checked_triples`)."""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import jax.numpy as jnp

from taco_jax import codec_registry

KERNELS = ("one_shot", "two_shot")
# What determines the one-launch kernels' results, relative to the taco_jax package: their
# bodies and launch, the tile math and its registers, the codecs' parameters and numerics,
# the private jax calls; this file excepted (it holds the hash).
KERNEL_SOURCES = ("kernels/fused", "kernels/mosaic", "kernels/tile_codec.py",
                  "kernels/providers.py", "codecs/taco.py", "codecs/echo.py", "numerics",
                  "_jax_private.py")
_PACKAGE = Path(__file__).resolve().parents[2]
_THIS = "kernels/fused/checked.py"


def kernel_source_files(root: Path = _PACKAGE) -> list[Path]:
    """The files of KERNEL_SOURCES under the package directory `root`, sorted."""
    files = []
    for entry in KERNEL_SOURCES:
        path = root / entry
        files += path.rglob("*.py") if path.is_dir() else [path]
    return sorted(f for f in files if f.relative_to(root).as_posix() != _THIS)


def kernel_sources_hash(root: Path | None = None) -> str:
    """12 hex digits of sha256 over the kernel sources' paths and bytes (`KERNEL_SOURCES`)
    under the package directory `root` (None: this library's, read once): two check runs
    with the same hash checked the same kernels."""
    return _library_hash() if root is None else _hash(Path(root))


@functools.cache
def _library_hash() -> str:
    return _hash(_PACKAGE)


def _hash(root: Path) -> str:
    h = hashlib.sha256()
    for path in kernel_source_files(root):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def unchecked(kernel: str, codec, dtype) -> str | None:
    """Why the collectives do not select `kernel` for this codec and input dtype (None: its
    loopback checks passed on a GPU at these kernel sources)."""
    name, dt = codec.name, jnp.dtype(dtype).name
    known = name in codec_registry.names() and codec == codec_registry.get(name)
    here = kernel_sources_hash()
    if known and SOURCES == here and (kernel, name, dt) in CHECKED:
        return None
    what = f"{name}" if known else f"{name} (not its registered configuration)"
    return (f"the one-launch {kernel.replace('_', '-')} kernel has no passing loopback "
            f"checks on a GPU for {what}, {dt} at these kernel sources ({here}; python -m "
            f"bench.fused --codec {name} --kernel {kernel}, then --write-checked)")


# -- the table: written by `python -m bench.fused --write-checked` from the check rows
SOURCES = "c3d0b1ac2e3e"
CHECKED = frozenset()
