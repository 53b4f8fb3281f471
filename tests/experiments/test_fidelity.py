"""Fidelity tooling: telemetry.capture hands the real all-reduce tensors to the host (and
costs nothing when off); experiments.fidelity's metrics; experiments.ablation's driver and
experiments.grad_error (tiny smoke runs)."""
import json
import math
import sysconfig
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import taco_jax
from models import parallel
from taco_jax import telemetry

CORPUS = Path(sysconfig.get_paths()["stdlib"]) / "json"


def _mesh(p=2):
    return jax.make_mesh((p,), ("tp",), devices=jax.devices()[:p])


def _put(args, specs):
    return [jax.device_put(a, NamedSharding(_mesh(), s)) for a, s in zip(args, specs)]


def _run(fn, *args, all_devices=False):
    with telemetry.capture(all_devices=all_devices) as cap:
        out = jax.jit(fn)(*args)        # traced inside the block
        jax.block_until_ready(out)
    jax.effects_barrier()
    return out, cap


VMA_SPECS = (P(), P("tp"), P("tp"))


def _f_vma(codec, min_bytes):
    """h replicated -> f (pvary) -> u * w (w sharded) -> g (psum). ct(u) on device i is w_i."""
    def local(h, w, x):
        u = taco_jax.pvary(h, "tp", codec=codec, min_bytes=min_bytes)
        y = taco_jax.psum(u * w + x, "tp", codec=codec, min_bytes=min_bytes)
        return jnp.sum(y)

    f = jax.shard_map(local, mesh=_mesh(), in_specs=VMA_SPECS, out_specs=P(),
                      check_vma=True)
    return jax.grad(f)


@pytest.mark.parametrize("codec,min_bytes", [("taco", 0), ("taco", None), ("none", 0)],
                         ids=["compressed", "lax-route", "codec-none"])
def test_capture_equals_inputs_vma(codec, min_bytes):
    rng = np.random.default_rng(0)
    h = rng.standard_normal((4, 64), np.float32)
    w = rng.standard_normal((8, 64), np.float32)
    x = rng.standard_normal((8, 64), np.float32)
    grad, cap = _run(_f_vma(codec, min_bytes), *_put([h, w, x], VMA_SPECS), all_devices=True)
    fwd, bwd = cap.by_kind("fwd"), cap.by_kind("bwd")
    assert len(fwd) == 2 and len(bwd) == 2                   # one site each, both devices
    for r in fwd:
        i = r["device"]
        assert r["op"] == "psum" and r["site"] == 0 and r["call"] == 0
        np.testing.assert_allclose(r["value"], h * w[4 * i:4 * i + 4] + x[4 * i:4 * i + 4],
                                   rtol=1e-6, atol=1e-6)
    for r in bwd:
        i = r["device"]
        assert r["op"] == "pvary"
        np.testing.assert_array_equal(r["value"], w[4 * i:4 * i + 4])   # ct(u) = w_i
    # the hook does not change the result: grad wrt h is psum over devices of w_i
    ref = w[:4] + w[4:]
    rel = np.linalg.norm(np.asarray(grad) - ref) / np.linalg.norm(ref)
    assert rel < (0.1 if codec == "taco" and min_bytes == 0 else 1e-6), rel


def test_capture_first_device_and_call_counter():
    rng = np.random.default_rng(1)
    h, w, x = (rng.standard_normal(s, np.float32) for s in [(4, 64), (8, 64), (8, 64)])
    fn = jax.jit(_f_vma("taco", 0))
    with telemetry.capture() as cap:
        for _ in range(3):
            jax.block_until_ready(fn(*_put([h, w, x], VMA_SPECS)))
    jax.effects_barrier()
    assert sorted((r["kind"], r["call"], r["device"]) for r in cap.records) == [
        ("bwd", 0, 0), ("bwd", 1, 0), ("bwd", 2, 0), ("fwd", 0, 0), ("fwd", 1, 0), ("fwd", 2, 0)]


def test_capture_bwd_without_vma():
    """check_vma=False: psum's transpose all-reduces the cotangent of its output."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((8, 64), np.float32)
    c = rng.standard_normal((4, 64), np.float32)

    def local(x, c):
        return jnp.sum(taco_jax.psum(x, "tp", codec="taco", min_bytes=0) * c)

    f = jax.shard_map(local, mesh=_mesh(), in_specs=(P("tp"), P()), out_specs=P(),
                      check_vma=False)
    _, cap = _run(jax.grad(f), *_put([x, c], [P("tp"), P()]))
    (fwd,), (bwd,) = cap.by_kind("fwd"), cap.by_kind("bwd")
    np.testing.assert_array_equal(fwd["value"], x[:4])
    # without vma JAX splits the replicated output's cotangent over the P devices (c / P
    # each) and psum's transpose sums them back: the all-reduce's input is c / 2
    np.testing.assert_allclose(bwd["value"], c / 2, rtol=1e-6)


def test_capture_off_adds_nothing():
    args = _put([jnp.zeros(s, jnp.float32) for s in [(4, 64), (8, 64), (8, 64)]], VMA_SPECS)
    # fresh functions each time: JAX caches traces by function identity (telemetry docstring)
    off = str(jax.make_jaxpr(_f_vma("taco", None))(*args))
    assert "callback" not in off
    with telemetry.capture():
        on = str(jax.make_jaxpr(_f_vma("taco", None))(*args))
    assert "debug_callback" in on
    assert str(jax.make_jaxpr(_f_vma("taco", None))(*args)) == off   # scoped to the block


# ---------------------------------------------------------------------------------------------
# experiments.ablation: 2 variants x 3 steps of a very small GPT, resumable, JSON + plot

def _small(cache):
    return ["model.vocab_size=512", "model.seq_len=32", "model.n_layer=1", "model.n_head=4",
            "model.d_model=32", f"data.paths=[{CORPUS}]", f"data.cache_dir={cache}",
            "train.batch_size=4", "train.eval_every=0", "train.ckpt_every=0",
            "train.eval_batches=1", "optim.warmup_steps=1", "train.async_ckpt=false",
            "train.codec_error=false"]


def test_ablation_workers(tmp_path, capsys):
    """--workers 2: two child drivers (each the one-worker driver) train the variants at
    once; their rows are merged into one JSON, table and plots, each with the parent's
    commit; the runs' configs say what was trained; a re-run trains nothing."""
    from experiments import ablation
    args = ["--steps", "3", "--variants", "none", "taco+feedback", "--workers", "2",
            "--out-dir", str(tmp_path / "runs"), "--json", str(tmp_path / "a.json"),
            "--plot", str(tmp_path / "a.png"), "--set", *_small(tmp_path / "cache")]
    out = ablation.main(args)
    rows = {r["variant"]: r for r in out["rows"]}
    assert set(rows) == {"none", "taco+feedback"} and "unfinished" not in out
    assert rows["none"]["degradation_pct"] == 0.0 and not rows["none"]["diverged"]
    fb = rows["taco+feedback"]
    assert fb["feedback"] and fb["codec"] == "taco" and math.isfinite(fb["final_val_loss"])
    assert abs(fb["degradation_pct"]) < 5 and len(fb["curve"]["step"]) == 3
    assert len({r["commit"] for r in rows.values()}) == 1
    saved = json.loads((tmp_path / "a.json").read_text())
    assert [r["variant"] for r in saved["rows"]] == ["none", "taco+feedback"]
    assert {"device", "commit", "preset", "steps", "rows"} <= set(saved)
    assert saved["steps"] == 3 and saved["device"] == "cpu"
    assert (tmp_path / "a.png").stat().st_size > 0
    assert (tmp_path / "a_paired.png").stat().st_size > 0     # the per-seed forest plot
    cfg = (tmp_path / "runs" / "taco+feedback" / "config.yaml").read_text()
    assert "min_bytes: 0" in cfg and "feedback: true" in cfg and "tp: 2" in cfg
    capsys.readouterr()
    again = ablation.main(args)     # everything is finished: read back, no workers
    text = capsys.readouterr().out
    assert "[ablation] worker" not in text and "training in" not in text
    assert [r["final_val_loss"] for r in again["rows"]] == [rows[v]["final_val_loss"]
                                                            for v in ("none", "taco+feedback")]


def _row(variant, loss, seed=None):
    from experiments.ablation import parse_variant
    v = parse_variant(variant, 0)
    return {"variant": variant, "codec": v["codec"], "feedback": v["feedback"],
            "seed": v["seed"] if seed is None else seed, "final_val_loss": loss}


def test_ablation_paired_summary():
    """Each configuration is compared with the none run of its own seed; the plain "none"
    is the baseline even when its rerun none@seed0 comes first; diverged runs are left out."""
    from experiments.ablation import paired_summary, seed_baselines
    rows = [_row("none@seed0", 2.2), _row("none", 2.0), _row("none@seed1", 4.0),
            _row("taco", 2.02), _row("taco@seed1", 3.96), _row("fp8", float("nan")),
            _row("echo4+feedback", 2.1)]
    assert seed_baselines(rows)[0]["variant"] == "none"
    got = {e["config"]: e for e in paired_summary(rows)}
    assert set(got) == {"none", "taco", "echo4+feedback"}
    t = got["taco"]
    assert t["seeds"] == [0, 1] and t["runs"] == ["taco", "taco@seed1"]
    assert np.allclose(t["paired_pct"], [1.0, -1.0]) and abs(t["mean_pct"]) < 1e-9
    assert np.isclose(t["spread_pct"], 2.0)
    # sample sd of (1, -1) is sqrt(2): sem 1; t(0.95, 1 dof) = 6.314
    assert np.isclose(t["sem_pct"], 1.0)
    assert np.allclose(t["ci90_pct"], [-6.3138, 6.3138], atol=1e-3)
    assert got["echo4+feedback"]["sem_pct"] is None and got["echo4+feedback"]["ci90_pct"] is None
    assert np.allclose(got["none"]["paired_pct"], [10.0])      # the rerun's noise
    assert got["echo4+feedback"]["spread_pct"] is None


def test_ablation_old_records_keep_unrequested_rows(tmp_path):
    """A second call on the same machine that asks for other variants keeps the rows the
    first call finished there (their run dirs exist); a requested variant with a run dir
    here is left to be read back or resumed; another preset's JSON is ignored."""
    import json
    import types
    from experiments.ablation import old_records, run_dir_of
    out = tmp_path / "runs"
    rows = [_row("none", 2.0), _row("taco@seed2", 2.1), _row("fp8", 2.2)]
    js = tmp_path / "a.json"
    js.write_text(json.dumps({"preset": "small", "steps": 5, "tp": 2, "device": "d",
                              "commit": "c", "rows": rows}))
    for v in ("taco@seed2", "fp8"):            # finished by an earlier call here
        run_dir_of(str(out), v).mkdir(parents=True)
    args = types.SimpleNamespace(json=str(js), preset_name="small", steps=5, tp=2,
                                 out_dir=str(out), old_meta=None)
    got = old_records(args, requested=["none", "fp8"])
    assert set(got) == {"none", "taco@seed2"}
    assert got["taco@seed2"]["final_val_loss"] == 2.1
    assert args.old_meta == {"device": "d", "commit": "c"}
    args.steps = 6
    assert old_records(args, requested=["none"]) == {}


def test_ablation_variant_parsing():
    from experiments.ablation import VARIANTS, parse_variant
    assert parse_variant("echo4+feedback", 0) == {"name": "echo4+feedback", "codec": "echo4",
                                                  "feedback": True, "seed": 0,
                                                  "direction": "both"}
    assert parse_variant("none@seed1", 0)["seed"] == 1
    assert parse_variant("fwd:taco@seed2", 0) == {"name": "fwd:taco@seed2", "codec": "taco",
                                                  "feedback": False, "seed": 2,
                                                  "direction": "fwd"}
    assert parse_variant("bwd:taco+feedback", 0)["direction"] == "bwd"
    with pytest.raises(ValueError):
        parse_variant("taco+ef", 0)
    with pytest.raises(ValueError, match="fwd or bwd"):
        parse_variant("up:taco", 0)
    from train import config as config_lib
    from experiments.ablation import variant_overrides
    with pytest.raises(ValueError, match="pair"):
        parse_variant("fwd:taco/taco-int8", 0)
    for v, fwd, bwd in (("fwd:taco", "taco", "none"), ("bwd:taco", "none", "taco"),
                        ("taco", "taco", "taco"), ("taco/taco-int8@seed1", "taco", "taco-int8")):
        o = variant_overrides(parse_variant(v, 0), 2, 5, "runs/x", False)
        m = config_lib.load_config("tiny", o).model
        assert (m.codec_fwd, m.codec_bwd, m.min_bytes) == (fwd, bwd, 0), v
    from experiments.ablation import run_dir_of
    assert run_dir_of("runs/a", "taco/taco-int8").name == "taco__taco-int8"
    assert len(VARIANTS) == 12 and VARIANTS.count("none") == 1


def test_fidelity_metrics_on_known_tensors():
    """codec_rows: rel_l2 and SNR agree, none is exact, underflow counts zeros."""
    from experiments import fidelity as fid
    rng = np.random.default_rng(0)
    recs = [{"kind": "fwd", "site": 0, "value": rng.standard_normal((64, 256), np.float32)},
            {"kind": "bwd", "site": 0, "value": np.where(rng.random((64, 256)) < 0.5, 1e-6,
                                                         1.0).astype(np.float32)}]
    rows = {(r["codec"], r["site"]): r for r in fid.codec_rows(recs, ["none", "taco", "fp8"], 5)}
    assert rows["none", "fwd"]["rel_l2"] == 0 and rows["none", "fwd"]["snr_db"] is None
    t = rows["taco", "fwd"]
    assert 0.01 < t["rel_l2"] < 0.05 and t["step"] == 5
    assert abs(t["snr_db"] + 20 * np.log10(t["rel_l2"])) < 1e-3
    # per-tensor fp8: 1e-6 next to 1.0 is below E4M3's range (2^-9 · 1/448) and flushes to 0
    assert rows["fp8", "bwd"]["underflow_frac"] > 0.4
    assert rows["taco", "fwd"]["underflow_frac"] == 0


def test_grad_error_tool(tmp_path):
    """experiments.grad_error on a 3-step run: exact has zero error, echo4 a real one, and the
    direction forms leave the other direction exact."""
    from experiments import ablation, grad_error
    ablation.main(["--steps", "3", "--variants", "none", "--out-dir", str(tmp_path / "runs"),
                   "--json", "", "--plot", "", "--set", *_small(tmp_path / "cache")])
    out = grad_error.main(["--load", str(tmp_path / "runs" / "none"), "--batches", "1",
                           "--variants", "echo4", "fwd:echo4+feedback", "bwd:taco",
                           "--out", str(tmp_path / "g.json")])
    rows = {r["variant"]: r for r in out["rows"]}
    assert list(rows) == ["exact", "echo4", "fwd:echo4+feedback", "bwd:taco"]
    assert rows["exact"]["grad_rel_err"] == 0 and rows["exact"]["abs_dloss"] == 0
    assert 0.01 < rows["echo4"]["grad_rel_err"] < 1 and rows["echo4"]["abs_dloss"] > 0
    assert rows["bwd:taco"]["abs_dloss"] == 0        # forward exact: same loss
    assert set(rows["echo4"]["group_rel_err"]) == {"embed", "norm", "attention", "mlp", "head"}
    assert all(0 < e < 1 for e in rows["echo4"]["group_rel_err"].values())
    assert rows["exact"]["err_mean_ratio"] == 0      # one batch: persistence undefined → 0
    assert 0 < rows["bwd:taco"]["grad_rel_err"] < rows["echo4"]["grad_rel_err"]
    assert out["step"] == 3 and (tmp_path / "g.json").exists()
    assert grad_error.overrides("bwd:echo4+feedback") == [
        "model.codec_fwd=none", "model.codec_bwd=echo4", "model.feedback=true",
        "model.feedback_bwd=true", "model.min_bytes=0"]
    assert "model.feedback_bwd=false" in grad_error.overrides("fwd:echo4+feedback")
    with pytest.raises(ValueError, match="direction"):
        grad_error.overrides("up:echo4")


def test_error_persistence_measures():
    """err_cos / err_mean_ratio: 1 / 1 for a repeated error, ≈ 0 / 1/sqrt(n) for independent
    ones; group_errors pools per group."""
    from experiments import grad_error
    rng = np.random.default_rng(0)
    exact = [(0.0, [rng.standard_normal(50), rng.standard_normal(30)]) for _ in range(16)]
    bias = [rng.standard_normal(50), rng.standard_normal(30)]
    same = [(0.0, [e + d for e, d in zip(ex[1], bias)]) for ex in exact]
    indep = [(0.0, [e + rng.standard_normal(e.shape) for e in ex[1]]) for ex in exact]
    p = grad_error.error_persistence(same, exact)
    assert p["err_cos"] == pytest.approx(1, abs=1e-6) and p["err_mean_ratio"] == pytest.approx(1)
    shrunk = [(0.0, [0.9 * e for e in ex[1]]) for ex in exact]
    sh = grad_error.error_persistence(shrunk, exact)
    assert sh["err_gain"] == pytest.approx(-0.1)
    assert sh["adam_rel_err"] == pytest.approx(0.1) and sh["adam_mean_err"] <= 0.1 + 1e-9
    q = grad_error.error_persistence(indep, exact)
    assert abs(q["err_cos"]) < 0.1 and q["err_mean_ratio"] == pytest.approx(0.25, abs=0.08)
    g = grad_error.group_errors(same, exact, ["a", "b"])
    assert set(g) == {"a", "b"} and g["a"] > 0
    assert grad_error.param_group("['blocks'][3]['ln1']['scale']") == "norm"
    assert grad_error.param_group("['blocks'][0]['attn']['qkv_kernel']") == "attention"
