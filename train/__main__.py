"""python -m train [--config PRESET_OR_YAML] [--resume [RUN_DIR]] [key=value ...]

Multi-process (one process per host or per GPU group):
    python -m train --coordinator HOST:PORT --num-processes N --process-id I [...]
or set JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID (or run under SLURM etc.)
with --distributed. See docs/training.md.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def parse_args(argv=None):
    """-> (Config, args). With --resume RUN_DIR the run's saved config.yaml is the base."""
    p = argparse.ArgumentParser(prog="python -m train", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny", help="preset name or YAML path (default tiny)")
    p.add_argument("--resume", nargs="?", const="", default=None, metavar="RUN_DIR",
                   help="continue RUN_DIR (default: newest run of this config) from its "
                        "latest checkpoint; overrides still apply")
    p.add_argument("--distributed", action="store_true",
                   help="call jax.distributed.initialize() (auto-detected cluster or env)")
    p.add_argument("--coordinator", help="HOST:PORT of process 0 (implies --distributed)")
    p.add_argument("--num-processes", type=int)
    p.add_argument("--process-id", type=int)
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=50 codec=none")
    args = p.parse_args(argv)

    from train import config as config_lib

    try:
        if args.resume:  # continue that run: its saved config, then the command line's overrides
            run_dir = Path(args.resume)
            if not (run_dir / "config.yaml").exists():
                p.error(f"--resume {args.resume}: no config.yaml in that directory")
            cfg = config_lib.from_dict(
                config_lib.read_yaml((run_dir / "config.yaml").read_text()),
                [*args.overrides, f"train.run_dir={run_dir}"])
        else:
            cfg = config_lib.load_config(args.config, args.overrides)
    except (ValueError, TypeError) as e:   # a bad preset, key or value: the message says which
        p.error(str(e))
    return cfg, args


def main(argv=None) -> int:
    cfg, args = parse_args(argv)
    import jax
    from train.loop import RunDirInUse, run, setup_backend

    if args.distributed or args.coordinator:
        # Gloo carries CPU collectives between processes; the setting is ignored on GPUs.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        setup_backend(cfg)
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)

    try:
        summary = run(cfg, resume=args.resume is not None)
    except RunDirInUse as e:  # an expected refusal: the message says what to do
        print(f"python -m train: {e}", file=sys.stderr)
        return 2
    if jax.process_index() == 0:
        print(json.dumps(summary, indent=1))
    return 130 if summary["interrupted"] and summary["step"] != cfg.train.halt_at else 0


if __name__ == "__main__":
    sys.exit(main())
