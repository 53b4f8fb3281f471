"""The figures the docs and the code quote agree with the committed measurements they cite,
and docs/results.md stays a short table of current numbers, each with its command."""
import decimal
import json
import re
import string
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




# -- figures the README and docs/results.md quote, against the JSON they cite ------------------
class _HalfUp(string.Formatter):
    """str.format with "{:.Nf}" rounding half up from the value's shortest repr: the JSON's
    0.745 (itself rounded) is 0.75 in a doc, as a person reads it, not binary 0.7449…'s 0.74."""

    def format_field(self, value, spec):
        m = re.fullmatch(r"\.(\d+)f", spec)
        if isinstance(value, float) and m:
            step = decimal.Decimal(1).scaleb(-int(m.group(1)))
            return str(decimal.Decimal(repr(value)).quantize(step, decimal.ROUND_HALF_UP))
        return super().format_field(value, spec)


_fmt = _HalfUp().format


def _json(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _row(rows, **match) -> dict:
    """The one row with these fields (a claim that matches none or several is wrong)."""
    got = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    assert len(got) == 1, f"{len(got)} rows match {match}"
    return got[0]


def _join(values, fmt="{:.2f}", sep=" / "):
    return sep.join(_fmt(fmt, v) for v in values)


def _span(values, fmt="{:.2f}"):
    """"0.96–1.00": the smallest and largest of the values."""
    return _join([min(values), max(values)], fmt, "–")


def _kernel(codec, kernel, mib, key="device_fraction"):
    return _row(_json("kernels.json")["rows"], impl="triton", codec=codec, kernel=kernel,
                mib=float(mib))[key]


KERNEL_COLUMNS = [("taco", "compress"), ("taco", "decompress"), ("taco", "reduce"),
                  ("echo4", "compress"), ("echo4", "compress_feedback"),
                  ("echo4", "decompress"), ("echo4", "reduce"), ("echo4", "decode_sum")]


def _kernels_row(mib):
    return f"| {mib} | " + " | ".join(
        _join([_kernel(c, k, mib), _kernel(c, k, mib, "host_fraction")])
        for c, k in KERNEL_COLUMNS) + " |"


def _collective(mib, key="fresh_ratio"):
    return _row(_json("collectives.json")["rows"], mib_per_device=mib)[key]


def _break_even():
    """The smallest size from which the compressed all-reduce (fresh input) wins at every
    size above it too."""
    rows = sorted(_json("collectives.json")["rows"], key=lambda r: r["mib_per_device"])
    return min(r["mib_per_device"] for i, r in enumerate(rows)
               if all(s["fresh_ratio"] < 1 for s in rows[i:]))


def _calibrated(whose):
    cal = _json("calibrate.json")
    return _fmt("with {} {:.0f}% margin, compressed from {}", whose, 100 * (1 - cal["margin"]),
                _mib(cal["min_bytes"]))


def _taco_speedups():
    return [r["speedup_vs_none"] for r in _json("train_step.json")["rows"]
            if r["codec_fwd"] == "taco"]


def _train(preset, codec):
    return _row(_json("train_step.json")["rows"], preset=preset, codec_fwd=codec)


def _tokens(row) -> str:
    n = row["tokens_per_s"]
    return _fmt("{:.2f}M", n / 1e6) if n >= 1e6 else _fmt("{:.0f}k", n / 1e3)


def _train_row(preset):
    none, taco = _train(preset, "none"), _train(preset, "taco")
    return _fmt("| {:.2f} / {} | {:.2f} / {} | {:.2f} |", none["step_ms"], _tokens(none),
                taco["step_ms"], _tokens(taco), taco["speedup_vs_none"])


def _fused(name, p, mib, key="per_device_us", codec=None):
    match = {} if codec is None else {"codec": codec}
    return _row(_json(name)["rows"], p=p, mib=float(mib), variant="default", **match)[key]


def _fused_ratios(name, ps, codec=None):
    """The one-launch kernel's time over the separate kernels', per P and size."""
    return [_fused(name, p, mib, codec=codec) / _fused(name, p, mib, "separate_us", codec)
            for p in ps for mib in (16, 64, 256)]


def _fused_row(name, label, p, codec=None):
    sizes = (16, 64, 256)
    return (f"| {label} | {p} | "
            + _join([_fused(name, p, m, codec=codec) for m in sizes], "{:.1f}") + " | "
            + _join([_fused(name, p, m, "separate_us", codec) for m in sizes], "{:.1f}") + " | "
            + _join(_fused_ratios(name, [p], codec)) + " | "
            + _fmt("{:.4f} ({:.4f}) |", _fused(name, p, 256, "rel_err", codec),
                   _fused(name, p, 256, "xla_rel_err", codec)))


def _projected_one_shot(mib):
    """taco's one-launch kernel projected over 2×H200 NVLink, over the measured lax.psum."""
    r = _row(_json("projection_links.json")["rows"], p=2, mib=mib, link="nvlink")
    return r["taco_fused_kernel"]["one_launch_us"] / r["lax_psum_2gpu_measured_us"]


def _headline(p, gbps):
    return _row(_json("step_projection.json")["headline"], p=p, link_gbps=gbps)


def _step_speedups(p, baseline=None):
    """350m's best compressed step over a bf16 baseline (None: the hardest), both links."""
    return [_headline(p, g)["speedup"][baseline] if baseline else
            _headline(p, g)["speedup_vs_hardest"] for g in (350.0, 250.0)]


def _drift_ratios(pred):
    """Qwen's drift over the GPT's, both codecs, at the sites `pred(row)` picks."""
    presets = _json("arch_fidelity.json")["presets"]
    key = lambda r: (r["codec"], r["kind"], r["block"], r["place"])       # noqa: E731
    gpt = {key(r): r for r in presets["tiny"]["rows"]}
    return [r["drift"] / gpt[key(r)]["drift"] for r in presets["qwen-tiny"]["rows"]
            if pred(r)]


def _codec_error(codec, site):
    return _row(_json("fidelity.json")["rows"], codec=codec, site=site, step=1000)["rel_l2"]


def _paired(config, key=None):
    """"+0.13% [−0.07, +0.33]": the paired mean and its 90% interval (key: one field)."""
    r = _row(_json("fidelity_tp8.json")["paired"], config=config)
    if key:
        return r[key]
    lo, hi = r["ci90_pct"]
    return f"{_signed(r['mean_pct'])}% [{_signed(lo)}, {_signed(hi)}]"


def _variant(name, key="wire_ratio"):
    return _row(_json("echo4_variants_cpu.json")["ranked"], variant=name)[key]


HEAD_TACO = "echo4+feedback,head=taco"

# (doc, the JSON it cites, its text with the figures formatted from that JSON as the doc
# writes them): the text must occur in the doc (bold `**` ignored), so a figure changed in
# one place and not the other fails here.
CLAIMS = [
    ("README.md", "kernels.json", lambda: _fmt(
        "{:.2f} / {:.2f} of the memory roofline at 256 MiB; {:.2f} / {:.2f} at 16 MiB",
        *[_kernel("taco", k, m) for m in (256, 16) for k in ("compress", "decompress")])),
    ("README.md", "kernels_tilings_small.json", lambda: _fmt(
        "XLA's bf16 `x + 1` reaches {:.2f}", _row(_json("kernels_tilings_small.json")["rows"],
                                              kernel="x + 1", mib=16.0,
                                              round=0)["device_fraction"])),
    ("README.md", "kernels.json", lambda: _fmt(
        "compress {:.2f}, decompress {:.2f}, reduce {:.2f}, decode_sum {:.2f} of the roofline "
        "at 256 MiB", *[_kernel("echo4", k, 256)
                        for k in ("compress", "decompress", "reduce", "decode_sum")])),
    ("README.md", "collectives.json", lambda: _fmt(
        "faster than `lax.psum` from {} MiB per device", _break_even())),
    ("README.md", "collectives.json", lambda: _join(map(_collective, (16, 64, 256, 1024)))
     + " of its time at 16 / 64 / 256 / 1024 MiB (fresh input)"),
    ("README.md", "calibrate.json", lambda: _calibrated("a")),
    ("README.md", "train_step.json", lambda: f"{_span(_taco_speedups())}× bf16's speed"),
    ("README.md", "fused_loopback.json", lambda:
     f"one-shot {_span(_fused_ratios('fused_loopback.json', [2]))}×"),
    ("README.md", "fused_two_shot_loopback.json", lambda: "two-shot {}× (taco) and {}× (echo4)"
     .format(*[_span(_fused_ratios("fused_two_shot_loopback.json", [4, 8], c))
               for c in ("taco", "echo4")])),
    ("README.md", "projection_links.json", lambda: "underestimated the xla transport's times by "
     + _span([-100 * r["error"] for r in _json("projection_links.json")["method_check"]],
             "{:.0f}") + "%"),
    ("README.md", "projection_links.json", lambda: "taco's one-shot "
     + _join(map(_projected_one_shot, (16, 64, 256))) + " of `lax.psum` at 16 / 64 / 256 MiB"),
    ("README.md", "step_projection.json", lambda: "best compressed (echo4) {}× / {}× the "
     "hardest bf16 baseline (collective matmul), {}× / {}× the serial ring".format(
         _span(_step_speedups(4)), _span(_step_speedups(8)),
         _span(_step_speedups(4, "ring")), _span(_step_speedups(8, "ring")))),
    ("README.md", "arch_fidelity.json", lambda: "at block 3's MLP-down output {}× the GPT's, at "
     "its attention output {}×, at the blocks' backward sites {}×".format(
         _span(_drift_ratios(lambda r: (r["block"], r["place"]) == (3, "mlp-down")), "{:.1f}"),
         _span(_drift_ratios(lambda r: (r["block"], r["place"]) == (3, "attn-out"))),
         _span(_drift_ratios(lambda r: r["kind"] == "bwd" and r["block"] is not None),
               "{:.1f}"))),
    ("README.md", "fidelity.json", lambda: _fmt("| taco {:.3f} relative L2 |",
                                                _codec_error("taco", "fwd"))),
    ("README.md", "fidelity_tp8.json", lambda: "taco {} ({} seeds); echo4 {}, with error "
     "feedback {} ({} seeds)".format(_paired("taco"), _paired("taco", "n"), _paired("echo4"),
                                     _paired("echo4+feedback"), _paired("echo4", "n"))),
    ("README.md", "echo4_variants_cpu.json", lambda: _fmt(
        "in taco: {}% vs bf16, taco's level, at {:.3f} of bf16's bytes (echo4 + feedback "
        "alone {}%)", _signed(_variant(HEAD_TACO, "mean_pct")), _variant(HEAD_TACO),
        _signed(_variant("echo4+feedback", "mean_pct")))),
    # docs/results.md: the headline
    ("docs/results.md", "step_projection.json", lambda: "| {}× / {}× (goals 1.12×, 1.5×) |"
     .format(_span(_step_speedups(4)), _span(_step_speedups(8)))),
    ("docs/results.md", "train_step.json", lambda:
     f"| bf16 (codec none) | {_span(_taco_speedups())}× |"),
    ("docs/results.md", "collectives.json", lambda: "| " + _join(map(_collective, (256, 1024)))
     + f" of its time: break-even {_break_even()} MiB; "
     + _calibrated("the calibration's") + " |"),
    ("docs/results.md", "projection_links.json", lambda: "`lax.psum` on 2×H200 | "
     + _join(map(_projected_one_shot, (16, 64, 256))) + " of its time |"),
    ("docs/results.md", "kernels.json", lambda: "memory roofline (XLA's `x + 1`) | "
     + _join([_kernel("taco", k, 256) for k in ("compress", "decompress")]) + " |"),
    ("docs/results.md", "fidelity_tp8.json", lambda: "| taco {}%; echo4 {}%, {}% with feedback |"
     .format(*[_signed(_paired(c, "mean_pct")) for c in ("taco", "echo4", "echo4+feedback")])),
    # the kernels against the roofline, device / host
    *[("docs/results.md", "kernels.json", lambda mib=mib: _kernels_row(mib))
      for mib in (16, 64, 256)],
    # the all-reduce against lax.psum
    *[("docs/results.md", "collectives.json", lambda label=label, key=key, fmt=fmt:
       f"| {label} | " + _join([_collective(m, key) for m in (1, 4, 16, 64, 256, 1024)],
                               fmt, " | ") + " |")
      for label, key, fmt in [("lax.psum µs (`collectives.json`)", "lax_psum_us", "{:.1f}"),
                              ("compressed µs", "compressed_us", "{:.1f}"),
                              ("forced ratio", "compressed_ratio", "{:.2f}")]],
    ("docs/results.md", "collectives.json", lambda: "| fresh-input ratio | "
     + _fmt("{:.1f} | ", _collective(1)) + _join(map(_collective, (4, 16, 64, 256, 1024)),
                                                  sep=" | ") + " |"),
    ("docs/results.md", "calibrate.json", lambda: "| fresh-input ratio (`calibrate.json`) | "
     + _join([r["ratio"] for r in _json("calibrate.json")["rows"]], sep=" | ") + " |"),
    # the fused kernels in loopback
    *[("docs/results.md", name, lambda name=name, label=label, p=p, codec=codec:
       _fused_row(name, label, p, codec))
      for name, label, p, codec in [
          ("fused_loopback.json", "taco one-shot", 2, None),
          ("fused_echo4_loopback.json", "echo4 one-shot", 2, None),
          ("fused_two_shot_loopback.json", "taco two-shot", 4, "taco"),
          ("fused_two_shot_loopback.json", "taco two-shot", 8, "taco"),
          ("fused_two_shot_loopback.json", "echo4 two-shot", 4, "echo4"),
          ("fused_two_shot_loopback.json", "echo4 two-shot", 8, "echo4")]],
    # the training step
    *[("docs/results.md", "train_step.json", lambda preset=preset: _train_row(preset))
      for preset in ("comm_heavy", "small", "350m")],
    # codec error on captured tensors
    ("docs/results.md", "fidelity.json", lambda: "| rel. L2 fwd / bwd | " + " | ".join(
        _join([_codec_error(c, s) for s in ("fwd", "bwd")], "{:.4f}")
        for c in ("taco", "taco-e5m2", "taco-int8", "fp8", "block-fp8", "hadamard-fp8",
                  "echo4", "int4-sym")) + " |"),
]

FIGURE = r"[−+-]?\d+(?:\.\d+)?"


def _like(want: str, text: str) -> list:
    """Where the doc says `want` with other figures (its words the same)."""
    words = re.split(FIGURE, want)
    return re.findall(FIGURE.join(re.escape(w) for w in words), text)[:3]


def test_quoted_figures_are_their_jsons():
    """Each claim's text, its figures formatted from the JSON it cites, is in the doc; where it
    is not, the message shows what the doc says instead. The README cites its JSON itself or
    through docs/results.md ("the command behind every figure")."""
    bad = []
    for doc, name, figures in CLAIMS:
        text = (ROOT / doc).read_text().replace("**", "")
        cited = text + (RESULTS_MD.read_text() if doc == "README.md" else "")
        want = figures()
        if name not in cited:
            bad.append(f"{doc} quotes {want!r} without citing {name}")
        elif want not in text:
            bad.append(f"{doc} ({name}): want {want!r}; the doc has "
                       + ("; ".join(map(repr, _like(want, text))) or "nothing like it"))
    assert not bad, "\n".join(bad)
