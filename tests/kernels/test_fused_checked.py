"""What the fused transport selects is what was checked: its table (taco_jax/kernels/fused/
checked.py) holds the (kernel, codec, dtype) whose committed loopback check rows
(bench/results/fused*.json) passed on a GPU at the fingerprints of the modules this checkout
emits; a change that emits another module leaves the table stale and this file says which
configuration and which GPU step re-checks it; one that emits the same modules keeps the
fused path selected. CPU: the kernels are lowered for CUDA, never run. The table's
fingerprints are recomputed here (the one-shot's and the two-shot's at P = 3) and in
test_fused_checked_two_shot.py (the two-shot's at P = 4 and 8), so the two halves lower in
parallel."""
import jax
import jax.numpy as jnp
import pytest

from bench import fused as bench_fused
from taco_jax import codecs
from taco_jax.collectives import fused
from taco_jax.kernels.fused import checked, one_shot

DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
ON_THE_TABLES_JAX = jax.__version__ == checked.JAX
other_jax = pytest.mark.skipif(
    ON_THE_TABLES_JAX, reason=f"the table's fingerprints are jax {checked.JAX}'s lowering")
tables_jax = pytest.mark.skipif(
    not ON_THE_TABLES_JAX, reason=f"the table's fingerprints are jax {checked.JAX}'s lowering, "
                                  f"not jax {jax.__version__}'s")


def fresh():
    """Forget every lowering of this process (checked's and jax's own caches), as a new
    process would after a code change."""
    jax.clear_caches()
    checked._fingerprint.cache_clear()


def stale_lines(keep) -> list[str]:
    """`checked.stale` of the table's (kernel, codec, dtype, P) for which keep(kernel, P)."""
    table = {t: tuple((p, fp) for p, fp in pairs if keep(t[0], p))
             for t, pairs in checked.CHECKED.items()}
    return checked.stale({t: pairs for t, pairs in table.items() if pairs})


def backed(rows) -> dict:
    """`bench.fused.checked_table` of `rows` at the fingerprints emitted now: the table's
    own where the stale tests hold them current, the others lowered."""
    return bench_fused.checked_table(rows, bench_fused.current_fingerprints(rows,
                                                                            checked.CHECKED))


def unbacked(table: dict, rows) -> set:
    """The triples that the selection admits with `table` as its checked table but that no
    passing check rows (`rows`, `bench.fused.check_rows`) at the fingerprints emitted now
    back."""
    passed = backed(rows)
    saved = checked.CHECKED
    checked.CHECKED = table
    try:
        admitted = {(k, name, jnp.dtype(d).name) for k in checked.KERNELS
                    for name in codecs.names() for d in DTYPES
                    if checked.unchecked(k, codecs.get(name), d) is None}
    finally:
        checked.CHECKED = saved
    return admitted - set(passed)


@tables_jax
def test_every_one_shot_and_p3_module_the_table_claims_is_the_one_emitted_now():
    lines = stale_lines(lambda kernel, p: kernel == "one_shot" or p == 3)
    assert not lines, "the checked table claims modules this checkout no longer emits:\n" + \
        "\n".join(lines)


@tables_jax
def test_the_table_is_what_the_rows_give_at_the_fingerprints_emitted_now():
    """`python -m bench.fused --write-checked` writes it; this keeps it so."""
    table = backed(bench_fused.check_rows())
    assert checked.CHECKED == table, f"run {checked.RECHECK.split(', then ')[1]}"
    assert open(bench_fused.CHECKED_PY).read().endswith(
        bench_fused.table_text(checked.JAX, checked.CHECKED))


@tables_jax
def test_what_the_selection_admits_has_passing_rows():
    """Whatever the committed table holds; and a table that admits a triple without
    passing rows (constructed: the committed table's triples without their rows, and a
    made-up fingerprint), which this check must catch."""
    rows = bench_fused.check_rows()
    assert unbacked(checked.CHECKED, rows) == set()
    assert unbacked(checked.CHECKED, []) == set(checked.CHECKED)
    made_up = {("one_shot", "taco", "bfloat16"): ((2, "0" * 12),)}
    assert unbacked(made_up, [r for r in rows if r["fingerprint"] != "0" * 12]) == \
        set(made_up) - set(backed(rows))


@tables_jax
@pytest.mark.xfail(not checked.CHECKED, strict=True,
                   reason=f"the checked table is empty: nothing selected until {checked.RECHECK}")
@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("codec", ["taco", "echo4"])
def test_the_library_selects_the_one_launch_kernels_on_a_gpu_mesh(p, codec, gpu_here):
    """taco and echo4 in bf16 and f32 take the one-launch kernel at P = 2, 4 and 8 (the
    selection asked as on a GPU, nothing run)."""
    for dtype in (jnp.bfloat16, jnp.float32):
        why = fused.one_launch_reason(codecs.get(codec), p, dtype)
        assert why is None, f"{codec} {jnp.dtype(dtype).name} P={p} is not selected: {why}"


@other_jax
def test_on_another_jax_nothing_is_selected_and_telemetry_says_why():
    for (kernel, name, dt) in checked.CHECKED:
        why = checked.unchecked(kernel, codecs.get(name), dt)
        assert why is not None and f"checked as jax {checked.JAX} lowers it" in why, why


def test_a_changed_kernel_changes_its_fingerprint_and_the_table_goes_stale(monkeypatch):
    """The one-shot's decode done twice (its measurement knob, patched in as a code change
    would make it) emits another module: the table of the unchanged kernel's fingerprint is
    stale, and the line names the configuration and the GPU step."""
    codec = codecs.get("echo4")
    fresh()
    before = checked.fingerprint("one_shot", codec, jnp.bfloat16, 2)
    table = {("one_shot", "echo4", "bfloat16"): ((2, before),)}
    assert checked.stale(table) == []
    original = one_shot.sum_tiles

    def decode_twice(load, r, bar, tiles, consts, n, vec, parts, ablate="none", **kw):
        return original(load, r, bar, tiles, consts, n, vec, parts, "decode_twice", **kw)
    monkeypatch.setattr(one_shot, "sum_tiles", decode_twice)
    fresh()
    try:
        lines = checked.stale(table)
    finally:
        monkeypatch.undo()
        fresh()
    assert len(lines) == 1 and lines[0].startswith("one_shot echo4 bfloat16 P=2: emits ")
    assert "bench/gpu_run.sh fused_checks" in lines[0] and before in lines[0]


def test_a_refactor_that_emits_the_same_module_keeps_the_fingerprint(monkeypatch):
    """The same kernel reached through other Python (a wrapper around the decode-and-sum),
    lowered again in another place: the fingerprint holds, locations and kernel counts
    left out."""
    codec = codecs.get("echo4")
    fresh()
    before = checked.fingerprint("one_shot", codec, jnp.float32, 2)
    original = one_shot.sum_tiles
    monkeypatch.setattr(one_shot, "sum_tiles", lambda *a, **k: original(*a, **k))
    fresh()
    try:
        assert checked.fingerprint("one_shot", codec, jnp.float32, 2) == before
    finally:
        monkeypatch.undo()
        fresh()
    assert checked.fingerprint("one_shot", codec, jnp.bfloat16, 2) != before   # a dtype
    assert checked.fingerprint("two_shot", codec, jnp.float32, 3) != before    # a kernel


def test_gemm_check_rows_admit_the_row_parallel_gemms_at_their_fingerprints(tmp_path):
    """bench.gemm_codec's check rows (kernel at its default launch, each with the
    fingerprint of the modules it ran) are read with the fused ones: passing rows at the
    fingerprint emitted now admit ("gemm_owner", codec, dtype) at any P ≥ 2; a failing row,
    or one at another fingerprint, does not."""
    import json
    codec = codecs.get("taco")
    fp = checked.fingerprint("gemm_owner", codec, jnp.bfloat16, 2)
    assert fp != checked.fingerprint("gemm_all", codec, jnp.bfloat16, 2)

    def table(rows):
        path = tmp_path / "gemm_codec_checks.json"
        path.write_text(json.dumps({"platform": "gpu", "impl": "kernel", "rows": rows}))
        got = bench_fused.check_rows([str(path)])
        return bench_fused.checked_table(got, bench_fused.current_fingerprints(got))
    row = {"kind": "check", "codec": "taco", "p": 2, "dtype": "bf16", "exchange": "owner",
           "config": "default", "impl": "kernel", "ok": True, "calls": 3, "fingerprint": fp}
    assert table([row]) == {("gemm_owner", "taco", "bfloat16"): ((2, fp),)}
    assert table([row, {**row, "shape": "odd", "ok": False}]) == {}
    assert table([{**row, "fingerprint": "0" * 12}]) == {}
    assert table([{**row, "config": "pingpong=true"}]) == {}
