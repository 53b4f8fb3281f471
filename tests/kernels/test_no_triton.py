"""Without Pallas' Triton backend (deprecated from jax 0.11, to be removed): `import taco_jax`
works, a compressed psum gives the right result, and asking for the Triton kernels runs
the references instead, with one warning naming the missing module. Each check runs in a
fresh process whose import of `jax.experimental.pallas.triton` fails."""
import os
import subprocess
import sys
import textwrap

BLOCK_TRITON = """
import importlib.abc, sys

class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "jax.experimental.pallas.triton":
            raise ImportError("No module named 'jax.experimental.pallas.triton'")
        return None

sys.meta_path.insert(0, NoTriton())
"""


def run_without_triton(body: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("TACO_JAX_BACKEND", None)
    return subprocess.run([sys.executable, "-c", BLOCK_TRITON + textwrap.dedent(body)],
                          capture_output=True, text=True, env=env, timeout=600)


def test_psum_without_the_triton_backend():
    r = run_without_triton("""
        import jax
        jax.config.update("jax_num_cpu_devices", 2)
        import numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P
        import taco_jax

        mesh = jax.make_mesh((2,), ("tp",))
        x = np.random.default_rng(0).standard_normal((2, 8192)).astype(np.float32)

        @jax.jit
        @jax.shard_map(mesh=mesh, in_specs=P("tp"), out_specs=P())
        def allreduce(v):
            return taco_jax.psum(v[0], "tp")

        with taco_jax.config(min_bytes=0):
            y = np.asarray(allreduce(jax.device_put(x, NamedSharding(mesh, P("tp")))))
        exact = x.sum(0)
        err = np.linalg.norm(y - exact) / np.linalg.norm(exact)
        assert 0 < err < 0.05, err                       # compressed, within FP8's error
        assert "jax.experimental.pallas.triton" not in sys.modules
        print("ok", err)
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("ok")


def test_triton_kernels_asked_for_run_the_references_and_warn_once():
    r = run_without_triton("""
        import warnings
        import numpy as np
        import jax.numpy as jnp
        import taco_jax
        from taco_jax.kernels import dispatch

        x = jnp.asarray(np.random.default_rng(1).standard_normal((8, 256)), jnp.float32)
        codec = taco_jax.codecs.get("taco")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with taco_jax.config(backend="interpret"):
                assert dispatch.impl_for("compress", codec, x.shape, x.dtype) == "reference"
                w = dispatch.compress(x, codec)
                y = dispatch.decompress(w, codec)
        np.testing.assert_array_equal(np.asarray(w), np.asarray(codec.compress_reference(x)))
        np.testing.assert_array_equal(np.asarray(y),
                                      np.asarray(codec.decompress_reference(w)))
        named = [s for s in seen if "jax.experimental.pallas.triton" in str(s.message)]
        assert len(named) == 1, [str(s.message) for s in seen]
        print("ok")
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("ok")
