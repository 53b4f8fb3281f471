"""Run metrics: JSONL (source of truth), CSV, TensorBoard events, and loss-curve PNGs."""
from __future__ import annotations

import csv
import json
import math
import warnings
from pathlib import Path

from train.errors import CorruptRunFile

COLUMNS = ("step", "loss", "val_loss", "lr", "grad_norm", "step_time_s", "tokens_per_s",
           "elapsed_s", "wire_bytes", "codec_rel_error_mean", "codec_rel_error_max")


def read_jsonl(path: str | Path) -> list[dict]:
    """The rows of a metrics.jsonl ([] if there is none). A last line that is not a whole
    row (a write cut short: the run was killed while it logged) is dropped with a warning;
    a damaged line before it raises CorruptRunFile naming the file and the line."""
    path = Path(path)
    if not path.exists():
        return []
    numbered = [(i, line) for i, line in enumerate(path.read_text().splitlines(), 1)
                if line.strip()]
    rows = []
    for i, line in numbered:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            why = f"not a JSON row ({e.msg})"
        else:
            if isinstance(row, dict) and "step" in row:
                rows.append(row)
                continue
            why = "not a metrics row (a JSON object with a step)"
        if i == numbered[-1][0]:
            warnings.warn(f"{path}, line {i} (the last): {why}, a write cut short when the "
                          f"run stopped; dropped it", stacklevel=2)
            break
        raise CorruptRunFile(f"{path}, line {i} of {numbered[-1][0]}: {why}. The rows after "
                             f"it are whole, so it was damaged after it was written: repair "
                             f"or delete that line, then run again")
    return rows


class MetricsWriter:
    """Appends rows to metrics.jsonl / metrics.csv and TensorBoard scalars under run_dir.

    `truncate_after=step` (on resume) drops rows logged after the restored checkpoint, so a
    resumed run's files read as one uninterrupted run.
    """

    def __init__(self, run_dir: str | Path, truncate_after: int | None = None,
                 enabled: bool = True):
        self.run_dir = Path(run_dir)
        self.jsonl, self.csv = self.run_dir / "metrics.jsonl", self.run_dir / "metrics.csv"
        self.enabled = enabled
        self.tb = None
        if not enabled:
            return
        rows = read_jsonl(self.jsonl)
        if truncate_after is not None:
            rows = [r for r in rows if r["step"] <= truncate_after]
        else:
            rows = []
        self.jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
        with self.csv.open("w", newline="") as f:
            w = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
        try:
            from tensorboardX import SummaryWriter
        except ImportError:  # optional: JSONL and CSV still hold every metric
            print("[metrics] tensorboardX not installed: no TensorBoard events", flush=True)
            return
        purge = None if truncate_after is None else truncate_after + 1
        self.tb = SummaryWriter(str(self.run_dir / "tb"), purge_step=purge)

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        row = {k: (float(v) if isinstance(v, float) else v) for k, v in row.items()}
        with self.jsonl.open("a") as f:
            f.write(json.dumps(row) + "\n")
        with self.csv.open("a", newline="") as f:
            csv.DictWriter(f, COLUMNS, extrasaction="ignore").writerow(row)
        for k, v in row.items():
            if self.tb and k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                self.tb.add_scalar(k, v, row["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def plot_runs(run_dirs, out: str | Path, labels=None, title: str | None = None) -> Path:
    """Train (lines) and validation (markers) loss of several runs on one figure."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, run in enumerate(map(Path, run_dirs)):
        rows = read_jsonl(run / "metrics.jsonl")
        if not rows:
            raise ValueError(f"no metrics.jsonl rows in run directory {str(run)!r}")
        label = labels[i] if labels else _label(run)
        train = [(r["step"], r["loss"]) for r in rows if r.get("loss") is not None]
        val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
        (line,) = ax.plot(*zip(*train), lw=1.2, label=f"{label} train") if train else (None,)
        color = line.get_color() if line is not None else None
        if val:
            ax.plot(*zip(*val), "o--", color=color, ms=4, lw=0.8, label=f"{label} val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title or "loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, out, dpi=120)


def _label(run: Path) -> str:
    """Run name plus its codecs, read from the run's config.yaml when present."""
    cfg_file = run / "config.yaml"
    if cfg_file.exists():
        import yaml
        values = yaml.safe_load(cfg_file.read_text()) or {}
        m, recipe = values.get("model", {}), values.get("recipe", {})
        fwd = m.get("codec_fwd") or recipe.get("codec")   # null: the recipe's codec
        bwd = m.get("codec_bwd") or recipe.get("codec")
        codec = fwd if fwd == bwd else f"{fwd}/{bwd}"
        return f"{run.name} [{codec}]"
    return run.name


def save_figure(fig, path, dpi: int = 110) -> Path:
    """A matplotlib figure laid out tightly, saved to `path` (its folder made) and closed."""
    import matplotlib.pyplot as plt
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out
