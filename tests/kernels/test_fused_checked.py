"""What the fused transport selects is what was checked: its table of (kernel, codec, dtype)
(taco_jax/kernels/fused/checked.py) holds what the committed loopback check rows
(bench/results/fused*.json) show passing at its kernel sources hash, and whatever the
selection admits has passing rows at this library's kernel sources. CPU, no kernel runs."""
import shutil

import jax.numpy as jnp

from bench import fused as bench_fused
from taco_jax import codecs
from taco_jax.kernels.fused import checked

DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def test_what_the_selection_admits_passed_its_checks_at_these_sources():
    here = checked.kernel_sources_hash()
    passed = bench_fused.checked_triples(bench_fused.check_rows(), here)
    admitted = {(k, name, jnp.dtype(d).name) for k in checked.KERNELS
                for name in codecs.names() for d in DTYPES
                if checked.unchecked(k, codecs.get(name), d) is None}
    assert admitted <= passed, f"selected without passing check rows at {here}: " \
                               f"{sorted(admitted - passed)}"


def test_the_table_is_what_the_rows_give_at_its_sources():
    """`python -m bench.fused --write-checked` writes it; this keeps it so."""
    rows = bench_fused.check_rows()
    assert checked.CHECKED == bench_fused.checked_triples(rows, checked.SOURCES)
    path = bench_fused.CHECKED_PY
    assert open(path).read().endswith(bench_fused.table_text(checked.SOURCES, checked.CHECKED))


def test_the_hash_is_the_kernel_sources(tmp_path):
    """Any byte of a kernel source changes it; the table's own file does not."""
    root = checked._PACKAGE
    files = checked.kernel_source_files()
    names = {f.relative_to(root).as_posix() for f in files}
    assert {"kernels/tile_codec.py", "kernels/fused/one_shot.py", "kernels/fused/body.py",
            "kernels/mosaic/taco_tiles.py", "kernels/mosaic/echo4.py",
            "codecs/taco.py", "numerics/quant.py"} <= names
    assert "kernels/fused/checked.py" not in names
    for f in files + [root / "kernels/fused/checked.py"]:
        dst = tmp_path / f.relative_to(root)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(f, dst)
    base = checked.kernel_sources_hash(tmp_path)
    assert base == checked.kernel_sources_hash()
    (tmp_path / "kernels/fused/checked.py").write_text("CHECKED = frozenset()\n")
    assert checked.kernel_sources_hash(tmp_path) == base
    one = tmp_path / "kernels/mosaic/echo4.py"
    one.write_bytes(one.read_bytes() + b" ")
    assert checked.kernel_sources_hash(tmp_path) != base
