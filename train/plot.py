"""python -m train.plot RUN_DIR [RUN_DIR ...] -o out.png: several runs' loss curves on one plot
(e.g. the bf16 baseline vs TACO). Labels default to "<run dir> [<codec>]"."""
from __future__ import annotations

import argparse

from train.metrics import plot_runs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.plot", description=__doc__)
    p.add_argument("runs", nargs="+", help="run directories (each with metrics.jsonl)")
    p.add_argument("-o", "--out", default="loss.png", help="output PNG (default loss.png)")
    p.add_argument("--labels", nargs="+", help="one legend label per run")
    p.add_argument("--title", help="plot title")
    args = p.parse_args(argv)
    if args.labels and len(args.labels) != len(args.runs):
        p.error(f"--labels has {len(args.labels)} entries for {len(args.runs)} runs")
    print(plot_runs(args.runs, args.out, labels=args.labels, title=args.title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
