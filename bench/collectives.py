"""taco_jax.psum vs lax.psum, side by side in one run, per transport, size and link.

    python -m bench.collectives [--sizes-mib 1 4 16 64 256 1024] [--codecs taco]
        [--transports xla fused fused-none lax-kernels] [--link nvlink|pcie|network]
        [--check] [--out bench/results/collectives.json]

Transports: "xla" (taco over XLA's all-to-all / all-gather), "fused" (taco by in-kernel
stores into the peers' memory; GPUs of one process), "fused-none" (the fused kernel with
codec "none": an exact all-reduce), "lax-kernels" (lax.psum with XLA's own all-reduce
kernels, --xla_gpu_experimental_use_collective_kernels=ALL_REDUCE: run in a child process,
since XLA reads its flags once). Transports that cannot run on the link are skipped.

Links: "nvlink" (as found), "pcie" (NCCL_P2P_DISABLE=1: NCCL through host memory, as on
servers without NVLink), "network" (two processes with one GPU each, jax.distributed, and
NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1: NCCL's socket transport, as between hosts). A link
other than the current one re-runs this program in child processes with that environment
(NVLink multicast stays off in every one of them).

`ratio` = taco / lax.psum on a reused input; `fresh_ratio` the same on an input computed in
the call (x · one), net of that multiply: lax.psum then pays no copy of a reused buffer, as
in a model. --check verifies on the devices: identical outputs everywhere, error vs
lax.psum, gradients under check_vma True and False, NaN/Inf propagation, odd sizes, bf16
and f32. Rows: {"mib_per_device", "codec", "transport", "link", "n_devices",
"lax_psum_us", "taco_psum_us", "ratio", "fresh_ratio"}.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile

from taco_jax import routes

MIB = 1 << 20
TRANSPORTS = (*routes.TRANSPORTS, "fused-none", "lax-kernels")
LINK_ENV = {"nvlink": {}, "pcie": {"NCCL_P2P_DISABLE": "1"},
            "network": {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}}
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}
KERNELS_FLAG = "--xla_gpu_experimental_use_collective_kernels=ALL_REDUCE"


def child_env(extra: dict) -> dict:
    env = {**os.environ, **extra, **NO_MULTICAST}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_children(argv: list[str], link: str, n_proc: int, out: str) -> dict:
    """Re-run this program under `link`'s environment (n_proc processes for "network")."""
    cmd = [sys.executable, "-m", "bench.collectives", *argv, "--child", "--out", out]
    if n_proc == 1:
        subprocess.run(cmd, env=child_env(LINK_ENV[link]), check=True)
    else:
        procs = []
        with socket.socket() as s:       # a free port for the coordinator
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        for i in range(n_proc):
            env = child_env({**LINK_ENV[link], "CUDA_VISIBLE_DEVICES": str(i),
                             "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                             "JAX_NUM_PROCESSES": str(n_proc), "JAX_PROCESS_ID": str(i)})
            procs.append(subprocess.Popen(cmd + ["--distributed"], env=env))
        codes = [p.wait() for p in procs]
        if any(codes):
            raise RuntimeError(f"network-link children exited with {codes}")
    with open(out) as f:
        return json.load(f)


def measure(args) -> dict:
    import jax
    if args.distributed:
        # Gloo carries CPU collectives between processes (a CPU smoke run of the network
        # link); the setting is ignored on GPUs. jax reads only the coordinator's address
        # from the environment, so the process count and index are passed.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(os.environ["JAX_COORDINATOR_ADDRESS"],
                                   int(os.environ["JAX_NUM_PROCESSES"]),
                                   int(os.environ["JAX_PROCESS_ID"]))
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import taco_jax
    from bench.common import env_facts, print_table
    from taco_jax import calibrate
    from taco_jax.collectives import fused

    n_dev = jax.device_count()
    mesh = jax.make_mesh((n_dev,), ("tp",))
    jax.set_mesh(mesh)
    link = calibrate.link()
    spec = P("tp")

    def sharded(fn, vma=True):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec,
                                     out_specs=P() if vma else spec, check_vma=vma))

    lax_fn = sharded(lambda v: jax.lax.psum(v, "tp"))
    usable = []
    for t in args.transports:
        if t.startswith("fused") and fused.mesh_unavailable_reason(mesh):
            print(f"skip {t}: {fused.mesh_unavailable_reason(mesh)}")
        elif t == "lax-kernels" and KERNELS_FLAG not in os.environ.get("XLA_FLAGS", ""):
            continue                                    # measured by its own child process
        else:
            usable.append(t)

    def taco_fn(codec, t, vma=True):
        if t == "lax-kernels":
            return lax_fn
        c, tr = ("none", "fused") if t == "fused-none" else (codec, t)
        return sharded(lambda v: taco_jax.psum(v, "tp", codec=c, min_bytes=0, transport=tr),
                       vma)

    result = {**env_facts(), "link": link, "n_devices": n_dev, "check": [], "rows": []}
    if args.check:
        result["check"] = check(mesh, args.codecs, usable, taco_fn, lax_fn, link)
        print_table(result["check"], list(result["check"][0]) if result["check"] else [])
    for mib in args.sizes_mib:
        n = int(mib * MIB) // 2
        x = jax.device_put(jax.random.normal(jax.random.key(0), (n_dev * n,), jnp.bfloat16),
                           NamedSharding(mesh, spec))
        iters = int(max(2, min(10, 2048 // max(mib, 1))))
        kw = {"iters": iters, "repeats": 3}
        lax_us = calibrate.time_calls(lax_fn, x, **kw)
        for codec in args.codecs:
            for t in usable:
                fn = taco_fn(codec, t)
                us = calibrate.time_calls(fn, x, **kw)
                prep, (fl, ft) = calibrate.fresh_times([lax_fn, fn], x, **kw)
                row = {"mib_per_device": mib, "codec": "none" if t in ("fused-none",
                                                                        "lax-kernels")
                       else codec, "transport": t, "link": link, "n_devices": n_dev,
                       "lax_psum_us": round(lax_us, 1), "taco_psum_us": round(us, 1),
                       "ratio": round(us / lax_us, 3),
                       # None where the multiply alone took as long as lax.psum with it
                       # (timer noise at tiny sizes): no ratio to report
                       "fresh_ratio": (round((ft - prep) / (fl - prep), 3) if fl > prep
                                       else None)}
                result["rows"].append(row)
                print(row, flush=True)
        del x
    return result


def all_shards(arr) -> list:
    """Every device's shard of `arr` as f32 numpy, from all processes, in device order."""
    import numpy as np
    from jax.experimental import multihost_utils
    local = sorted(arr.addressable_shards, key=lambda s: s.device.id)
    stacked = multihost_utils.process_allgather(
        np.stack([np.asarray(s.data, np.float32) for s in local]))
    return list(stacked.reshape(-1, *stacked.shape[2:]))


def check(mesh, codecs_, transports, taco_fn, lax_fn, link) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    n_dev = mesh.size
    rows = []
    for codec in codecs_:
        for t in transports:
            if t == "lax-kernels":
                continue
            for dtype, n in ((jnp.bfloat16, 4 * MIB // 2), (jnp.float32, 333_333)):
                x = jax.random.normal(jax.random.key(1), (n_dev, n), jnp.float32)
                x = x.at[0, 5].set(jnp.nan).at[n_dev - 1, n - 3].set(jnp.inf).astype(dtype)
                xs = jax.device_put(x.reshape(-1), NamedSharding(mesh, P("tp")))
                for vma in (True, False):
                    fn = taco_fn(codec, t, vma)
                    # every device's copy of the sum (out_specs P() or P("tp") alike), from
                    # every process: what a multi-process run can compare
                    shards = all_shards(fn(xs))
                    ref = all_shards(lax_fn(xs))[0]
                    y = shards[0]
                    # a non-finite input makes its whole block non-finite (never finite)
                    fin = np.isfinite(ref) & np.isfinite(y)
                    g = np.concatenate(all_shards(jax.grad(
                        lambda v: jnp.sum(jnp.sin(fn(v).astype(jnp.float32))))(xs)))
                    rows.append({
                        "codec": "none" if t == "fused-none" else codec, "transport": t,
                        "link": link, "dtype": jnp.dtype(dtype).name, "n": n,
                        "check_vma": vma,
                        "identical_on_all_devices": all(np.array_equal(shards[0], s, True)
                                                        for s in shards),
                        "nonfinite_kept": bool(np.all(~np.isfinite(y)[~np.isfinite(ref)])),
                        "nonfinite_extra_frac": float(np.mean(np.isfinite(ref)
                                                              & ~np.isfinite(y))),
                        "rel_error_vs_lax": float(np.linalg.norm(y[fin] - ref[fin])
                                                  / np.linalg.norm(ref[fin])),
                        "grad_finite_frac": float(np.mean(np.isfinite(g))),
                    })
                    print(rows[-1], flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    ap.add_argument("--codecs", nargs="+", default=["taco"])
    ap.add_argument("--transports", nargs="+", default=list(TRANSPORTS), choices=TRANSPORTS)
    ap.add_argument("--link", choices=list(LINK_ENV), default="nvlink")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--out", default="bench/results/collectives.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--distributed", action="store_true", help=argparse.SUPPRESS)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    if args.child:
        result = measure(args)
        import jax
        if jax.process_index() == 0:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
        return result
    base = ["--sizes-mib", *map(str, args.sizes_mib), "--codecs", *args.codecs,
            *(["--check"] if args.check else [])]
    others = [t for t in args.transports if t != "lax-kernels"]
    n_proc = 2 if args.link == "network" else 1
    with tempfile.TemporaryDirectory() as tmp:
        res = run_children([*base, "--transports", *(others or ["xla"])], args.link, n_proc,
                           os.path.join(tmp, "main.json"))
        if not others:
            res["rows"] = []
        if "lax-kernels" in args.transports and n_proc == 1:
            # XLA reads its flags once per process: lax.psum with XLA's collective kernels
            # runs in its own child; its rows compare with lax.psum of the run above
            flags = (os.environ.get("XLA_FLAGS", "") + " " + KERNELS_FLAG).strip()
            out = os.path.join(tmp, "kernels.json")
            subprocess.run([sys.executable, "-m", "bench.collectives", *base, "--transports",
                            "lax-kernels", "--child", "--out", out],
                           env=child_env({**LINK_ENV[args.link], "XLA_FLAGS": flags}),
                           check=True)
            with open(out) as f:
                kern = json.load(f)
            base_lax = {r["mib_per_device"]: r["lax_psum_us"] for r in res["rows"]}
            for r in kern["rows"]:
                lax_us = base_lax.get(r["mib_per_device"])
                if lax_us:
                    r.update(lax_psum_us=lax_us, ratio=round(r["taco_psum_us"] / lax_us, 3),
                             fresh_ratio=None, note="lax.psum of the main run as baseline")
                res["rows"].append(r)
    from bench.common import print_table, write_json
    print_table(res["rows"], ["mib_per_device", "codec", "transport", "link", "lax_psum_us",
                              "taco_psum_us", "ratio", "fresh_ratio"])
    write_json(args.out, res)
    return res


if __name__ == "__main__":
    main()
