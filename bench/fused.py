"""The fused transport's exchange kernel on the GPUs of this process: correctness, then time.

    python -m bench.fused [--sizes-mib 1 16 256] [--out bench/results/fused.json]

Needs P ≥ 2 GPUs driven by this process (on one GPU XLA refuses the kernel's collective
metadata: "UNIMPLEMENTED: NVSHMEM is not supported in XLA"; elsewhere the fused transport's
own reason); it exits with that reason otherwise. Each device's bytes are checked in every
peer's slot, for the all-gather and the all-to-all, with and without the ready handshake
(`fused.HANDSHAKE`), and timed against lax.all_gather / lax.all_to_all of the same bytes
side by side (`time_calls`)."""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from bench.common import env_facts, print_table, write_json
from taco_jax import calibrate
from taco_jax.collectives import fused

MIB = 1 << 20


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 16, 256])
    ap.add_argument("--out", default="bench/results/fused.json")
    a = ap.parse_args(argv)
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("tp",))
    reason = fused.mesh_unavailable_reason(mesh) or (
        None if n >= 2 else "one device (in-kernel peer stores need 2 or more GPUs)")
    if reason:
        raise SystemExit(f"bench.fused: cannot run here: {reason}")
    spec = P("tp")
    rows, checks = [], []

    def sharded(fn):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec,
                                     check_vma=False))

    for mib in a.sizes_mib:
        m = int(mib * MIB)
        for gather in (True, False):
            shape = (n, m) if gather else (n, n, m // n)
            x = jax.random.randint(jax.random.key(0), shape, 0, 256, jnp.int32)
            x = jax.device_put(x.astype(jnp.uint8), NamedSharding(mesh, spec))
            ref = sharded(lambda v: (lax.all_gather(v[0], "tp") if gather else
                                     lax.all_to_all(v[0], "tp", 0, 0))[None])
            want = np.asarray(ref(x))
            t_ref = calibrate.time_calls(ref, x, iters=5)
            for handshake in (False, True):
                ours = sharded(lambda v, h=handshake: fused.exchange(
                    v[0], "tp", n, gather=gather, vma=False, handshake=h)[None])
                ok = bool(np.array_equal(np.asarray(ours(x)), want))
                checks.append({"mib": mib, "op": "all_gather" if gather else "all_to_all",
                               "handshake": handshake, "n_devices": n, "equal_to_lax": ok})
                print(checks[-1], flush=True)
                if ok:
                    t_ours = calibrate.time_calls(ours, x, iters=5)
                    rows.append({"mib": mib, "op": checks[-1]["op"], "handshake": handshake,
                                 "n_devices": n, "fused_us": round(t_ours, 1),
                                 "lax_us": round(t_ref, 1), "ratio": round(t_ours / t_ref, 3)})
    print_table(checks, list(checks[0]))
    if rows:
        print_table(rows, list(rows[0]))
    write_json(a.out, {**env_facts(), "link": calibrate.link(), "check": checks, "rows": rows})


if __name__ == "__main__":
    main()
