"""train/: checkpoints are verified when restored (a corrupt one is skipped, never
deleted), and multi-process decisions are agreed before anyone acts on them."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from train import multihost
from train.checkpoint import Checkpointer, fingerprint, saved_steps


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
    directory = _checkpoints(tmp_path, steps=(1, 2))
    (directory / "2" / "state" / "manifest.ocdbt").unlink()         # unreadable
    ck = Checkpointer(directory)
    with pytest.raises(RuntimeError, match=r"no checkpoint .* can be restored: step 2: "
                                           r"restore failed: .*; step 1: metadata "
                                           r"name='run', expected 'other'"):
        ck.restore_latest(_state(0), name="other")
    assert ck.all_steps() == [1, 2] and (directory / "2").is_dir()    # all left in place
    ck.close()
    assert Checkpointer(tmp_path / "empty").restore_latest(_state(0)) is None


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
