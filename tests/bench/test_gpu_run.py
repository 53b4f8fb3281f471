"""bench/gpu_run.sh, the GPU batches: it parses, names every step it documents, and refuses
to run without GIT_COMMIT or with an unknown step (a broken script costs a GPU call)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_run.sh"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def test_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_every_documented_step_has_a_case():
    text = SCRIPT.read_text()
    header = text.split("set -u")[0]
    documented = set(re.findall(r"^#   (\w+)\s{2,}", header, re.M))
    cases = {name for alts in re.findall(r"^\s{4}([\w|]+)\)", text, re.M)
             for name in alts.split("|")}
    assert documented and documented <= cases, documented - cases


def run(env, *steps):
    return subprocess.run(["bash", str(SCRIPT), *steps], capture_output=True, text=True,
                          env={"PATH": os.environ["PATH"], **env}, timeout=60)


def test_needs_git_commit(tmp_path):
    r = run({"OUT": str(tmp_path)}, "kernels")
    assert r.returncode != 0 and "GIT_COMMIT" in r.stderr


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="CPU-only check")
def test_unknown_step_is_refused(tmp_path):
    r = run({"OUT": str(tmp_path), "GIT_COMMIT": "0" * 40}, "no_such_step")
    assert r.returncode == 2 and "unknown step no_such_step" in r.stdout


def fake_python(tmp_path, fused_rc: int) -> dict:
    """A `python` on PATH that logs its arguments and fails bench.fused with fused_rc."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / "python"
    exe.write_text("#!/usr/bin/env bash\n"
                   f'echo "$*" >> "{tmp_path}/calls.log"\n'
                   f'case "$*" in *"bench.fused --impl mesh"*) exit {fused_rc};; esac\n')
    exe.chmod(0o755)
    return {"OUT": str(tmp_path / "out"), "GIT_COMMIT": "0" * 40,
            "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def run_fake(tmp_path, steps, module: str, env: dict | None = None):
    """The script's steps with the logging `python` (env: more variables): (the run, the
    calls of `module` in this run)."""
    log = tmp_path / "calls.log"
    log.unlink(missing_ok=True)
    env = {**fake_python(tmp_path, 0), **(env or {})}
    r = subprocess.run(["bash", str(SCRIPT), *steps], capture_output=True, text=True,
                       env=env, timeout=60, cwd=tmp_path)
    calls = [c for c in log.read_text().splitlines() if module in c] if log.exists() else []
    return r, calls


@pytest.mark.parametrize("fused_rc", [0, 1])
def test_failed_fused_step_leaves_the_fused_transport_out(tmp_path, fused_rc):
    env = fake_python(tmp_path, fused_rc)
    r = subprocess.run(["bash", str(SCRIPT), "fused", "collectives", "calibrate"],
                       capture_output=True, text=True, env=env, timeout=60,
                       cwd=tmp_path)
    calls = (tmp_path / "calls.log").read_text().splitlines()
    later = [c for c in calls if "bench.collectives" in c or "taco_jax.calibrate" in c]
    assert len(later) == 2
    if fused_rc:
        assert "later steps leave it out" in r.stdout
        assert not any(re.search(r"\bfused\b", c) for c in later)
    else:
        assert all(re.search(r"--transports xla fused\b", c) for c in later)


@pytest.mark.parametrize("steps,want", [(["fused_ablate"], ["--ablate"]),
                                        (["fused_two_shot"], ["--kernel two_shot"]),
                                        (["fused_ablate", "fused_two_shot"],
                                         ["--ablate", "--kernel two_shot"])])
def test_fused_steps_run_the_ablation_and_the_two_shot_checks(tmp_path, steps, want):
    r, calls = run_fake(tmp_path, steps, "bench.fused")
    assert r.returncode == 0 and len(calls) == len(want)
    for call, flag in zip(calls, want):
        assert flag in call and "--out bench/results/fused_" in call
    if "--kernel two_shot" in want:
        two = calls[want.index("--kernel two_shot")]
        assert "--p 8 4 3 5 6 7" in two and "--dtypes bf16 f32 f16" in two
        assert "--fail-fast" in two
        assert "--sizes 16MiB 1KiB 1MiB+5 64MiB 256MiB" in two and "--calls 5" in two


def test_fused_p2_checks_the_default_then_times_it(tmp_path):
    r, calls = run_fake(tmp_path, ["fused_p2"], "bench.fused")
    assert r.returncode == 0 and len(calls) == 2
    assert all("--p 2" in c and "--config" not in c for c in calls)
    timed = [bool(re.search(r"--time(\s|$)", c)) for c in calls]
    assert "--calls 5" in calls[0] and "1024MiB" in calls[0] and timed == [False, True]
    assert "fused_loopback_checks_p2.json" in calls[0] and "fused_loopback.json" in calls[1]


def test_fused_checks_runs_the_rows_the_checked_table_is_written_from(tmp_path):
    """Per codec (the four with tile math) the one-shot at P = 2 and the two-shot from
    P = 3, every dtype, resumed at the fingerprints emitted now, into one file (the runs
    side by side, so in any order)."""
    r, calls = run_fake(tmp_path, ["fused_checks"], "bench.fused")
    assert r.returncode == 0 and len(calls) == 8
    assert all("--missing" in c and "--update" in c and "fused_checks.json" in c
               and "--dtypes bf16 f32 f16" in c and "--calls 5" in c for c in calls)
    runs = {(re.search(r"--codec (\S+)", c).group(1), re.search(r"--kernel (\S+)", c).group(1),
             re.search(r"--p ([\d ]+?) --", c).group(1)) for c in calls}
    assert runs == {(codec, kernel, ps) for codec in ("taco", "echo4", "taco-e5m2",
                                                      "taco-1scale")
                    for kernel, ps in (("one_shot", "2"), ("two_shot", "3 4 8"))}


def test_fused_echo4_own_checks_then_times_echo4_decoding_its_staging(tmp_path):
    r, calls = run_fake(tmp_path, ["fused_echo4_own"], "bench.fused")
    assert r.returncode == 0 and len(calls) == 2
    assert all("--codec echo4" in c and "--config own_from_smem=true" in c and "--p 2" in c
               for c in calls)
    timed = [bool(re.search(r"--time(\s|$)", c)) for c in calls]
    assert "--calls 5" in calls[0] and "256MiB" in calls[0] and timed == [False, True]
    assert "fused_echo4_loopback_own.json" in calls[1]


def test_fused_two_shot_time_times_the_checked_two_shot_per_codec_into_one_file(tmp_path):
    r, calls = run_fake(tmp_path, ["fused_two_shot_time"], "bench.fused")
    assert r.returncode == 0 and len(calls) == 2
    assert ["--codec taco" in calls[0], "--codec echo4" in calls[1]] == [True, True]
    for c in calls:
        assert "--kernel two_shot" in c and "--p 4 8" in c and "--time" in c and "--update" in c
        assert "--out bench/results/fused_two_shot_loopback.json" in c


def test_fused_two_shot_checks_one_codec_into_the_shared_file(tmp_path):
    r, calls = run_fake(tmp_path, ["fused_two_shot"], "bench.fused")
    assert r.returncode == 0 and len(calls) == 1 and "--codec taco" in calls[0]
    assert "--update" in calls[0] and "--dtypes bf16 f32 f16" in calls[0]
    r, calls = run_fake(tmp_path, ["fused_two_shot"], "bench.fused",
                        env={"FUSED_TWO_SHOT_CODEC": "echo4"})
    assert len(calls) == 1 and "--codec echo4" in calls[0]
    assert "fused_two_shot_checks.json" in calls[0]


@pytest.mark.parametrize("step,codec,names,out", [
    ("fused_levers", None, ("one_warpgroup", "halved_encode", "one_part"), "fused_levers"),
    ("fused_echo4_levers", "echo4", ("one_warpgroup",), "fused_echo4_levers")])
def test_fused_levers_time_the_levers_checked(tmp_path, step, codec, names, out):
    r, calls = run_fake(tmp_path, [step], "bench.fused")
    assert r.returncode == 0 and len(calls) == 1
    assert "--variants default " + " ".join(names) in calls[0] and "--ablate" in calls[0]
    assert f"--out bench/results/{out}.json" in calls[0] and "--calls 3" in calls[0]
    assert (f"--codec {codec}" in calls[0]) if codec else "--codec" not in calls[0]
    from bench import fused
    for name in names:
        assert not any(k.startswith("ablate=") for k in fused.VARIANTS[name][0])   # checked


def case_block(label: str) -> str:
    """The script's case branch that starts at `label`, up to its `;;`."""
    text = SCRIPT.read_text()
    block = text[text.index(label):]
    return block[:block.index(";;")]


def test_fused_two_shot_fits_one_call():
    """Its timeout, FUSED_TWO_SHOT_S unless set, is at most 540 s (one GPU command runs
    ≤ 600 s)."""
    block = case_block("    fused_two_shot)")
    limits = [int(t) for t in
              re.findall(r'step fused_two_shot "\$\{FUSED_TWO_SHOT_S:-(\d+)\}" ', block)]
    assert len(limits) == 1 and limits[0] <= 540


def test_kernels_times_and_kernels_check_checks(tmp_path):
    """kernels: the timings and the roofline only; kernels_check: the checks only, echo4's
    Triton kernels then taco's, each step into its own file under its own limit."""
    r, calls = run_fake(tmp_path, ["kernels", "kernels_check"], "bench.kernels")
    assert r.returncode == 0 and len(calls) == 3
    timed, echo4, taco = calls
    assert "--codecs taco echo4" in timed and "--check" not in timed
    assert "--no-timings" not in timed and "--out" not in timed
    assert "--codecs echo4 --impls triton --check --no-timings" in echo4
    assert "--out bench/results/kernels_check_echo4.json" in echo4
    assert "--codecs taco --check --no-timings" in taco and "--impls" not in taco
    assert "--out bench/results/kernels_check_taco.json" in taco
    limits = dict(re.findall(r"step (kernels\w*) (\d+) ", re.sub(r"\\\n\s*", " ",
                                                                 SCRIPT.read_text())))
    assert limits == {"kernels": "540", "kernels_echo4": "300", "kernels_check_echo4": "420",
                      "kernels_check_taco": "540"}


@pytest.mark.parametrize("steps,want", [(["kernels_check_echo4"], ["echo4"]),
                                        (["kernels_check_taco"], ["taco"]),
                                        (["kernels_check"], ["echo4", "taco"])])
def test_kernels_check_steps_alone_and_together(tmp_path, steps, want):
    """Each half of kernels_check fits a machine call of its own."""
    r, calls = run_fake(tmp_path, steps, "bench.kernels")
    assert r.returncode == 0
    assert [re.search(r"--codecs (\w+)", c).group(1) for c in calls] == want


def test_kernels_echo4_retimes_echo4_in_place(tmp_path):
    r, calls = run_fake(tmp_path, ["kernels_echo4"], "bench.kernels")
    assert r.returncode == 0 and len(calls) == 1
    assert "--codecs echo4 --impls triton --update" in calls[0] and "--out" not in calls[0]


def test_echo4_tune_times_only_the_sweep(tmp_path):
    r, calls = run_fake(tmp_path, ["echo4_tune"], "bench.kernels")
    assert r.returncode == 0 and len(calls) == 1
    assert "--codecs echo4" in calls[0] and "--tune --no-timings" in calls[0]
    assert "--check" not in calls[0] and "kernels_echo4_tune_compress.json" in calls[0]
    assert "--tune-kernels compress" in calls[0]


def test_fused_echo4_checks_the_tiles_and_the_loopback_then_times_it(tmp_path):
    env = fake_python(tmp_path, 0)
    r = subprocess.run(["bash", str(SCRIPT), "fused_echo4"], capture_output=True, text=True,
                       env=env, timeout=60, cwd=tmp_path)
    calls = [c for c in (tmp_path / "calls.log").read_text().splitlines()
             if c.startswith("-m ")]
    assert r.returncode == 0 and len(calls) == 3
    tiles, checks, timed = calls
    assert "pytest" in tiles and "tests/kernels/test_mosaic_echo4.py -k gpu" in tiles
    for call in (checks, timed):
        assert "bench.fused --codec echo4" in call and "--fail-fast" in call
        assert "--timeout" in call and "--out bench/results/fused_echo4_" in call
    assert "--p 2 4 8" in checks and "--dtypes bf16 f32" in checks
    assert "--sizes 1KiB 1MiB+5 16MiB 64MiB" in checks and "--time " not in checks
    assert "--p 2 " in timed and "--time " in timed and "--sizes 16MiB 64MiB 256MiB" in timed


def test_fused_echo4_times_nothing_when_its_checks_fail(tmp_path):
    env = fake_python(tmp_path, 0)
    exe = Path(env["PATH"].split(":")[0]) / "python"
    exe.write_text(exe.read_text() + 'case "$*" in *"--codec echo4 --p 2 4 8"*) exit 1;; '
                   'esac\n')
    subprocess.run(["bash", str(SCRIPT), "fused_echo4"], capture_output=True, text=True,
                   env=env, timeout=60, cwd=tmp_path)
    calls = [c for c in (tmp_path / "calls.log").read_text().splitlines()
             if c.startswith("-m ")]
    assert len(calls) == 2 and not any("--time " in c for c in calls)


def test_fused_echo4_fits_300_s():
    block = case_block("    fused_echo4)")
    limits = [int(t) for t in re.findall(r"step fused_echo4_\w+ (\d+) ", block)]
    assert len(limits) == 3 and sum(limits) <= 300


def test_every_variant_the_batches_name_exists():
    """A misspelt --variants name would cost a GPU call: each of bench.fused's is one."""
    from bench import fused as bench_fused
    text = re.sub(r"\\\n\s*", " ", SCRIPT.read_text())
    named = [w for cmd in re.findall(r"python -m bench\.fused [^;]*?--out", text)
             for m in re.findall(r"--variants\s+((?:\w+\s+)+)", cmd) for w in m.split()]
    assert "no_sync" in named and "decode_twice" in named
    assert set(named) <= set(bench_fused.VARIANTS), set(named) - set(bench_fused.VARIANTS)


@pytest.mark.parametrize("codec,kernel,out", [(None, "taco_compress", "ncu_src.json"),
                                              ("echo4", "echo4_compress", "ncu_src_echo4.json")])
def test_ncu_src_profiles_the_codec_asked_for(tmp_path, codec, kernel, out):
    """NCU_CODEC picks whose compress Nsight Compute profiles (kernel name, driver, file)."""
    env = fake_python(tmp_path, 0)
    bin_dir = tmp_path / "bin"
    (bin_dir / "ncu").write_text(f'#!/usr/bin/env bash\necho "ncu $*" >> "{tmp_path}/calls.log"\n')
    (bin_dir / "ncu").chmod(0o755)
    if codec:
        env["NCU_CODEC"] = codec
    r = subprocess.run(["bash", str(SCRIPT), "ncu_src"], capture_output=True, text=True,
                       env=env, timeout=60, cwd=tmp_path)
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert r.returncode == 0, r.stderr
    profile = next(c for c in calls if c.startswith("ncu -k"))
    assert f"regex:{kernel}" in profile
    assert f"bench.one_kernel compress {codec or 'taco'}" in profile
    summary = next(c for c in calls if "bench.ncu_source" in c)
    assert f"bench/results/{out}" in summary


def run_ncu(tmp_path, step):
    """Run an ncu step with a fake ncu that logs its calls: (result, calls)."""
    env = fake_python(tmp_path, 0)
    bin_dir = tmp_path / "bin"
    (bin_dir / "ncu").write_text(f'#!/usr/bin/env bash\necho "ncu $*" >> "{tmp_path}/calls.log"\n')
    (bin_dir / "ncu").chmod(0o755)
    r = subprocess.run(["bash", str(SCRIPT), step], capture_output=True, text=True,
                       env=env, timeout=60, cwd=tmp_path)
    return r, (tmp_path / "calls.log").read_text().splitlines()


@pytest.mark.parametrize("step,kernel,command,summary", [
    ("ncu_fused", "fused_allreduce",
     f"bench.fused --one 2 {16 << 20} bf16 --impl kernel --calls 1 --codec taco",
     "ncu_src_fused.json"),
    ("ncu_two_shot", "taco_fused_two_shot",
     f"bench.fused --kernel two_shot --one 8 {64 << 20} bf16 --impl kernel --calls 1 "
     "--codec echo4", "ncu_src_two_shot_echo4.json")])
def test_ncu_steps_profile_one_checked_call_of_a_loopback_kernel(tmp_path, step, kernel,
                                                                 command, summary):
    r, calls = run_ncu(tmp_path, step)
    assert r.returncode == 0, r.stderr
    profile = next(c for c in calls if c.startswith("ncu -k"))
    assert f"regex:{kernel}" in profile and "-c 1" in profile and command in profile
    assert any(f"bench/results/{summary}" in c for c in calls)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_fused_step_runs_over_every_gpu_of_the_machine(tmp_path, n):
    """The fused step checks and times the fused psum over all the machine's GPUs: the
    one-shot kernel on 2, the two-shot on 4 or 8, each into its own results file."""
    env = fake_python(tmp_path, 0)
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.write_text("#!/usr/bin/env bash\n" + "echo 'NVIDIA H200'\n" * n)
    smi.chmod(0o755)
    r = run(env, "fused")
    calls = [c for c in (tmp_path / "calls.log").read_text().splitlines()
             if "bench.fused" in c]
    assert r.returncode == 0 and len(calls) == 1
    assert f"--impl mesh --p {n} " in calls[0] and "--time" in calls[0]
    assert f"--out bench/results/fused_{n}gpu.json" in calls[0]


def test_train_step_emulated_runs_each_preset_then_the_projection(tmp_path):
    """One preset per step, merged into one file (--update), then bench.step_projection."""
    r, calls = run_fake(tmp_path, ["train_step_emulated"], "bench.")
    assert r.returncode == 0
    train = [c for c in calls if "bench.train_step" in c]
    assert [c.split("--presets ")[1].split()[0] for c in train] == [
        "comm_heavy", "small", "350m"]
    for c in train:
        assert ("--mesh 1,1,1 --emulate-tp 2 4 8 --variants none taco:xla taco:fused "
                "echo4:fused --steps 10 --update --out bench/results/train_step_emulated.json"
                in c)
    assert calls[-1] == "-m bench.step_projection"


def test_train_overlap_emulated_runs_sp_beside_the_overlap_rows_per_preset(tmp_path):
    """350m then qwen-0.5b, one step each merged into one file, at TP 4 and 8, with sp."""
    r, calls = run_fake(tmp_path, ["train_overlap_emulated"], "bench.")
    assert r.returncode == 0
    assert [c.split("--presets ")[1].split()[0] for c in calls] == ["350m", "qwen-0.5b"]
    for c in calls:
        assert ("--mesh 1,1,1 --emulate-tp 4 8 --variants none sp none:overlap taco:overlap "
                "echo4:overlap --steps 10 --update "
                "--out bench/results/train_step_emulated_overlap.json" in c)


def test_fused_two_shot_phases_times_each_codec_as_it_is_and_without_its_last_phases(tmp_path):
    r, calls = run_fake(tmp_path, ["fused_two_shot_phases"], "bench.fused")
    assert r.returncode == 0 and len(calls) == 6
    for codec, part in zip(["taco"] * 3 + ["echo4"] * 3, calls):
        assert f"--codec {codec}" in part and "--update" in part and "--time" in part
        assert "--out bench/results/fused_two_shot_phases.json" in part
    assert ["ablate=scatter_only" in c for c in calls[:3]] == [False, True, False]
    assert ["ablate=no_gather" in c for c in calls[3:]] == [False, False, True]


@pytest.mark.parametrize("jobs", ["4", "1"])
def test_fused_two_shot_matrix_resumes_the_whole_check_matrix(tmp_path, jobs):
    """Four runs (codec × dtype), each over every P and size, into one file."""
    r, calls = run_fake(tmp_path, ["fused_two_shot_matrix"], "bench.fused",
                        {"FUSED_MATRIX_JOBS": jobs})
    assert r.returncode == 0 and len(calls) == 4
    runs = set()
    for c in calls:
        assert "--missing" in c and "--update" in c and "--calls 5" in c
        assert "--sizes 1KiB 1MiB+5 16MiB 64MiB 256MiB 1024MiB" in c
        assert "--out bench/results/fused_two_shot_checks.json" in c
        ps = re.search(r"--p ([\d ]+)", c).group(1).split()
        assert sorted(ps) == list("345678")
        runs.add((re.search(r"--codec (\w+)", c).group(1),
                  re.search(r"--dtypes (\w+)", c).group(1)))
    assert runs == {(c, d) for c in ("taco", "echo4") for d in ("bf16", "f32")}


def test_gemm_table_then_the_projection(tmp_path):
    """gemm_table measures 350m's GEMMs at P = 2, 4, 8, then re-runs bench.step_projection,
    which reads it; the overlap steps run the model's collective matmul variants."""
    r, calls = run_fake(tmp_path, ["gemm_table", "train_overlap", "train_overlap_emulated"],
                        "bench.")
    assert r.returncode == 0 and len(calls) == 5
    table, projection, real, *emulated = calls             # emulated: one call a preset
    assert "bench.gemm_table --presets 350m --p 2 4 8" in table
    assert "--out bench/results/gemm_table.json" in table
    assert projection == "-m bench.step_projection"
    assert "--variants none none:overlap taco:overlap echo4:overlap" in real
    assert all("--variants none sp none:overlap taco:overlap echo4:overlap" in c
               for c in emulated)
    assert "--emulate-tp" not in real and "train_step_overlap.json" in real
    assert all("--emulate-tp 4 8" in c and "train_step_emulated_overlap.json" in c
               for c in emulated)
