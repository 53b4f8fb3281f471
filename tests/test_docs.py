"""The figures the docs and the code quote agree with the committed measurements they cite,
and docs/results.md stays a short table of current numbers, each with its command."""
import json
import re
from pathlib import Path

import taco_jax

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def _mib(n: int) -> str:
    return f"{n >> 30} GiB" if n >= 1 << 30 else f"{n >> 20} MiB"


def test_default_min_bytes_is_the_calibrations_answer():
    """Without a calibration cache the threshold is what `python -m taco_jax.calibrate`
    answered on the pair it was measured on (calibrate.json), and the README says so."""
    cal = json.loads((RESULTS / "calibrate.json").read_text())
    assert not cal["never"]
    assert taco_jax.DEFAULT_MIN_BYTES == cal["min_bytes"]
    readme = (ROOT / "README.md").read_text()
    assert f"{_mib(cal['min_bytes'])} per device" in readme


def _signed(v: float) -> str:
    return f"{v:+.2f}".replace("-", "−")


def test_fidelity_intervals_are_the_jsons():
    """The TP8 intervals docs/fidelity.md quotes are fidelity_tp8.json's, rounded, and no
    wording puts a bound outside its own interval."""
    doc = (ROOT / "docs" / "fidelity.md").read_text()
    paired = {r["config"]: r for r in
              json.loads((RESULTS / "fidelity_tp8.json").read_text())["paired"]}
    for config in ("taco", "echo4", "echo4+feedback"):
        lo, hi = paired[config]["ci90_pct"]
        assert f"[{_signed(lo)}, {_signed(hi)}]" in doc, config
        for bound in (lo, hi):
            assert f"excludes {_signed(bound)}" not in doc, (config, bound)


RESULTS_MD = ROOT / "docs" / "results.md"
COMMAND = re.compile(r"python -m |bash bench/gpu_run\.sh")


def _sections(text: str):
    """(heading, lines) per heading of any level."""
    heading, lines = "", []
    for line in text.splitlines():
        if line.startswith("#"):
            yield heading, lines
            heading, lines = line, []
        else:
            lines.append(line)
    yield heading, lines


def test_results_md_is_short():
    """Current figures only: at most 150 lines."""
    n = len(RESULTS_MD.read_text().splitlines())
    assert n <= 150, f"docs/results.md has {n} lines"


def test_results_md_tables_come_with_commands():
    """Every table's figures come with the command that produced them and its JSON: in the
    table's section (or its parent's, for a subsection under a shared lead paragraph)."""
    parent_text = ""
    for heading, lines in _sections(RESULTS_MD.read_text()):
        text = "\n".join(lines)
        if heading.startswith("## "):
            parent_text = text
        rows = [l for l in lines if l.startswith("|") and re.search(r"\d", l)
                and not set(l) <= set("|-: ")]
        if not rows:
            continue
        context = text if heading.startswith("## ") else parent_text + "\n" + text
        assert COMMAND.search(context), f"{heading}: a table without its command"
        assert ".json" in context, f"{heading}: a table without its JSON"


def test_docs_name_existing_json():
    for doc in ("results.md", "fused_kernels.md"):
        names = set(re.findall(r"([A-Za-z0-9_*]+\.json)", (ROOT / "docs" / doc).read_text()))
        assert names, doc
        for name in names:
            assert list(RESULTS.glob(name)), f"docs/{doc} names {name}: not in bench/results/"
