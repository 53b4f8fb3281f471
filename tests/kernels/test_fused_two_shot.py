"""The one-launch two-shot kernel (taco_jax/kernels/fused/two_shot.py, P ≥ 3) on CPU: lowered
for CUDA on 1-, 2- and 3-axis meshes and as the loopback, selected by the collectives, its
shared memory as the lowering allocates it, its configuration and measurement knobs, and its
jnp reference. Its numerics run on a Hopper GPU (`python -m bench.fused --kernel two_shot`)."""
import dataclasses

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from taco_jax import codecs
from taco_jax.collectives import two_shot
from taco_jax.kernels import fused as fa
from taco_jax.kernels.fused import two_shot as fts

from fused_lowering import lowered_psum, rel_l2, scratch_bytes
from meshes import per_device

TACO = codecs.get("taco")
ECHO4 = codecs.get("echo4")


def lowered_two_shot(shape, names, axis, vma, dtype=jnp.bfloat16):
    """HLO text of fts.two_shot_allreduce over `axis` of a mesh `names` → shape, lowered for
    CUDA; the other axes shard the input too."""
    n = int(np.prod(shape))
    mesh = jax.make_mesh(shape, names, devices=jax.devices()[:n])
    spec, p = P(names), dict(zip(names, shape))[axis]

    def body(v):
        mat = getattr(jax.typeof(v), "manual_axis_type", None)
        if mat is not None and vma:
            mat = mat.update(varying=frozenset(mat.varying) - {axis})
        return fts.two_shot_allreduce(v[0], axis, p, TACO, out_mat=mat)[None]
    out_spec = P(tuple(a for a in names if a != axis)) if vma else spec
    f = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=out_spec, check_vma=vma)
    x = jax.ShapeDtypeStruct((n, 3, 5000), dtype, sharding=NamedSharding(mesh, spec))
    return jax.jit(f).trace(x).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("shape,names,vma", [
    ((3,), ("tp",), False), ((4,), ("tp",), True), ((8,), ("tp",), False),
    ((2, 4), ("data", "tp"), True), ((1, 8), ("data", "tp"), False),
    ((1, 2, 4), ("data", "pipe", "tp"), False), ((1, 1, 8), ("data", "pipe", "tp"), True)])
def test_two_shot_lowers_on_meshes_of_one_two_three_axes(shape, names, vma):
    text = lowered_two_shot(shape, names, "tp", vma)
    assert text.count("taco_fused_two_shot") >= 1 and text.count("custom_call") == 1


@pytest.mark.parametrize("p,dtype,n", [(3, jnp.bfloat16, 64 * 256 * 5 + 17),
                                       (4, jnp.float32, 64 * 256 * 5 + 17),
                                       (8, jnp.float16, 64 * 256 * 8 * 35)])   # 35 tiles, 33 programs
def test_two_shot_loopback_lowers_and_fits_shared_memory(p, dtype, n):
    x = jax.ShapeDtypeStruct((p, n), dtype)
    text = jax.jit(lambda v: fts.two_shot_loopback(v, TACO)).trace(x).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("taco_fused_two_shot") >= 1


@pytest.mark.parametrize("shape,names,vma", [
    ((3,), ("tp",), False), ((4,), ("tp",), True), ((1, 4), ("data", "tp"), False),
    ((1, 1, 4), ("data", "pipe", "tp"), True), ((8,), ("tp",), False),
    ((1, 8), ("data", "tp"), True), ((1, 1, 8), ("data", "pipe", "tp"), False)])
def test_the_collectives_select_the_two_shot_kernel_from_p3(gpu_here, shape, names, vma):
    """Its loopback checks passed on a GPU (taco, P = 3, 4, 8): a fused psum over P ≥ 3
    devices of a 1-, 2- or 3-axis mesh lowers for CUDA to one launch of it, no exchange
    kernel."""
    text = lowered_psum(shape, names, "tp", vma)
    assert text.count("taco_fused_two_shot") >= 1 and "taco_fused_exchange" not in text


def test_two_shot_refuses_what_it_does_not_cover():
    with pytest.raises(ValueError, match="P=9"):
        fts.two_shot_loopback(jnp.ones((9, 512), jnp.bfloat16), TACO)
    with pytest.raises(ValueError, match="int32"):
        fts.two_shot_loopback(jnp.ones((3, 512), jnp.int32), TACO)
    assert fts.two_shot_loopback(jnp.ones((3, 0), jnp.bfloat16), TACO).shape == (3, 0)


@pytest.mark.parametrize("p,dtype,codec", [(3, jnp.bfloat16, "taco"), (3, jnp.float32, "echo4")])
def test_two_shot_reference_is_the_two_shot_schedule_within_its_error(p, dtype, codec):
    """The kernel's reference (segments of whole tiles, owner's part exact, re-encoded from
    f32) against `two_shot.two_shot` (three launches, segments of whole blocks): both
    quantize at most twice, so both err like it, and they differ by about that error."""
    n = 64 * 256 * p + 3 * 256 + 5                    # segments end mid-tile
    k1, k2 = jax.random.split(jax.random.key(0))
    x = (jax.random.normal(k1, (p, n)) * jnp.exp(jax.random.normal(k2, (p, 1)))).astype(dtype)
    exact = np.sum(np.asarray(x, np.float64), axis=0)
    codec = codecs.get(codec)
    got = fts.two_shot_reference(x, codec)
    want = per_device(lambda v: two_shot.two_shot(v, "tp", codec, p, False), x)
    assert got.dtype == dtype and got.shape == (n,)
    e_got, e_want = rel_l2(got, exact), rel_l2(want[0], exact)
    one_shot_err = rel_l2(fa.one_shot_reference(x, codec), exact)
    assert 0 < e_got <= 1.1 * e_want and e_got > one_shot_err   # two quantizations, not one
    assert rel_l2(got, want[0]) < 2 * e_want


def test_a_decoded_blocks_coefficients_are_its_codes_times_the_row_gain():
    """What the two-shot's owner sums on (`taco_tiles.add_coefficients`): the transform is
    orthogonal, so a wire row decodes to a block X whose coefficients Z = H X H / 256 are
    its codes times s / (16 α), wire byte 16i + j holding Z[j, i]; no transform is needed
    to add a copy, and the owner quantizes its sum as it is."""
    from taco_jax.numerics import hadamard, quant
    k1, k2 = jax.random.split(jax.random.key(3))
    x = (jax.random.normal(k1, (8, 256)) * jnp.exp(jax.random.normal(k2, (8, 1)))).astype(
        jnp.bfloat16)
    w = TACO.compress_reference(x)
    blocks = np.asarray(TACO.decompress_reference(w), np.float64).reshape(8, 16, 16)
    h = np.asarray(hadamard.sylvester(16), np.float64)
    zmat = h @ blocks @ h / 256
    z = zmat.transpose(0, 2, 1).reshape(8, 256)
    codes = np.asarray(jax.lax.bitcast_convert_type(w[:, :256], jnp.float8_e4m3fn)
                       .astype(jnp.float32), np.float64)
    s, alpha = np.asarray(quant.unpack_scales(w[:, 256:], TACO.n_scales), np.float64)
    np.testing.assert_allclose(z, codes * s / (16 * alpha), rtol=0,
                               atol=1e-6 * np.abs(z).max())
    assert not np.allclose(zmat.reshape(8, 256), codes * s / (16 * alpha))   # Zᵀ, not Z


@pytest.mark.parametrize("codec,dtype,per_sm,ring", [
    ("taco", jnp.bfloat16, 2, 3), ("taco", jnp.float16, 2, 3), ("taco", jnp.float32, 1, 4),
    ("echo4", jnp.bfloat16, 2, 7), ("echo4", jnp.float32, 1, 7)])
def test_two_shot_config_fits_two_programs_at_16_bit_input(codec, dtype, per_sm, ring):
    """Each phase's buffers are scoped to it: at 16-bit input the largest phase fits half a
    multiprocessor's shared memory, with the deepest ring that does (one slot more does not
    fit, below the most the kernel takes)."""
    c = codecs.get(codec)
    cfg = fts.two_shot_config(c, dtype)
    assert cfg.per_sm == per_sm
    got = fa.two_shot_layout(c, dtype)
    assert got["per_sm"] == per_sm and got["ring"] == ring
    assert got["program_bytes"] <= got["room_bytes"]
    assert got["room_bytes"] == fa.SMEM_PER_SM // per_sm - fa.SMEM_RESERVED
    if ring < 7:
        with pytest.raises(ValueError, match="shared memory"):
            fa.two_shot_layout(c, dtype, dataclasses.replace(cfg, ring=ring + 1))


@pytest.mark.parametrize("codec,dtype", [("taco", jnp.bfloat16), ("taco", jnp.float32),
                                         ("echo4", jnp.bfloat16), ("echo4", jnp.float32)])
def test_two_shot_layout_counts_what_the_lowering_allocates(monkeypatch, codec, dtype):
    """The shared memory Pallas allocates for the two-shot's scratch (its largest phase, the
    operands) is what `two_shot_layout` counts, less its 1 KiB for the barriers: two
    programs a multiprocessor are resident where it says so (else the handshakes hang)."""
    codec = codecs.get(codec)
    x = jax.ShapeDtypeStruct((4, 64 * 256 * 4 * 3 + 17), dtype)
    got = fa.two_shot_layout(codec, dtype)
    allocated = scratch_bytes(monkeypatch, lambda v: fts.two_shot_loopback(v, codec), x)
    assert allocated + 1024 == got["program_bytes"] <= got["room_bytes"]


def test_two_shot_refuses_a_launch_that_does_not_fit_or_is_not_its_own():
    with pytest.raises(ValueError, match="FusedConfig.ring=9"):
        fa.FusedConfig(ring=9)
    with pytest.raises(ValueError, match=r"ring=7\): a program needs \d+ KiB"):
        fts.two_shot_loopback(jnp.ones((3, 512), jnp.bfloat16), TACO,
                              fa.FusedConfig(per_sm=2, ring=7))
    with pytest.raises(ValueError, match="per_sm 1 or 2"):
        fts.two_shot_loopback(jnp.ones((3, 512), jnp.bfloat16), TACO, fa.FusedConfig(per_sm=3))
    with pytest.raises(ValueError, match="warp_specialized"):
        fts.two_shot_loopback(jnp.ones((3, 512), jnp.bfloat16), TACO,
                              fa.FusedConfig(own_from_smem=True, warp_specialized=True))
    with pytest.raises(ValueError, match="shared memory"):
        fts.two_shot_loopback(jnp.ones((3, 512), jnp.float32), ECHO4, fa.FusedConfig(per_sm=2))


def test_two_shot_phase_knobs_leave_phases_out_and_belong_to_it():
    """ablate="scatter_only" / "no_gather": the two-shot without its last phases (timed
    only), so that differences give each phase's time; neither kernel takes the other's
    knobs."""
    x = jax.ShapeDtypeStruct((4, 64 * 256 * 8), jnp.bfloat16)

    def lowered(ablate):
        cfg = fa.FusedConfig(per_sm=2, ablate=ablate)
        return jax.jit(lambda v: fts.two_shot_loopback(v, TACO, cfg)).trace(x).lower(
            lowering_platforms=("cuda",)).as_text()
    sizes = [len(lowered(a)) for a in ("scatter_only", "no_gather", "none")]
    assert sizes == sorted(sizes) and len(set(sizes)) == 3
    with pytest.raises(ValueError, match="two-shot kernel's measurement knob"):
        fa.one_shot_loopback(jnp.ones((2, 512), jnp.bfloat16), TACO,
                              fa.FusedConfig(ablate="no_gather"))
    with pytest.raises(ValueError, match="takes ablate none, scatter_only, no_gather"):
        fts.two_shot_loopback(jnp.ones((3, 512), jnp.bfloat16), TACO,
                              fa.FusedConfig(ablate="no_decode"))


def test_two_shot_ring_changes_the_kernel():
    x = jax.ShapeDtypeStruct((4, 64 * 256 * 9), jnp.bfloat16)

    def lowered(cfg):
        return jax.jit(lambda v: fts.two_shot_loopback(v, ECHO4, cfg)).trace(x).lower(
            lowering_platforms=("cuda",)).as_text()
    assert lowered(fa.FusedConfig(per_sm=2, ring=4)) != lowered(fa.FusedConfig(per_sm=2, ring=7))


def test_two_shot_reference_keeps_non_finite_blocks_nan():
    x = jax.random.normal(jax.random.key(1), (3, 64 * 256 * 3)).astype(jnp.bfloat16)
    x = x.at[0, 5].set(jnp.nan).at[2, 64 * 256 * 2 + 300].set(jnp.inf)
    y = np.asarray(fts.two_shot_reference(x, TACO), np.float32)
    blk = np.arange(y.size) // 256
    bad = np.isin(blk, [0, (64 * 256 * 2 + 300) // 256])
    assert np.isnan(y[bad]).all() and np.isfinite(y[~bad]).all()


@pytest.mark.parametrize("p, seg_tiles, nprog", [(8, 1024, 33), (4, 2048, 66), (3, 7, 7),
                                                 (8, 5, 3), (5, 64, 264), (8, 35, 33)])
def test_each_tile_goes_to_one_program_and_the_extras_spread(p, seg_tiles, nprog):
    """Program b's tiles of a segment (`_shares`) cover every tile once over the programs,
    whatever the segment; the loops over several segments (`_items`) visit exactly them;
    and the remainder's extra tiles fall on different programs in different segments, so
    the longest loop over all P segments is ceil(P·seg_tiles / nprog) when P·r ≤ nprog."""
    nprog = min(nprog, seg_tiles)           # as FusedConfig.grid caps it
    q, r = divmod(seg_tiles, nprog)
    longest = 0
    for seg in range(p):
        seen = []
        for b in range(nprog):
            first, count = fts._shares(seg_tiles, nprog, np.int32(b))
            seen += [int(first(seg)) + i * nprog for i in range(int(count(seg)))]
        assert sorted(seen) == list(range(seg_tiles))
    for b in range(nprog):
        first, count = fts._shares(seg_tiles, nprog, np.int32(b))
        segs = [(2 + k) % p for k in range(p)]
        n, locate = fts._items(segs, count)
        got = [tuple(int(v) for v in locate(np.int32(e))) for e in range(int(n))]
        assert got == [(s, i) for s in segs for i in range(int(count(s)))]
        longest = max(longest, int(n))
    if p * r <= nprog:
        assert longest == -(-p * seg_tiles // nprog)
    assert longest <= p * -(-seg_tiles // nprog)
