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


def _epilog() -> str:
    from train import config as config_lib
    presets = config_lib.preset_descriptions()
    width = max(map(len, presets))
    return ("presets (--config NAME, files in configs/):\n"
            + "".join(f"  {name:<{width}}  {what}\n" for name, what in presets.items())
            + "\nA run writes to runs/<name>-<timestamp>/ (or train.run_dir): config.yaml, "
              "metrics.jsonl\n(and .csv, tb/), loss.png, ckpt/<step>/, summary.json. "
              "--resume continues a run with\nits own config.yaml; overrides may change "
              "only its length, logging and checkpoints.\nSee docs/training.md.")


def _resume_dir(p: argparse.ArgumentParser, args, config_lib) -> Path:
    """The run --resume names: RUN_DIR, or train.run_dir given as an override, or the
    newest <name>-* run of --config under train.out_dir."""
    if args.resume:
        return Path(args.resume)
    where = [o for o in args.overrides if o.startswith(("train.run_dir=", "train.out_dir="))]
    base = config_lib.load_config(args.config, where, validate=False)
    if base.train.run_dir:
        return Path(base.train.run_dir)
    newest = config_lib.newest_run(base.train.out_dir, base.name)
    if newest is None:
        p.error(f"--resume: no run of config {base.name!r} to continue in "
                f"{base.train.out_dir}/ (a directory {base.name}-* with a config.yaml); "
                f"name it (--resume RUN_DIR), or start one: python -m train --config "
                f"{args.config}")
    return newest


def parse_args(argv=None):
    """-> (Config, args). With --resume the run's saved config.yaml is the base, and the
    overrides may change only what a resumed run may (config.RESUME_MAY_CHANGE)."""
    from train import config as config_lib

    p = argparse.ArgumentParser(prog="python -m train", description=__doc__.splitlines()[0],
                                epilog=_epilog(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiny", help="preset name or YAML path (default tiny)")
    p.add_argument("--resume", nargs="?", const="", default=None, metavar="RUN_DIR",
                   help="continue RUN_DIR (default: the newest run of --config) from its "
                        "latest checkpoint, with its own config.yaml; overrides may extend "
                        "it (train.steps) or change logging and checkpoints, not what it is")
    p.add_argument("--distributed", action="store_true",
                   help="call jax.distributed.initialize() (auto-detected cluster or env)")
    p.add_argument("--coordinator", help="HOST:PORT of process 0 (implies --distributed)")
    p.add_argument("--num-processes", type=int)
    p.add_argument("--process-id", type=int)
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=50 codec=none")
    args = p.parse_args(argv)
    # `--resume train.steps=6`: argparse takes the override for RUN_DIR
    if args.resume and "=" in args.resume and not Path(args.resume).is_dir():
        args.overrides.insert(0, args.resume)
        args.resume = ""

    try:
        if args.resume is not None:  # continue that run: its saved config, then overrides
            run_dir = _resume_dir(p, args, config_lib)
            if not (run_dir / "config.yaml").exists():
                p.error(f"--resume {run_dir}: no config.yaml in that directory")
            cfg = config_lib.resume_config(run_dir, args.overrides)
            args.resume = str(run_dir)
        else:
            cfg = config_lib.load_config(args.config, args.overrides)
    except (ValueError, TypeError) as e:   # a bad preset, key or value: the message says which
        p.error(str(e))
    return cfg, args


def main(argv=None) -> int:
    cfg, args = parse_args(argv)
    import jax
    from train.errors import TrainError
    from train.loop import run, setup_backend

    if args.distributed or args.coordinator:
        # Gloo carries CPU collectives between processes; the setting is ignored on GPUs.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        setup_backend(cfg)
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)

    try:
        summary = run(cfg, resume=args.resume is not None)
    except TrainError as e:  # an expected stop: the message says what happened and what to do
        print(f"python -m train: {e}", file=sys.stderr)
        return e.exit_status
    if jax.process_index() == 0:
        print(json.dumps(summary, indent=1))
    return 130 if summary["interrupted"] and summary["step"] != cfg.train.halt_at else 0


if __name__ == "__main__":
    sys.exit(main())
