"""train/: checkpoints are verified when restored (a corrupt one is skipped, never
deleted), a failed checkpoint write says so once, one trainer holds a run directory, a
metrics file cut short and a damaged token cache are repaired, and multi-process decisions
are agreed before anyone acts on them."""
import errno
import gc
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import train
from train import config as config_lib
from train import data as data_lib
from train import multihost
from train.checkpoint import Checkpointer, fingerprint, saved_steps
from train.errors import CheckpointWriteError, CorruptRunFile, TokenCacheError
from train.metrics import MetricsWriter, read_jsonl

# Orbax's failed restores used to leave reads that ended on a closed event loop: any
# exception nobody could catch is an error here
pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
ROOT = Path(__file__).resolve().parents[2]


def _state(step):
    """A train-state-like pytree on a 2-device mesh: a sharded array, replicated scalars."""
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))  # noqa: E731
    return {"step": put(np.int32(step)), "b": put(np.ones((3,), jnp.bfloat16)),
            "w": put(np.arange(4096, dtype=np.float32) * (step + 1), "x")}


def _checkpoints(tmp_path, steps=(1, 2, 3), name="run"):
    ck = Checkpointer(tmp_path / "ckpt", keep=5, async_save=False)
    for s in steps:
        ck.save(s, _state(s), {"data_pos": s, "name": name})
    ck.close()
    return tmp_path / "ckpt"


def _corrupt(step_dir):
    data = max((f for f in (step_dir / "state").rglob("*") if f.is_file()),
               key=lambda f: f.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))


def test_fingerprint_sees_one_changed_element():
    a = _state(1)
    f = fingerprint(a)
    assert len(f) == 3 and f == fingerprint(jax.tree.map(jnp.copy, a))
    w = np.asarray(a["w"]).copy()
    w[1234] = np.nextafter(w[1234], np.inf)              # one bit of one element
    b = dict(a, w=jax.device_put(w, a["w"].sharding))
    assert fingerprint(b) != f
    # the same values on one device: same fingerprint (exact integer sums)
    assert fingerprint(jax.device_get(a)) == f


def test_saved_steps_reads_without_creating(tmp_path):
    assert saved_steps(_checkpoints(tmp_path)) == [1, 2, 3]
    assert saved_steps(tmp_path / "none") == [] and not (tmp_path / "none").exists()


def test_restore_latest_skips_corrupt_steps(tmp_path):
    directory = _checkpoints(tmp_path)
    _corrupt(directory / "3")
    ck = Checkpointer(directory)
    with pytest.warns(UserWarning, match=r"checkpoint step 3 .* unusable .*using step 2"):
        state, meta, step = ck.restore_latest(_state(0), name="run")
    assert step == 2 and meta["data_pos"] == 2 and int(state["step"]) == 2
    np.testing.assert_array_equal(state["w"], np.arange(4096, dtype=np.float32) * 3)
    assert ck.all_steps() == [1, 2]                       # the manager no longer sees it
    assert (tmp_path / "ckpt_unverified" / "3" / "state").is_dir()   # kept, not deleted
    ck.save(3, _state(3), {"data_pos": 3, "name": "run"})  # the step can be written again
    assert ck.restore_latest(_state(0), name="run")[2] == 3
    ck.close()


def test_restore_latest_metadata_mismatch_and_read_only(tmp_path):
    directory = _checkpoints(tmp_path, steps=(1, 2))
    meta = directory / "2" / "meta" / "metadata"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "data_pos": 7}))
    ck = Checkpointer(directory)
    with pytest.warns(UserWarning, match=r"step 2 .*data_pos=7 is not the step"):
        assert ck.restore_latest(_state(0), name="run", set_aside=False)[2] == 1
    assert ck.all_steps() == [1, 2] and not (tmp_path / "ckpt_unverified").exists()
    with pytest.warns(UserWarning, match=r"step 2 .*data_pos"):
        assert ck.restore_latest(_state(0), set_aside=False)[2] == 1
    ck.close()


def test_restore_latest_fails_clearly_when_nothing_restores(tmp_path):
    """A step with a file missing is found unusable from the listing of its files, before
    Orbax reads it: a failed Orbax restore leaves reads in flight that end on its closed
    event loop ("RuntimeError: Event loop is closed", orbax-checkpoint 0.12.8), which this
    file turns into an error."""
    directory = _checkpoints(tmp_path, steps=(1, 2))
    (directory / "2" / "state" / "manifest.ocdbt").unlink()         # unreadable
    with Checkpointer(directory) as ck:
        with pytest.raises(RuntimeError, match=r"no checkpoint .* can be restored: step 2: "
                                               r"its file state/manifest.ocdbt is missing; "
                                               r"step 1: metadata name='run', expected "
                                               r"'other'"):
            ck.restore_latest(_state(0), name="other")
        assert ck.all_steps() == [1, 2] and (directory / "2").is_dir()  # all left in place
    with Checkpointer(tmp_path / "empty") as ck:
        assert ck.restore_latest(_state(0)) is None
    gc.collect()


def test_agree_any_single_process_needs_no_collective():
    def gather(_):
        raise AssertionError("no collective with one process")
    assert multihost.agree_any(True, gather) is True
    assert multihost.agree_any(False, gather) is False


def test_agree_any_across_processes(monkeypatch):
    """With several processes the local flag is all-gathered: one process's signal stops
    every process, and without one none stops."""
    monkeypatch.setattr(jax, "process_count", lambda: 3)
    sent = []

    def fake_allgather(others):
        def gather(x):
            sent.append(int(x))
            return np.array([int(x), *others], np.int32)
        return gather
    assert multihost.agree_any(False, fake_allgather([0, 1])) is True    # another's SIGTERM
    assert multihost.agree_any(True, fake_allgather([0, 0])) is True
    assert multihost.agree_any(False, fake_allgather([0, 0])) is False
    assert sent == [0, 1, 0]


# ---------------------------------------------------------------------------------------------
# a checkpoint write that fails (a full disk)

def _no_space(monkeypatch):
    """Every array write of a checkpoint from now on fails as on a full disk, inside
    Orbax's background threads."""
    from orbax.checkpoint._src.serialization import serialization

    async def write(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(serialization, "async_serialize_from_host", write)


@pytest.mark.parametrize("async_save", [True, False])
def test_a_full_disk_is_reported_once(tmp_path, monkeypatch, capfd, async_save):
    """The write of step 3 fails on a full disk: one CheckpointWriteError names the step,
    the directory, and the steps that are intact (the newest of which a resume restarts
    from), none of Orbax's background threads' tracebacks is printed, and the directory
    then resumes from step 2."""
    directory = _checkpoints(tmp_path, steps=(1, 2))
    _no_space(monkeypatch)
    ck = Checkpointer(directory, keep=2, async_save=async_save)
    want = (rf"checkpoint of step 3 in {re.escape(str(directory))} could not be written: the "
            rf"disk is full \(OSError: \[Errno 28\] No space left on device\)\. The "
            rf"checkpoints already there are intact \(steps 1, 2\): `python -m train --resume "
            rf"{re.escape(str(tmp_path))}` restarts from step 2")
    with pytest.raises(CheckpointWriteError, match=want):
        ck.save(3, _state(3), {"data_pos": 3, "name": "run"})
        ck.close()               # an asynchronous save's failure: when it is waited for
    ck.close()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "No space left" not in err, err
    monkeypatch.undo()
    assert saved_steps(directory) == [1, 2]     # keep=2 removed nothing for the failed one
    with Checkpointer(directory) as ck:
        assert ck.restore_latest(_state(0), name="run")[2] == 2
        assert not list(directory.glob("3*"))   # the unfinished step cleared


def test_a_failure_that_is_not_the_storage_is_raised_as_it_is(tmp_path, monkeypatch):
    from orbax.checkpoint._src.serialization import serialization

    async def write(*args, **kwargs):
        raise KeyError("a bug")
    monkeypatch.setattr(serialization, "async_serialize_from_host", write)
    with pytest.raises(KeyError, match="a bug"):
        with Checkpointer(tmp_path / "ckpt", async_save=False) as ck:
            ck.save(1, _state(1), {"data_pos": 1, "name": "run"})


# ---------------------------------------------------------------------------------------------
# one trainer per run directory

_HOLD = ("import sys, time; from train.rundir import RunDirLock; RunDirLock(sys.argv[1]); "
         "print('held', flush=True); time.sleep(120)")


def test_a_second_trainer_is_refused(tmp_path, monkeypatch, capsys):
    """Another process trains in the run directory (it holds the lock): a fresh run and a
    resumed one into it stop at the start, before anything is built, naming the
    directory and the holder (pid, host); the CLI exits 2 without a traceback. The lock
    dies with its holder, killed or not."""
    from train.__main__ import main
    from train.rundir import RunDirLock
    run_dir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(run_dir)], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"

        def no_build(*args):
            raise AssertionError("built a program for a run that is refused")
        monkeypatch.setattr(train.loop, "build", no_build)
        want = (rf"run directory {re.escape(str(run_dir))} is in use by another trainer "
                rf"\(pid {holder.pid} on host {re.escape(socket.gethostname())} since ")
        overrides = ["parallel.tp=2", "train.progress=false", f"train.run_dir={run_dir}"]
        assert main(overrides) == 2
        err = capsys.readouterr().err
        assert re.search(want, err) and "Traceback" not in err, err
        with pytest.raises(train.RunDirInUse, match=want):
            train.run(config_lib.load_config("tiny", overrides), resume=True)
    finally:
        holder.kill()
        holder.wait()
    with RunDirLock(run_dir) as lock:             # free again: a killed holder held nothing
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()
        with pytest.raises(train.RunDirInUse, match=rf"pid {os.getpid()}"):
            RunDirLock(run_dir)                   # held, even against this process
    # a run that stopped before it wrote anything leaves no directory behind
    fresh = tmp_path / "fresh"
    RunDirLock(fresh).release()
    assert not fresh.exists()


# ---------------------------------------------------------------------------------------------
# metrics.jsonl cut short

def _rows(n):
    return "".join(json.dumps({"step": i, "loss": 1.0 / i}) + "\n" for i in range(1, n + 1))


def test_metrics_cut_short_are_repaired_on_resume(tmp_path):
    """A run killed while it appended a row leaves half a line: resuming drops it with a
    warning naming the file and line, keeps the rows up to the restored step, and leaves
    a file that reads whole."""
    jsonl = tmp_path / "metrics.jsonl"
    jsonl.write_text(_rows(5) + '{"step": 6, "lo')
    with pytest.warns(UserWarning, match=rf"{re.escape(str(jsonl))}, line 6 \(the last\): "
                                         r"not a JSON row .*dropped it"):
        MetricsWriter(tmp_path, truncate_after=4).close()
    assert [r["step"] for r in read_jsonl(jsonl)] == [1, 2, 3, 4]
    assert jsonl.read_text() == _rows(4)
    assert len((tmp_path / "metrics.csv").read_text().splitlines()) == 5


def test_a_damaged_metrics_line_in_the_middle_is_an_error(tmp_path):
    jsonl = tmp_path / "metrics.jsonl"
    jsonl.write_text(_rows(2) + "garbage\n" + _rows(4)[len(_rows(3)):] + "\n")
    with pytest.raises(CorruptRunFile, match=rf"{re.escape(str(jsonl))}, line 3 of 4: not a "
                                             r"JSON row"):
        MetricsWriter(tmp_path, truncate_after=4)
    assert "garbage" in jsonl.read_text()           # nothing rewritten


# ---------------------------------------------------------------------------------------------
# a damaged token cache

def _damage_truncated(entry):
    raw = (entry / "tokens.bin").read_bytes()
    (entry / "tokens.bin").write_bytes(raw[:-1])


def _damage_empty(entry):
    (entry / "tokens.bin").write_bytes(b"")


def _damage_meta(entry):
    (entry / "meta.json").write_text('{"dtype": "uint16", "n_tok')


def _damage_flipped(entry):
    raw = bytearray((entry / "tokens.bin").read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    (entry / "tokens.bin").write_bytes(bytes(raw))


def _damage_no_meta(entry):
    (entry / "meta.json").unlink()


@pytest.mark.parametrize("damage,why", [
    (_damage_truncated, r"tokens.bin holds \d+ bytes, but meta.json records \d+ uint16 tokens"),
    (_damage_empty, r"tokens.bin holds 0 bytes"),
    (_damage_meta, r"meta.json unreadable"),
    (_damage_flipped, r"tokens.bin does not match the sha256 meta.json records"),
    (_damage_no_meta, r"no meta.json"),
])
def test_a_damaged_token_cache_is_rebuilt(tmp_path, damage, why):
    text = tmp_path / "corpus.py"
    text.write_text("def f(x):\n    return x + 1\n" * 200)
    dcfg = config_lib.load_config("tiny", [f"data.paths=[{text}]", "data.tokenizer=bytes",
                                           f"data.cache_dir={tmp_path / 'cache'}"]).data
    first = data_lib.load_corpus(dcfg, 512, verbose=False)
    tokens = np.concatenate([first.train, first.val])
    damage(first.path)
    with pytest.warns(UserWarning, match=rf"token cache entry {re.escape(str(first.path))} "
                                         rf"is damaged \({why}.*\); rebuilding it"):
        again = data_lib.load_corpus(dcfg, 512, verbose=False)
    assert again.path == first.path and data_lib.check_entry(again.path) is None
    np.testing.assert_array_equal(np.concatenate([again.train, again.val]), tokens)


def test_a_token_cache_that_cannot_be_rebuilt_is_refused(tmp_path, monkeypatch):
    text = tmp_path / "corpus.py"
    text.write_text("x = 1\n" * 500)
    dcfg = config_lib.load_config("tiny", [f"data.paths=[{text}]", "data.tokenizer=bytes",
                                           f"data.cache_dir={tmp_path / 'cache'}"]).data
    entry = data_lib.load_corpus(dcfg, 512, verbose=False).path
    _damage_empty(entry)

    def read_only(path):
        raise PermissionError(13, "Permission denied", str(path))
    monkeypatch.setattr(data_lib.shutil, "rmtree", read_only)
    with pytest.warns(UserWarning, match="rebuilding it"), \
            pytest.raises(TokenCacheError, match=rf"token cache entry {re.escape(str(entry))} is "
                                                 r"damaged \(tokens.bin holds 0 bytes.*\) and "
                                                 r"could not be removed .*Permission denied"):
        data_lib.load_corpus(dcfg, 512, verbose=False)
