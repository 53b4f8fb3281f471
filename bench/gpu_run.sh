#!/usr/bin/env bash
# The GPU-machine batches of the benchmarks, by name, so a device call is one short line:
#
#   GIT_COMMIT=<sha> bash bench/gpu_run.sh kernels psum collectives     # on the GPU machine
#
# Each step runs under its own timeout and logs to $OUT/<step>.log; whatever finished is
# packed into $OUT/results.tgz (bench/results/, docs/*.png) at the end, so a step that
# times out costs only itself. Steps:
#   kernels      bench/kernels.py --check --stages (issue 2; sizes 16–1024 MiB)
#   tilings      bench/kernels.py --tilings --overhead: KernelConfig candidates for each
#                kernel (TILINGS), A B A B, at 256 MiB; the timing loop's own cost
#   psum         bench/profile.py psum (overlap of the two-shot all-reduce; traces kept)
#   collectives  bench/collectives.py, all sizes, fresh-input ratios, HLO schedule dumped
#   calibrate    bench/calibrate.py: taco_jax.tuning.calibrate_min_bytes on this machine
#   train        bench/profile.py train (step breakdown) + bench/train_step.py (issue 6)
#   fidelity     bench/fidelity.py on `small` (issue 7 part 1)
#   ncu          Nsight Compute on compress (taco, block-fp8) and decompress, 256 MiB
#   tilings_sizes  the same at 16, 64 and 256 MiB, 2 rounds (kernels_tilings_sizes.json)
#   ncu_time     Nsight Compute's kernel durations (gpu__time_duration, clocks as found) of
#                the roofline's x + 1, compress and decompress (taco, 256 MiB; 1 and 4
#                tiles per program): kernel time without any timer's own cost; summed up
#                by bench/ncu_time.py into bench/results/ncu_time.json
#   ncu_src      Nsight Compute --set full with source correlation on compress (taco, 256 MiB),
#                the default kernel and the IEEE per-block math (fast_rowmath=False):
#                reports and per-SASS-line CSVs come back
#                gzipped, summarized side by side by bench/ncu_source.py into
#                bench/results/ncu_src.json (which instructions the issue-bound kernel spends
#                its slots on)
#   ablation     python -m train.ablation v2 (issue 7; docs/fidelity.md): `small`, 2000 steps,
#                a 200 MB stdlib + site-packages corpus; ABL_VARIANTS (default below),
#                ABL_BUDGET seconds (default 520; the driver stops cleanly, re-run resumes:
#                finished rows come back in the JSON); ABL_NAME (default ablation: the complete table) names
#                the JSON bench/results/$ABL_NAME.json, the plot docs/$ABL_NAME.png and the
#                run dirs runs/$ABL_NAME; ABL_SET: extra config overrides for every variant;
#                ABL_WORKERS=2: two runs at once on the same GPUs (overlaps one run's compile
#                and evaluation with another's training; untried on the GPU: compare runs
#                finished per call with the ~4.4 per 520 s of session 5)
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/jaxcache
export PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
: "${GIT_COMMIT:?set GIT_COMMIT (the device machine has no git)}"
export GIT_COMMIT

step() {  # step NAME TIMEOUT_S CMD...
  local name=$1 t=$2; shift 2
  echo "=== $name: $* ($(date +%T))"
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1
  echo "=== $name: rc=$? ($(date +%T))"
  tail -n 40 "$OUT/$name.log"
}

for s in "$@"; do
  case $s in
    kernels) step kernels 300 python bench/kernels.py --check --stages ;;
    tilings) step tilings 450 python bench/kernels.py --tilings --overhead --sizes-mib 256 \
               --out bench/results/kernels_tilings.json ;;
    psum) step psum 200 python bench/profile.py psum --mib 256 --chunks-mib 0 64 16 \
            --keep-trace /tmp/traces --out bench/results/profile_psum.json
          tar czf "$OUT/psum_traces.tgz" -C /tmp traces 2>/dev/null
          [ "$(stat -c %s "$OUT/psum_traces.tgz")" -lt 15000000 ] || rm -f "$OUT/psum_traces.tgz" ;;
    calibrate) step calibrate 200 python bench/calibrate.py ;;
    collectives) step collectives 300 python bench/collectives.py \
                   --dump-hlo /tmp/psum_hlo.txt
                 gzip -c /tmp/psum_hlo.txt > "$OUT/psum_hlo.txt.gz" 2>/dev/null ;;
    train) step train_profile 330 python bench/profile.py train \
             --presets comm_heavy small 350m --variants none taco \
             --out bench/results/profile_train.json
           step train_step 240 python bench/train_step.py --presets comm_heavy small 350m \
             --variants none taco ;;
    fidelity) step fidelity 300 python bench/fidelity.py --config small --steps 1000 \
                --capture-at 100 1000 --set train.progress=false ;;
    ncu) for k in "compress taco" "compress block-fp8" "decompress taco"; do
           set -- $k
           step "ncu_$1_$2" 120 ncu -k "regex:taco_$1" -c 1 --section SpeedOfLight \
             --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
             --section LaunchStats --section ComputeWorkloadAnalysis \
             python bench/one_kernel.py "$1" "$2"
         done ;;
    tilings_sizes) step tilings_sizes 300 python bench/kernels.py --tilings \
                     --tilings-mib 16 64 256 --rounds 2 --sizes-mib 256 \
                     --out bench/results/kernels_tilings_sizes.json ;;
    ncu_time) for t in 1 4; do   # tiles per program
                step ncu_time_t$t 150 ncu --clock-control none --metrics \
                  gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum --csv \
                  python bench/one_kernel.py decompress taco --roofline --tiles $t
              done
              python bench/ncu_time.py "$OUT"/ncu_time_t{1,4}.log --label tiles1 tiles4 \
                --commit "$GIT_COMMIT" "$GIT_COMMIT" \
                --device "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" \
                --jax "$(python -c 'import jax; print(jax.__version__)')" \
                > "$OUT/ncu_time.log" 2>&1 ;;
    ncu_src) for v in default ieee; do   # the default kernel and the IEEE per-block math
               flag=; [ $v = ieee ] && flag=--ieee-rowmath
               step "ncu_src_$v" 150 ncu --set full --import-source yes -k regex:taco_compress \
                 -c 1 -f -o "/tmp/ncu_compress_$v" python bench/one_kernel.py compress taco $flag
               ncu -i "/tmp/ncu_compress_$v.ncu-rep" --page source --csv --print-source sass \
                 2>&1 | gzip > "$OUT/ncu_src_compress_$v.csv.gz"
               gzip -c "/tmp/ncu_compress_$v.ncu-rep" > "$OUT/ncu_compress_$v.ncu-rep.gz"
             done
             python bench/ncu_source.py "$OUT"/ncu_src_compress_{default,ieee}.csv.gz \
               --label default ieee_rowmath --out bench/results/ncu_src.json \
               --device "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" \
               --jax "$(python -c 'import jax; print(jax.__version__)')" \
               > "$OUT/ncu_source.log" 2>&1 ;;
    ablation) step ablation $(( ${ABL_BUDGET:-520} + 60 )) python -m train.ablation \
                --config small --steps 2000 --budget-s "${ABL_BUDGET:-520}" \
                --workers "${ABL_WORKERS:-1}" \
                --out-dir "runs/${ABL_NAME:-ablation}" \
                --json "bench/results/${ABL_NAME:-ablation}.json" \
                --plot "docs/${ABL_NAME:-ablation}.png" \
                --variants ${ABL_VARIANTS:-none@seed2 taco@seed2 fwd:taco@seed2 \
                           hadamard-fp8@seed1 hadamard-fp8@seed2 bwd:taco@seed1 \
                           taco-int8@seed1 none@seed3 taco@seed3} \
                --set train.progress=false train.ckpt_every=0 train.eval_every=250 \
                      train.eval_batches=32 "data.paths=[python:stdlib, python:site-packages]" \
                      data.max_mb=200 data.shuffle_files=true ${ABL_SET:-} ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac
done
tar czf "$OUT/results.tgz" bench/results docs/*.png
ls -la "$OUT"
