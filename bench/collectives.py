"""taco_jax.psum vs lax.psum on bf16, side by side in one run, over all local devices.

    python bench/collectives.py [--sizes-mib 1 4 16 64 256 1024] [--codecs taco] [--out PATH]

Each row: lax.psum time, taco_jax.psum time with the library's default size threshold
(what users get) and forced compression (min_bytes=0), and their ratios to lax.psum.

The timing loop feeds the same input buffer to every call, and XLA then copies it before
lax.psum's in-place NCCL all-reduce (a MemcpyD2D of the whole tensor, 127 µs of 1065 at
256 MiB in bench/results/profile_psum.json) that a psum of a freshly computed activation
never pays; taco's kernels read the input and need no copy. The `fresh_*` columns time
both on an input made inside the loop (x · one, `one` a runtime scalar), minus that
multiply timed alone: `fresh_ratio` = (taco − prep) / (lax − prep), the ratio a model sees.
Also checks on the device that outputs are identical on every device and that the error vs
lax.psum is what the codec promises. Writes bench/results/collectives.json.
"""
from __future__ import annotations

import argparse
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
from bench.common import env_facts, print_table, time_loop, write_json  # noqa: E402
import taco_jax  # noqa: E402
from taco_jax import calibrate as tuning  # noqa: E402

MIB = 1 << 20


def make_fns(mesh, codec, min_bytes, check_vma=True, chunk_bytes=None):
    out = P() if check_vma else P("tp")

    def taco(v):
        return taco_jax.psum(v, "tp", codec=codec, min_bytes=min_bytes, chunk_bytes=chunk_bytes)
    lax_fn = jax.shard_map(lambda v: jax.lax.psum(v, "tp"), mesh=mesh, in_specs=P("tp"),
                           out_specs=out, check_vma=check_vma)
    taco_fn = jax.shard_map(taco, mesh=mesh, in_specs=P("tp"), out_specs=out,
                            check_vma=check_vma)
    return lax_fn, taco_fn


def fresh(lax_fn, taco_fn, x) -> dict:
    """Times on an input computed in the loop (no copy before lax.psum), net of that work."""
    prep, lax_us, taco_us = tuning.fresh_times(lax_fn, taco_fn, x)
    return {"fresh_prep_us": round(prep, 1), "fresh_lax_us": round(lax_us, 1),
            "fresh_taco_us": round(taco_us, 1),
            "fresh_ratio": round((taco_us - prep) / max(lax_us - prep, 1e-9), 3)}


def check(mesh, codec, n_dev):
    """Replicated output and error vs lax.psum, both check_vma modes, on this device."""
    rows = []
    x = jax.random.normal(jax.random.key(1), (n_dev * 4 * MIB // 2,), jnp.bfloat16)
    x = jax.device_put(x, NamedSharding(mesh, P("tp")))
    for vma in (True, False):
        lax_fn, taco_fn = make_fns(mesh, codec, 0, vma)
        ref = np.asarray(jax.jit(lax_fn)(x), np.float32)
        got = jax.jit(taco_fn)(x)
        if vma:
            shards = [np.asarray(s.data, np.float32) for s in got.addressable_shards]
            got = np.asarray(got, np.float32)
        else:
            got = np.asarray(got, np.float32)
            shards = np.split(got, n_dev)
            ref = np.split(ref, n_dev)[0]
            got = shards[0]
        rows.append({"codec": codec, "check_vma": vma,
                     "identical_on_all_devices": all(np.array_equal(shards[0], s)
                                                     for s in shards),
                     "rel_error_vs_lax": float(np.linalg.norm(got - ref) / np.linalg.norm(ref))})
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    ap.add_argument("--codecs", nargs="+", default=["taco"])
    ap.add_argument("--chunks-mib", type=float, nargs="*", default=[],
                    help="also time forced compression with these chunk sizes (0 = none)")
    ap.add_argument("--dump-hlo", default=None,
                    help="write the compiled HLO of forced compression at the largest size "
                         "and the first --chunks-mib value to this path")
    ap.add_argument("--no-fresh", dest="fresh", action="store_false",
                    help="skip the fresh-input timings (see module doc)")
    ap.add_argument("--out", default="bench/results/collectives.json")
    args = ap.parse_args()
    n_dev = jax.device_count()
    mesh = jax.make_mesh((n_dev,), ("tp",))
    jax.set_mesh(mesh)
    result = {**env_facts(), "n_devices": n_dev,
              "default_min_bytes": taco_jax.collectives.DEFAULT_MIN_BYTES, "check": []}
    for codec in args.codecs:
        result["check"] += check(mesh, codec, n_dev)
    print_table(result["check"], list(result["check"][0]))
    rows = []
    for mib in args.sizes_mib:
        n = int(mib * MIB) // 2
        x = jax.random.normal(jax.random.key(0), (n_dev * n,), jnp.bfloat16)
        x = jax.device_put(x, NamedSharding(mesh, P("tp")))
        lax_fn, _ = make_fns(mesh, "none", None)
        lax_us = time_loop(lax_fn, x)
        for codec in args.codecs:
            _, taco_default = make_fns(mesh, codec, None)
            _, taco_forced = make_fns(mesh, codec, 0)
            t_def = time_loop(taco_default, x)
            t_forced = time_loop(taco_forced, x)
            rows.append({"mib_per_device": mib, "codec": codec, "lax_psum_us": round(lax_us, 1),
                         "taco_psum_us": round(t_def, 1), "ratio": round(t_def / lax_us, 3),
                         "compressed_us": round(t_forced, 1),
                         "compressed_ratio": round(t_forced / lax_us, 3)})
            if args.fresh:
                rows[-1].update(fresh(lax_fn, taco_forced, x))
            for cm in args.chunks_mib:
                _, fn = make_fns(mesh, codec, 0, chunk_bytes=int(cm * MIB))
                rows[-1][f"chunk{cm:g}MiB_ratio"] = round(time_loop(fn, x) / lax_us, 3)
            print_table(rows[-1:], list(rows[-1]))
    result["rows"] = rows
    print_table(rows, list(rows[0]))
    if args.dump_hlo:
        chunk = int(args.chunks_mib[0] * MIB) if args.chunks_mib else 0
        _, fn = make_fns(mesh, args.codecs[0], 0, chunk_bytes=chunk)
        txt = jax.jit(fn).lower(x).compile().as_text()
        with open(args.dump_hlo, "w") as f:
            f.write(txt)
        pat = re.compile(r"\b(all-to-all(?:-start|-done)?|all-gather(?:-start|-done)?|"
                         r"custom-call|async-start|async-done)\(")
        ops = []
        for line in txt.split("ENTRY")[-1].splitlines():
            m = pat.search(line)
            if m:
                name = re.search(r'kernel_name="?(\w+)', line)
                ops.append(m.group(1) + (f"[{name.group(1)}]" if name else ""))
        print("collective/custom-call ops in schedule order:", ops[:60])
    write_json(args.out, result)


if __name__ == "__main__":
    main()
