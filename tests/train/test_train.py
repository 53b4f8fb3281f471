"""train/: presets build, configs parse and fail clearly, a smoke run writes its artifacts
(metrics with bytes on the wire and codec error, the call-site report, a profile), and a run
interrupted by SIGTERM resumes bit-exactly."""
import contextlib
import errno
import io
import json
import math
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import train
from models import parallel
from taco_jax import telemetry
from train import config as config_lib
from train import data as data_lib
from train.checkpoint import saved_steps
from train.metrics import read_jsonl

from run_cases import CORPUS, _overrides, cache  # noqa: F401 (cache: the shared corpus fixture)

PRESETS = config_lib.preset_names()


@pytest.fixture(scope="module")
def full_run_and_log(cache, tmp_path_factory):
    """6 uninterrupted steps (TACO on every all-reduce, data=2 x tp=2; steps 2-3 profiled)
    -> (summary, what it printed)."""
    run_dir = tmp_path_factory.mktemp("runs") / "full"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        summary = train.run(config_lib.load_config("tiny", _overrides(
            cache, run_dir, "train.profile_steps=2:3")))
    sys.stdout.write(out.getvalue())
    return summary, out.getvalue()


@pytest.fixture(scope="module")
def full_run(full_run_and_log):
    return full_run_and_log[0]


# ---------------------------------------------------------------------------------------------
# presets and config parsing

@pytest.mark.parametrize("preset", PRESETS)
def test_preset_builds(preset):
    """Each preset parses, fits a TP=2 mesh, and its state and train step have the right
    abstract shapes (jax.eval_shape: no 350M parameters allocated, nothing compiled)."""
    cfg = config_lib.load_config(preset, ["parallel.tp=2"])
    mesh = parallel.make_mesh(1, 2)
    state = train.build(cfg, mesh).abstract_state()
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state["params"]))
    assert n == cfg.model.num_params()
    expected = {"tiny": (1e6, 3e6), "small": (110e6, 170e6), "350m": (330e6, 400e6),
                "comm_heavy": (10e6, 200e6), "qwen-tiny": (1e6, 3e6),
                "qwen-0.5b": (380e6, 460e6)}.get(preset)  # presets of other studies: count only
    assert expected is None or expected[0] < n < expected[1], n
    # Trace one step at full width but 2 layers (tracing cost is per layer, wiring is not).
    prog = train.build(config_lib.replace(cfg, ["model.n_layer=2"]), mesh)
    state = prog.abstract_state()
    x = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.seq_len), np.int32,
                             sharding=jax.sharding.NamedSharding(mesh, parallel.BATCH_SPEC))
    new_state, metrics = jax.eval_shape(prog.step, state, x, x)
    assert jax.tree.structure(new_state) == jax.tree.structure(state)
    assert all(a.shape == b.shape for a, b in zip(jax.tree.leaves(new_state),
                                                  jax.tree.leaves(state)))
    assert metrics["loss"].shape == ()


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_fields_are_commented(preset):
    """Every leaf field of a preset carries a one-line reason, as a real YAML comment: a
    `#` glued to the value (`x# note`) is part of the value (the data cache dir would read
    '.cache/taco_jax# gitignored; …')."""
    for line in config_lib.resolve_preset(preset).read_text().splitlines():
        if re.match(r"^\s+\w+:\s*\S", line):  # an indented `key: value` line
            assert re.search(r"\s#", line), f"{preset}: no comment on {line.strip()!r}"
    cfg = config_lib.load_config(preset).to_dict()
    strings = [v for sec in cfg.values() if isinstance(sec, dict) for v in sec.values()
               if isinstance(v, str)]
    assert not any("#" in v for v in strings), strings


def test_overrides_and_codec_shorthand():
    cfg = config_lib.load_config("tiny", ["codec=none", "model.n_layer=2", "optim.lr=1e-3",
                                          "data.paths=[a, b]", "train.async_ckpt=false"])
    assert (cfg.model.codec_fwd, cfg.model.codec_bwd) == ("none", "none")
    # the saved config names the codec that runs, the recipe's default included
    assert cfg.recipe.codec == "none" and set(cfg.codecs().values()) == {"none"}
    assert "taco" not in __import__("yaml").safe_load(config_lib.dump(cfg))["recipe"].values()
    assert config_lib.load_config("tiny", ["codec=null"]).recipe.codec == "taco"
    assert cfg.model.n_layer == 2 and cfg.optim.lr == 1e-3 and cfg.data.paths == ("a", "b")
    assert cfg.train.async_ckpt is False
    cfg = config_lib.load_config("tiny", ["model.codec_fwd=taco", "model.codec_bwd=fp8",
                                          "model.feedback=true"])
    assert (cfg.model.codec_fwd, cfg.model.codec_bwd) == ("taco", "fp8")
    assert cfg.model.feedback is True and cfg.model.feedback_bwd is False   # preset's value
    # the dump of a config loads back to the same config
    assert config_lib.from_dict(__import__("yaml").safe_load(config_lib.dump(cfg))) == cfg
    # null: the recipe's setting, from YAML or the command line
    cfg = config_lib.load_config("tiny", ["model.codec_fwd=null", "recipe.min_bytes=null",
                                          "recipe.codec=fp8"])
    assert cfg.model.codec_fwd is None and cfg.recipe.min_bytes is None
    assert cfg.codecs()["fwd"] == "fp8" and cfg.recipe.fields()["min_bytes"] is None
    assert config_lib.from_dict(__import__("yaml").safe_load(config_lib.dump(cfg))) == cfg


@pytest.mark.parametrize("overrides,match", [
    (["model.n_layers=2"], r"unknown config key 'model.n_layers'"),
    (["train.steps=ten"], r"train.steps='ten': expected int"),
    (["train.steps=2.5"], r"train.steps=2.5: expected int"),
    # named as typed, with the codecs there are
    (["codec=taco2"], r"^codec=taco2: unknown codec 'taco2'; known: taco, .*none"),
    (["model.n_head=5"], r"model.d_model=128 must be divisible by model.n_head=5"),
    (["parallel.tp=8"], r"model.n_head=4 is not divisible by tp=8"),
    (["train.batch_size=0"], r"train.batch_size=0 must be positive"),
    (["data.tokenizer=sentencepiece"], r"data.tokenizer='sentencepiece'"),
    (["data.tokenizer=bytes", "model.vocab_size=128"], r"model.vocab_size=128 < 257"),
    (["optim.min_lr=1.0"], r"optim.min_lr=1.0 <= optim.lr=0.003"),
    (["train.steps"], r"must look like key=value"),
    (["codec=none", "model.feedback=true"], r"model.feedback=True needs a compressing codec"),
    (["model.tp_overlap=true"], r"model.tp_overlap=True needs model.sequence_parallel=True"),
    # "the recipe's" is spelled null: the empty string and -1 are refused, naming the key
    (["model.codec_head="], r"model.codec_head='' is not a codec: write null"),
    (["model.min_bytes=-1"], r"model.min_bytes=-1 must be an int >= 0, or null"),
    (["recipe.codec_pp="], r"recipe.codec_pp='' is not a codec: write null"),
    (["recipe.min_bytes=-1"], r"recipe.min_bytes=-1 must be >= 0, or null"),
])
def test_bad_configs_fail_clearly(overrides, match):
    with pytest.raises(ValueError, match=match):
        config_lib.load_config("tiny", overrides)


def test_config_too_big_for_the_devices():
    cfg = config_lib.load_config("tiny", ["parallel.tp=4", "parallel.data=4"])
    with pytest.raises(ValueError, match="needs 16 devices but only 8"):
        train.loop.build_mesh(cfg)
    cfg = config_lib.load_config("tiny", ["parallel.data=2", "parallel.tp=2",
                                          "train.batch_size=5"])
    with pytest.raises(ValueError, match="train.batch_size=5 must be a positive multiple"):
        train.build(cfg, train.loop.build_mesh(cfg))


# ---------------------------------------------------------------------------------------------
# data

def test_data_is_deterministic_and_offline(cache):
    dcfg = config_lib.load_config("tiny", [f"data.paths=[{CORPUS}]", f"data.cache_dir={cache}",
                                           "model.vocab_size=512"]).data
    a = data_lib.load_corpus(dcfg, 512, verbose=False)
    b = data_lib.load_corpus(dcfg, 512, verbose=False)  # from the cache
    assert a.path == b.path and a.tokenizer_file is not None
    assert a.train.dtype == np.uint16 and 0 < a.vocab_size <= 512
    assert len(a.val) == int((len(a.train) + len(a.val)) * dcfg.val_fraction)
    batches = data_lib.Batches(a.train, 4, 32, seed=0)
    x, y = batches[7]
    assert x.shape == y.shape == (4, 32) and x.dtype == np.int32
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    np.testing.assert_array_equal(batches[7][0], data_lib.Batches(b.train, 4, 32, seed=0)[7][0])
    assert not np.array_equal(batches[7][0], batches[8][0])
    # seeds change the training windows, never the validation ones
    (t0, v0), (t1, v1) = (data_lib.split_batches(a, 4, 32, s) for s in (0, 1))
    assert not np.array_equal(t0[3][0], t1[3][0])
    np.testing.assert_array_equal(v0[3][0], v1[3][0])
    np.testing.assert_array_equal(t0[3][0], batches[3][0])
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(a.tokenizer_file))
    text = (CORPUS / "__init__.py").read_text()[:200]
    assert tok.decode(tok.encode(text).ids) == text
    by = data_lib._tokenize(["hé"], "bytes", 0, cache)
    assert by[1] == 257 and list(by[0]) == [104, 195, 169, 256]


# ---------------------------------------------------------------------------------------------
# the training program

def test_smoke_run_writes_metrics_plot_checkpoint(full_run):
    run_dir = Path(full_run["run_dir"])
    assert full_run["step"] == 6 and not full_run["interrupted"]
    assert full_run["mesh"] == {"data": 2, "pipe": 1, "tp": 2, "emulated_tp": False}
    assert full_run["codec_fwd"] == "taco" and full_run["codec_dp"] == "none"
    assert full_run["bubble_fraction"] == 0.0 and full_run["microbatches"] == 1
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(np.isfinite(r["loss"]) and r["tokens_per_s"] > 0 for r in rows)
    assert [r["step"] for r in rows if "val_loss" in r] == [3, 6]
    assert rows[-1]["loss"] < rows[0]["loss"]  # it learns, even in 6 steps
    csv_lines = (run_dir / "metrics.csv").read_text().splitlines()
    assert csv_lines[0].startswith("step,loss,val_loss") and len(csv_lines) == 7
    assert (run_dir / "loss.png").stat().st_size > 1000
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    assert (run_dir / "ckpt" / "6").is_dir() and (run_dir / "ckpt" / "3").is_dir()
    assert json.loads((run_dir / "summary.json").read_text())["final_val_loss"] == \
        full_run["final_val_loss"]
    assert full_run["step_time_s"] > 0 and full_run["final_train_loss"] == rows[-1]["loss"]
    # steps 2..3 profiled (train.profile_steps=2:3)
    assert list((run_dir / "profile").rglob("*.xplane.pb"))


def test_run_says_where_its_files_are(full_run_and_log):
    """The summary names the run's files, and the run prints them when it ends."""
    full_run, log = full_run_and_log
    run_dir = Path(full_run["run_dir"])
    files = full_run["files"]
    assert {k: Path(v).name for k, v in files.items() if k in (
        "config", "metrics", "metrics_csv", "loss_plot", "checkpoints", "summary")} == {
        "config": "config.yaml", "metrics": "metrics.jsonl", "metrics_csv": "metrics.csv",
        "loss_plot": "loss.png", "checkpoints": "ckpt", "summary": "summary.json"}
    assert all(Path(v).exists() for v in files.values())
    end = log[log.index(f"[train] run directory {run_dir}:"):]
    for path in (files["metrics"], files["loss_plot"], files["config"]):
        assert path in end
    assert f"{run_dir / 'ckpt'} (steps 3, 6)" in end


def test_run_reports_what_compression_did(full_run_and_log):
    """The call-site report once, after the first step compiled; bytes sent per step in
    every row (static: the traced sites' wire bytes); the codec error at each evaluation."""
    full_run, log = full_run_and_log
    rows = read_jsonl(Path(full_run["run_dir"]) / "metrics.jsonl")
    # one block: 2 psums (g) and 3 pvarys (f of the block's 2 sublayers + the LM head), each
    # (2, 32, 32) fp32 per device = 8 KiB, all compressed (tiny preset: recipe.min_bytes=0);
    # the data-parallel all-reduce of the gradients in two buckets (the TP-split and the
    # replicated parameters), exact (recipe.codec_dp=none)
    assert full_run["sites"] == {"compressed": 5, "uncompressed_steps": 0, "plain": 2}
    assert log.count("taco_jax collectives of one train step") == 1
    assert re.search(r"2 × psum\[tp\] float32\[2, 32, 32\] .*compressed \(taco\b", log), log
    assert re.search(r"3 × pvary\[tp\] float32\[2, 32, 32\] .*compressed \(taco\b", log), log
    assert len(re.findall(r"1 × psum\[data\] float32\[\d+\] .*plain: codec 'none'", log)) == 2
    wire = full_run["wire_bytes_per_step"]
    assert all(r["wire_bytes"] == wire for r in rows)
    # TP: two-shot of 8 KiB each, FP8 codes + scales; DP: a ring all-reduce of each
    # device's gradient shards (half of their fp32 bytes in each half over data=2)
    cfg = config_lib.load_config(Path(full_run["run_dir"]) / "config.yaml")
    params = train.build(cfg, train.loop.build_mesh(cfg)).model.abstract_params()
    dp = sum(4 * math.prod(a.sharding.shard_shape(a.shape)) for a in jax.tree.leaves(params))
    assert dp < wire < dp + 5 * 2 * 8192 * 0.6, (wire, dp)
    evals = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in evals] == [3, 6]
    for r in evals:
        assert 1e-3 < r["codec_rel_error_mean"] <= r["codec_rel_error_max"] < 0.2, r
    assert not any("codec_rel_error_mean" in r for r in rows if "val_loss" not in r)
    csv_head = (Path(full_run["run_dir"]) / "metrics.csv").read_text().splitlines()[0]
    assert "wire_bytes" in csv_head and "codec_rel_error_max" in csv_head


def _step_sites(cfg):
    """The call sites of one train step of cfg (abstract trace: nothing compiles)."""
    mesh = train.loop.build_mesh(cfg)
    prog = train.build(cfg, mesh)
    x = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.seq_len), np.int32,
                             sharding=jax.sharding.NamedSharding(mesh, parallel.BATCH_SPEC))
    _, sites = telemetry.traced_sites(jax.eval_shape, prog.step, prog.abstract_state(), x, x)
    return sites


def test_recipe_and_model_fields_decide_each_site():
    """The run's recipe (recipe.*) applies where the model leaves a field unset; a model
    field wins at its own sites. The call-site report says why a site is not compressed."""
    small = ["model.n_layer=1", "model.d_model=32", "model.vocab_size=512", "parallel.tp=2",
             "parallel.data=1", "train.batch_size=2", "model.seq_len=16"]
    sites = _step_sites(config_lib.load_config("tiny", small + ["recipe.min_bytes=1048576"]))
    assert sites and not any(s.compressed for s, _ in sites)
    assert all("< min_bytes=1048576" in s.reason for s, _ in sites)
    assert "plain: " in telemetry.site_report(sites)
    sites = _step_sites(config_lib.load_config("tiny", small + ["recipe.min_bytes=1048576",
                                                                "model.min_bytes=0",
                                                                "model.codec_fwd=none",
                                                                "recipe.codec=fp8"]))
    by_op = {s.op: s for s, _ in sites}
    assert by_op["psum"].reason == "codec 'none'" and not by_op["psum"].compressed
    assert by_op["pvary"].compressed and by_op["pvary"].codec == "fp8"
    cfg = config_lib.load_config("tiny", ["recipe.codec=echo4", "model.codec_bwd=none"])
    assert cfg.codecs() == {"fwd": "echo4", "bwd": "none", "head": "none", "pp": "echo4",
                            "dp": "none"}
    with pytest.raises(ValueError, match="recipe.codec='tac0'"):
        config_lib.load_config("tiny", ["recipe.codec=tac0"])
    with pytest.raises(ValueError, match="recipe.backend='gpu'"):
        config_lib.load_config("tiny", ["recipe.backend=gpu"])
    with pytest.raises(ValueError, match="train.profile_steps='3'"):
        config_lib.load_config("tiny", ["train.profile_steps=3"])
    with pytest.raises(ValueError, match="train.profile_steps='4:2'"):
        config_lib.load_config("tiny", ["train.profile_steps=4:2"])
    assert config_lib.load_config("tiny", ["train.profile_steps=2:5"]).train.profile_range() \
        == (2, 5)


def test_sigterm_saves_and_resume_is_bit_exact(full_run, cache, tmp_path, monkeypatch):
    """Interrupt at step 3 with SIGTERM, resume to 6: the same losses, bit for bit."""
    run_dir = tmp_path / "interrupted"
    cfg = config_lib.load_config("tiny", _overrides(cache, run_dir, "train.ckpt_every=0",
                                                    "train.codec_error=false"))
    real_getitem = data_lib.Batches.__getitem__

    def getitem(self, i):  # deliver SIGTERM while step 3 is being prepared
        if self.stream == 0 and i == 2:
            signal.raise_signal(signal.SIGTERM)
        return real_getitem(self, i)

    monkeypatch.setattr(data_lib.Batches, "__getitem__", getitem)
    first = train.run(cfg)
    monkeypatch.setattr(data_lib.Batches, "__getitem__", real_getitem)
    assert first["interrupted"] and first["step"] == 3
    assert (run_dir / "ckpt" / "3").is_dir()
    assert len(read_jsonl(run_dir / "metrics.jsonl")) == 3

    second = train.run(cfg, resume=True)
    assert second["step"] == 6 and not second["interrupted"]
    got = read_jsonl(run_dir / "metrics.jsonl")
    want = read_jsonl(Path(full_run["run_dir"]) / "metrics.jsonl")
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    for g, w in zip(got, want):
        assert g["loss"] == w["loss"] and g["grad_norm"] == w["grad_norm"], (g, w)
        assert g.get("val_loss") == w.get("val_loss")


def _flip_a_byte(step_dir: Path) -> Path:
    """Corrupt a checkpoint as a bad disk would: one byte of its largest array data file."""
    data = max((f for f in (step_dir / "state").rglob("*") if f.is_file()),
               key=lambda f: f.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    return data


def test_resume_skips_a_corrupt_checkpoint(full_run, cache, tmp_path):
    """The newest checkpoint (step 6) has a flipped byte: resuming warns naming it, sets it
    aside (not deleted), continues from step 3 and ends with the uninterrupted run's
    parameters, bit for bit."""
    from train.checkpoint import Checkpointer
    src = Path(full_run["run_dir"])
    run_dir = tmp_path / "corrupt"
    shutil.copytree(src, run_dir)
    _flip_a_byte(run_dir / "ckpt" / "6")
    cfg = config_lib.load_config("tiny", _overrides(cache, run_dir, "train.codec_error=false"))
    with pytest.warns(UserWarning, match=r"checkpoint step 6 .* unusable .*using step 3"):
        out = train.run(cfg, resume=True)
    assert out["resumed_from"] == 3 and out["step"] == 6 and not out["interrupted"]
    assert (run_dir / "ckpt_unverified" / "6" / "state").is_dir()
    got, want = (read_jsonl(d / "metrics.jsonl") for d in (run_dir, src))
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    like = train.build(cfg, train.loop.build_mesh(cfg)).abstract_state()
    finals = []
    for d in (src, run_dir):
        ck = Checkpointer(d / "ckpt")
        finals.append(ck.restore(6, like)[0])
        ck.close()
    jax.tree.map(np.testing.assert_array_equal, *finals)


def test_a_fresh_run_refuses_a_run_dir_with_checkpoints(full_run, cache, tmp_path,
                                                        monkeypatch, capsys):
    """A run without resume into a directory that holds checkpoints stops at the start,
    before anything is built (nothing compiled, the old run's files untouched), with a
    message naming the directory, its newest step and --resume; the CLI exits 2 with that
    message and no traceback."""
    from train.__main__ import main
    run_dir = tmp_path / "again"
    shutil.copytree(full_run["run_dir"], run_dir)
    metrics = (run_dir / "metrics.jsonl").read_text()
    overrides = _overrides(cache, run_dir, "train.codec_error=false")
    cfg = config_lib.load_config("tiny", overrides)

    def no_build(*args):
        raise AssertionError("built a program for a run that is refused")
    monkeypatch.setattr(train.loop, "build", no_build)
    want = rf"run directory {re.escape(str(run_dir))} already holds checkpoints \(newest: step 6\)"
    with pytest.raises(train.RunDirInUse, match=want + r".*--resume"):
        train.run(cfg)
    assert main(overrides) == 2
    err = capsys.readouterr().err
    assert re.search(want, err) and f"--resume {run_dir}" in err and "Traceback" not in err
    assert (run_dir / "metrics.jsonl").read_text() == metrics
    assert sorted(p.name for p in (run_dir / "ckpt").iterdir()) == ["3", "6"]


def test_a_full_disk_stops_the_run_with_one_message(full_run, cache, tmp_path, monkeypatch,
                                                    capfd):
    """The disk fills while step 7's checkpoint is written (in Orbax's background
    threads): the CLI prints one message naming the step, the directory and the intact
    checkpoints (a resume restarts from step 6), no traceback, and exits 1."""
    from orbax.checkpoint._src.serialization import serialization
    from train.__main__ import main
    run_dir = tmp_path / "full-disk"
    shutil.copytree(full_run["run_dir"], run_dir)

    async def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(serialization, "async_serialize_from_host", no_space)
    assert main(["--resume", str(run_dir), "train.steps=7", "train.codec_error=false",
                 "train.eval_every=0", "train.profile_steps="]) == 1
    err = capfd.readouterr().err
    assert err.count("No space left on device") == 1 and "Traceback" not in err, err
    assert (f"checkpoint of step 7 in {run_dir / 'ckpt'} could not be written: the disk is "
            f"full") in err
    assert (f"intact (steps 3, 6): `python -m train --resume {run_dir}` restarts from step 6"
            in err)
    assert saved_steps(run_dir / "ckpt") == [3, 6] and not list((run_dir / "ckpt").glob("7*"))


# The child of the kill test: a `python -m train` whose last checkpoint hangs mid-write
# (its arrays' writes wait), after saying so in a file
_HANG_IN_SAVE = """
import asyncio, sys
from pathlib import Path
from orbax.checkpoint._src.serialization import serialization
from train import checkpoint
from train.__main__ import main
flag, argv = Path(sys.argv[1]), sys.argv[2:]
real_save, real_write, saving = checkpoint.Checkpointer.save, \\
    serialization.async_serialize_from_host, []
def save(self, step, *args, **kwargs):
    saving.append(step)
    return real_save(self, step, *args, **kwargs)
async def write(*args, **kwargs):
    if saving[-1] == 6:
        flag.write_text("saving")
        await asyncio.sleep(600)
    return await real_write(*args, **kwargs)
checkpoint.Checkpointer.save = save
serialization.async_serialize_from_host = write
sys.exit(main(argv))
"""


def test_a_run_killed_while_it_saves_resumes_bit_exactly(full_run, cache, tmp_path):
    """`python -m train` killed (SIGKILL) while its step-6 checkpoint is being written:
    the step is left unfinished, and `--resume` restarts from step 3 and ends as the
    uninterrupted run did (losses, final parameters and optimizer state, bit for bit)."""
    from train.checkpoint import Checkpointer
    run_dir, flag = tmp_path / "killed", tmp_path / "saving"
    overrides = _overrides(cache, run_dir, "train.codec_error=false")
    child = subprocess.Popen([sys.executable, "-c", _HANG_IN_SAVE, str(flag), *overrides],
                             cwd=Path(__file__).resolve().parents[2],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not flag.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert flag.exists(), child.stderr.read() if child.poll() is not None else "timeout"
    finally:
        child.kill()
        child.wait()
    assert saved_steps(run_dir / "ckpt") == [3]
    assert list((run_dir / "ckpt").glob("6.orbax-checkpoint-tmp*"))   # killed mid-save
    out = train.run(config_lib.load_config("tiny", overrides), resume=True)
    assert out["resumed_from"] == 3 and out["step"] == 6
    got, want = (read_jsonl(Path(d) / "metrics.jsonl") for d in (run_dir, full_run["run_dir"]))
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in got] == \
        [(r["step"], r["loss"], r["grad_norm"]) for r in want]
    like = train.build(out_cfg := config_lib.load_config("tiny", overrides),
                       train.loop.build_mesh(out_cfg)).abstract_state()
    finals = []
    for d in (Path(full_run["run_dir"]), run_dir):
        with Checkpointer(d / "ckpt") as ck:
            finals.append(ck.restore(6, like)[0])
    jax.tree.map(np.testing.assert_array_equal, *finals)


def test_echo4_with_feedback_trains(full_run, cache, tmp_path):
    """The tiny GPT with echo4 both ways and error feedback (data=2 x tp=2, every all-reduce
    compressed): finite losses that go down and track TACO's; the feedback state is per
    forward pass, so the checkpointed state holds nothing but step, params, optimizer
    state and RNG."""
    run_dir = tmp_path / "echo4-feedback"
    cfg = config_lib.load_config("tiny", _overrides(
        cache, run_dir, "model.codec_fwd=echo4", "model.codec_bwd=echo4",
        "model.feedback=true", "model.min_bytes=0",
        "train.eval_every=0", "train.ckpt_every=0", "train.codec_error=false"))
    summary = train.run(cfg)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    losses = [r["loss"] for r in rows]
    assert len(losses) == 6 and all(np.isfinite(losses)), losses
    assert losses[-1] < losses[0], losses  # it learns (6 steps, fresh batches: noisy)
    # measured: 6.2295 -> 6.1820 (taco 6.1793, none 6.1792, echo4 without feedback 6.1861)
    taco = [r["loss"] for r in read_jsonl(Path(full_run["run_dir"]) / "metrics.jsonl")]
    assert abs(losses[-1] - taco[-1]) < 0.02, (losses, taco)
    assert summary["feedback"] is True and summary["codec_fwd"] == "echo4"
    assert np.isfinite(summary["final_val_loss"]) and (run_dir / "ckpt" / "6").is_dir()
    assert set(train.build(cfg, train.loop.build_mesh(cfg)).abstract_state()) == {
        "step", "params", "opt_state", "rng"}


def test_tp_overlap_trains(cache, tmp_path):
    """model.tp_overlap with sequence parallelism through the train program (data=2 x tp=2,
    taco): finite losses, and the call-site report names the fused ops at the sub-layers'
    sites; the LM head's all-gather stays apart."""
    run_dir = tmp_path / "tp-overlap"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        summary = train.run(config_lib.load_config("tiny", _overrides(
            cache, run_dir, "model.sequence_parallel=true", "model.tp_overlap=true",
            "train.steps=2", "train.eval_every=0", "train.ckpt_every=0",
            "train.codec_error=false")))
    log = out.getvalue()
    losses = [r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert len(losses) == 2 and all(np.isfinite(losses)), losses
    assert summary["tp_overlap"] is True and summary["sequence_parallel"] is True
    # each op once a sub-layer: the gathered input is this device's (2, 16, 32) part of
    # the sequence, the reduce-scattered output (2, 32, 32) before its scatter
    for pattern in (r"2 × all_gather_matmul\[tp\] float32\[2, 16, 32\]",
                    r"2 × matmul_reduce_scatter\[tp\] float32\[2, 32, 32\]",
                    r"1 × all_gather\[tp\] float32\[2, 16, 32\]"):
        assert re.search(pattern + r" .*compressed \(taco\b", log), (pattern, log)
    assert not re.search(r"(psum|pvary|psum_scatter)\[tp\]", log), log


def test_plot_cli_draws_several_runs(full_run, tmp_path):
    from train import plot
    out = tmp_path / "cmp.png"
    assert plot.main([full_run["run_dir"], full_run["run_dir"], "-o", str(out),
                      "--labels", "a", "b"]) == 0
    assert out.stat().st_size > 1000
    with pytest.raises(ValueError, match="no metrics.jsonl rows"):
        plot.main([str(tmp_path), "-o", str(out)])


def test_cli_resume_uses_the_runs_config(full_run):
    from train.__main__ import parse_args
    run_dir = full_run["run_dir"]
    cfg, args = parse_args(["--resume", run_dir, "train.steps=8"])
    saved = config_lib.from_dict(__import__("yaml").safe_load(
        (Path(run_dir) / "config.yaml").read_text()))
    assert args.resume == run_dir and cfg.train.run_dir == run_dir
    assert cfg.train.steps == 8 and cfg.model == saved.model and cfg.data == saved.data
    with pytest.raises(SystemExit):
        parse_args(["--resume", str(Path(run_dir) / "ckpt")])  # no config.yaml there


def test_bare_resume_takes_the_newest_runs_own_config(tmp_path, monkeypatch):
    """`--resume` without a directory continues the newest run of --config with that
    run's config.yaml (not the preset's), and an override right after it is an override,
    not the directory."""
    from train.__main__ import parse_args
    monkeypatch.chdir(tmp_path)
    saved = config_lib.load_config("tiny", ["codec=none", "train.steps=30"])
    for name in ("tiny-20260101-000000", "tiny-20260102-000000"):
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "config.yaml").write_text(config_lib.dump(saved))
    newest = Path("runs") / "tiny-20260102-000000"
    cfg, args = parse_args(["--resume"])
    assert args.resume == str(newest) and cfg.train.run_dir == str(newest)
    assert cfg.codecs()["fwd"] == "none" and cfg.train.steps == 30
    cfg, args = parse_args(["--resume", "train.steps=60"])
    assert args.resume == str(newest) and cfg.train.steps == 60
    assert cfg.codecs() == saved.codecs()


def test_bare_resume_without_a_run_is_a_usage_error(tmp_path, monkeypatch, capsys):
    from train.__main__ import parse_args
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        parse_args(["--resume"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "no run of config 'tiny' to continue in runs/" in err


@pytest.mark.parametrize("override, key", [
    ("codec=taco", "model.codec_fwd: 'none' -> 'taco'"),
    ("model.n_layer=2", "model.n_layer: 1 -> 2"),
    ("parallel.tp=4", "parallel.tp: 2 -> 4"),
    ("optim.lr=0.01", "optim.lr: 0.003 -> 0.01"),
    ("train.batch_size=8", "train.batch_size: 4 -> 8"),
])
def test_resume_refuses_to_change_what_the_run_is(tmp_path, override, key, capsys):
    """An override that would change what a run is (codecs, model, layout, optimizer,
    batch) is refused when resuming, naming it as typed and saying how to start a new
    run; the same change through train.run is refused before anything is built."""
    from train.__main__ import parse_args
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    saved = config_lib.load_config("tiny", _overrides(tmp_path, run_dir, "codec=none"))
    (run_dir / "config.yaml").write_text(config_lib.dump(saved))
    with pytest.raises(SystemExit) as e:
        parse_args(["--resume", str(run_dir), "train.steps=9", override])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert f"{override} would change what the run in {run_dir} is (" in err and key in err, err
    assert f"Start a new run instead: `python -m train --config tiny {override}`" in err
    with pytest.raises(train.errors.RunChanged, match=re.escape(key)):
        train.run(config_lib.replace(saved, [override]), resume=True)
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml"]   # nothing written
    # the same codec under another spelling changes nothing
    cfg, _ = parse_args(["--resume", str(run_dir), "model.codec_fwd=none", "train.log_every=2"])
    assert cfg.codecs() == saved.codecs() and cfg.train.log_every == 2


def test_resume_extends_a_run_and_notes_the_change(full_run, cache, tmp_path, capsys):
    """`--resume RUN_DIR train.steps=7`: the run trains one step more with its own config;
    config.yaml says 7 steps, and config_changes.jsonl notes the change at step 6."""
    from train.__main__ import main
    run_dir = tmp_path / "extended"
    shutil.copytree(full_run["run_dir"], run_dir)
    assert main(["--resume", str(run_dir), "train.steps=7", "train.codec_error=false",
                 "train.eval_every=0", "train.profile_steps="]) == 0
    out = capsys.readouterr().out
    assert "resumed at step 6 with train.codec_error: True -> False" in out
    saved = config_lib.from_dict(__import__("yaml").safe_load(
        (run_dir / "config.yaml").read_text()))
    assert saved.train.steps == 7 and saved.codecs() == config_lib.load_config(
        Path(full_run["run_dir"]) / "config.yaml").codecs()
    notes = read_jsonl(run_dir / "config_changes.jsonl")
    assert len(notes) == 1 and notes[0]["step"] == 6
    assert notes[0]["changes"]["train.steps"] == {"from": 6, "to": 7}
    assert notes[0]["changes"]["train.profile_steps"] == {"from": "2:3", "to": ""}
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == list(range(1, 8))


def test_cli_help_lists_the_presets(capsys):
    from train.__main__ import parse_args
    with pytest.raises(SystemExit) as e:
        parse_args(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for name in PRESETS:
        assert re.search(rf"^  {re.escape(name)} +\S", out, re.M), (name, out)
    assert re.search(r"^  tiny +Tiny GPT for CPU \(4 x 128, 4 heads", out, re.M)
    assert "runs/<name>-<timestamp>/" in out and "loss.png" in out


def test_cli_unknown_codec_names_what_was_typed(capsys):
    from train.__main__ import parse_args
    with pytest.raises(SystemExit):
        parse_args(["codec=tacoo"])
    err = capsys.readouterr().err
    assert "codec=tacoo: unknown codec 'tacoo'; known: taco, " in err and "echo4" in err
    assert "recipe.codec_pp" not in err


@pytest.mark.parametrize("override, named", [("model.codec_fwd=fp4", "'fp4'"),
                                             ("model.nope=1", "'model.nope'")])
def test_cli_bad_config_is_a_usage_error(override, named, capsys):
    """A bad key or value ends the program with argparse's exit 2 and the message naming
    it, not a traceback."""
    from train.__main__ import parse_args
    with pytest.raises(SystemExit) as e:
        parse_args([override])
    assert e.value.code == 2 and named in capsys.readouterr().err


def test_named_python_corpora():
    """data.paths may name this interpreter's sources: python:stdlib (the default corpus)
    and python:site-packages (a larger one, for runs longer than one stdlib epoch)."""
    assert data_lib.resolve_paths([]) == data_lib.resolve_paths(["python:stdlib"])
    sp = data_lib.resolve_paths(["python:site-packages"])
    assert sp and all(p.is_dir() and "site-packages" in str(p) for p in sp)
    files = data_lib.collect_files(["python:site-packages"])
    assert any(f.name == "__init__.py" and f.parent.name == "jax" for f in files)
    with pytest.raises(ValueError, match="python:nope"):
        data_lib.collect_files(["python:nope"])
    cfg = config_lib.load_config("tiny", ["data.paths=[python:stdlib, python:site-packages]"])
    assert list(cfg.data.paths) == ["python:stdlib", "python:site-packages"]


def test_select_files_cap_and_shuffle(tmp_path):
    files = []
    for i in range(10):
        f = tmp_path / f"f{i}.py"
        f.write_text("x" * 1000)
        files.append(f)
    assert data_lib.select_files(files) == files
    capped = data_lib.select_files(files, max_mb=0.0035)          # 3.5 kB of 10 kB: every 3rd
    assert capped == files[::3]
    mixed = data_lib.select_files(files, shuffle=True)
    assert sorted(mixed) == sorted(files) and mixed != files
    assert mixed == data_lib.select_files(list(reversed(files)), shuffle=True)  # deterministic
    with pytest.raises(ValueError, match="max_mb"):
        config_lib.load_config("tiny", ["data.max_mb=-1"])


def test_bench_train_step_sets_the_recipe(tmp_path):
    """python -m bench.train_step: a codec-name variant is the run's recipe on every axis;
    `@default` leaves the library's threshold, under which these small all-reduces stay
    plain."""
    from bench import train_step
    out = tmp_path / "train_step.json"
    train_step.main(["--presets", "tiny", "--variants", "taco", "taco@default", "--tp", "2",
                     "--steps", "1", "--out", str(out), "--set", "model.n_layer=1",
                     "model.d_model=32", "model.vocab_size=512", "model.seq_len=32",
                     "train.batch_size=4", "parallel.data=1", "parallel.cpu_devices=8"])
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    taco, default = rows["taco"], rows["taco@default"]
    assert taco["mesh"] == "1x1x2" and taco["codec_tp"] == taco["codec_dp"] == "taco"
    assert taco["compressed_sites"] == 5 and default["compressed_sites"] == 0
    assert 0 < taco["wire_mib_per_step"] < default["wire_mib_per_step"]
    assert taco["bubble_fraction"] == 0.0
    with pytest.raises(ValueError, match="variant 'tp\\+xx'"):
        train_step.main(["--variants", "tp+xx"])
    with pytest.raises(ValueError, match="--mesh '2,2' must be DATA,PIPE,TP"):
        train_step.main(["--mesh", "2,2"])
