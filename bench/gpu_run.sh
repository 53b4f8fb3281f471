#!/usr/bin/env bash
# The GPU batches of the benchmarks, by name, so that one GPU-machine command is short:
#
#   GIT_COMMIT=<sha> bash bench/gpu_run.sh kernels collectives calibrate train
#
# Each step runs under its own timeout and logs to $OUT/<step>.log; whatever finished is
# packed into $OUT/results.tgz (bench/results/, docs/*.png) at the end, so a step that
# times out costs only itself. Steps:
#   kernels        python -m bench.kernels --codecs taco echo4: each implementation's timings
#                  vs the memory roofline (taco and echo4 rows in bench/results/kernels.json)
#   kernels_echo4  python -m bench.kernels --codecs echo4 --update: echo4's rows of
#                  kernels.json re-timed, taco's kept with the commit they were timed at
#                  (about half the kernels step's time)
#   kernels_check_echo4  python -m bench.kernels --codecs echo4 --check --no-timings: every
#                  4-bit kernel against its reference on the device, bit for bit, at the
#                  defaults and with the encoder variants on trial (kernels_check_echo4.json)
#   kernels_check_taco   the same for the TACO codecs' kernels (kernels_check_taco.json)
#   kernels_check  both, within 600 s together only if the taco checks are quick: on one
#                  machine call each alone is safe
#   echo4_tune     python -m bench.kernels --codecs echo4 --tune --no-timings: the 4-bit
#                  kernels' tile-math variants and tilings side by side at 16 and 256 MiB,
#                  of the kernels ECHO4_TUNE_KERNELS (default compress: 54 configurations;
#                  all four took ~6.5 min) → bench/results/kernels_echo4_tune_<kernels>.json
#   collectives    python -m bench.collectives --check: lax.psum vs taco per transport and
#                  size on the link as found (2+ GPUs)
#   links          the same on the PCIe path (NCCL_P2P_DISABLE=1) and the network path (two
#                  processes, one GPU each); appends to collectives_links.json
#   calibrate      python -m taco_jax.calibrate: the routes this machine measures, cached,
#                  and bench/results/calibrate.json
#   psum           python -m bench.profile psum: device profile of the all-reduce per transport
#   train          python -m bench.profile train + python -m bench.train_step (TP=2 step)
#   fused          python -m bench.fused --impl mesh --p <GPUs>: taco_jax.psum(transport=
#                  "fused") (one kernel per all-reduce: the one-shot at P = 2, the two-shot
#                  at P = 3..8) on all of this process's GPUs, checked against
#                  the exact sum and the xla transport (NaN blocks, fresh inputs, 5 calls),
#                  timed against lax.psum. Run it first: when it fails, the later steps
#                  leave the fused transport out (and say so)
#   loopback       python -m bench.fused: the same kernel on one GPU for P = 2, 4, 8 virtual
#                  devices (checks), and at P = 2 its device time and two-GPU projection
#   fused_ablate   python -m bench.fused --ablate --base one_warpgroup: the one-warpgroup
#                  kernel's stage knobs at 16, 64 and 256 MiB (P = 2 loopback, bf16) timed
#                  side by side with it (a stage left out or done twice; timed, not
#                  checked), with the table of differences to it (~290 s)
#   fused_levers   python -m bench.fused --ablate: the one-launch kernel's levers side by
#                  side with the default (warp-specialized at P = 2), each checked on 3
#                  calls (one call let a race through that five showed): one warpgroup per
#                  program, the encode in two column halves, the decode in one column pass;
#                  P = 2 loopback, bf16, 16 / 64 / 256 MiB → bench/results/fused_levers.json
#                  (~180 s)
#   fused_echo4_levers  python -m bench.fused --ablate --codec echo4 --variants default
#                  one_warpgroup: echo4's one-shot (P = 2 loopback, bf16, 16 / 64 / 256 MiB) as
#                  it is (one program per multiprocessor) and with two programs of half the
#                  shared memory each, side by side, each checked on 3 calls
#                  → bench/results/fused_echo4_levers.json (~120 s)
#   fused_p2       python -m bench.fused --p 2: the default launch's P = 2 loopback checks
#                  (bf16, f32, 1 KiB … 1 GiB, 5 calls) and, if they pass, its timing (bf16,
#                  16 / 64 / 256 MiB) → bench/results/fused_loopback_checks_p2.json,
#                  fused_loopback.json (~190 s): what a change to the kernel needs first
#   fused_checks   the loopback checks the fused transport's selection is written from
#                  (taco_jax/kernels/fused/checked.py): per codec of FUSED_CHECK_CODECS
#                  (default taco echo4 taco-e5m2 taco-1scale) the one-shot at P = 2 and the
#                  two-shot at P = 3, 4, 8 (FUSED_CHECK_P3), bf16, f32 and f16, 1 KiB,
#                  1 MiB + 5 B, 16, 64, 256 MiB, 5 calls; each row names the fingerprint of
#                  the module it ran. The (codec, kernel) runs go side by side (compiling is
#                  most of a check's time; memory taken as needed; the two-shots
#                  FUSED_CHECK_JOBS at a time, default 2), each under
#                  FUSED_CHECK_S (default 520 s); only what has not passed at the
#                  fingerprints emitted now runs (--missing), so a call cut short resumes
#                  → bench/results/fused_checks.json. With the results back in the
#                  checkout, `python -m bench.fused --write-checked` writes the table (the
#                  collectives select what it holds)
#   fused_echo4_own  python -m bench.fused --codec echo4 --config own_from_smem=true: echo4's
#                  P = 2 loopback checks (bf16, f32, 1 KiB … 256 MiB, 5 calls) and timing
#                  (bf16, 16 / 64 / 256 MiB) with this device's tile decoded from its
#                  staging → bench/results/fused_echo4_own_checks_p2.json,
#                  fused_echo4_loopback_own.json (~200 s)
#   fused_two_shot_time  python -m bench.fused --kernel two_shot --time: the one-launch
#                  two-shot's loopback device time per device, P = 4 and 8, bf16, 16 / 64 /
#                  256 MiB (checked first), taco then echo4 (--update: one file, rows by
#                  codec), beside the three-launch two-shot's kernels for one device
#                  (compress, reduce, decompress) → bench/results/fused_two_shot_loopback.json
#                  (~110 s a codec)
#   fused_two_shot python -m bench.fused --kernel two_shot: the one-launch two-shot's loopback
#                  checks of one codec (FUSED_TWO_SHOT_CODEC, default taco; echo4 the other),
#                  P = 8, 4, 3, 5, 6, 7 in that order (FUSED_TWO_SHOT_P), bf16, f32 and f16
#                  (FUSED_TWO_SHOT_DTYPES), 16 MiB first, 1 KiB to 256 MiB
#                  (FUSED_TWO_SHOT_SIZES), 5 calls on fresh inputs with NaN and Inf blocks;
#                  stops at the first hang or crash (60 s per configuration; ≤ 540 s,
#                  FUSED_TWO_SHOT_S sets the limit) → rows by codec, the others' kept
#                  (--update): bench/results/fused_two_shot_checks${FUSED_TWO_SHOT_TAG}.json
#   fused_two_shot_matrix  the two-shot's loopback checks over the whole matrix: taco and
#                  echo4, P = 3 … 8, bf16 and f32, 1 KiB, 1 MiB + 5 B, 16, 64, 256,
#                  1024 MiB, 5 calls; only what has not passed with these library sources
#                  (--missing: rows name their sources' hash), so a call cut short by its
#                  limit (FUSED_MATRIX_S, default 520 s) resumes in the next one. The four
#                  (codec, dtype) runs go side by side (compiling is most of a check's
#                  time), each from another P so that their 1 GiB inputs rarely meet, with
#                  memory taken as needed (not preallocated); FUSED_MATRIX_JOBS=1 runs them
#                  one after another → bench/results/fused_two_shot_checks.json
#   fused_two_shot_phases  where the two-shot's time goes: taco and echo4, P = 4 and 8, bf16,
#                  256 MiB, timed as it is and with FusedConfig(ablate=scatter_only /
#                  no_gather) (its later phases left out: scatter = scatter_only, reduce =
#                  no_gather − scatter_only, gather = the kernel − no_gather), rows by codec
#                  and config → bench/results/fused_two_shot_phases.json (~45 s a run, ≤ 540 s)
#   fused_echo4    echo4 over the one-launch kernel (selected at P = 2 since these passed):
#                  the byte checks of its Mosaic tile kernels (pytest -k gpu), the loopback
#                  checks (P = 2, 4, 8; bf16, f32; 1 KiB, 1 MiB + 5 B, 16, 64 MiB; stops at
#                  the first hang or crash) and, if they pass, P = 2 timed at 16/64/256 MiB
#                  (≤ 300 s: the tile tests took 16 s, 20 of the 24 checks 150 s at 3d8c666)
#   train_step_emulated  python -m bench.train_step --mesh 1,1,1 --emulate-tp 2 4 8 --variants
#                  none taco:xla taco:fused echo4:fused --steps 10: tensor parallelism
#                  emulated on one GPU, one preset per step (TRAIN_EMULATED_PRESETS, default
#                  comm_heavy small 350m; each merged into the file with --update, ≤ 540 s
#                  each), then python -m bench.step_projection
#                  → bench/results/train_step_emulated.json, step_projection.json
#   gemm_table     python -m bench.gemm_table --presets 350m --p 2 4 8: each Megatron GEMM of
#                  350m's step at TP = P (forward, dX, dW), whole and in P chunks of the
#                  sequence, on one GPU (device time), then python -m bench.step_projection,
#                  which prices the overlapped variants from it → bench/results/
#                  gemm_table.json, step_projection.json
#   train_overlap  python -m bench.train_step --presets 350m --variants none none:overlap
#                  taco:overlap echo4:overlap: the bf16 step, serial and with collective matmul
#                  (model.tp_overlap, sequence parallelism), and the codecs with it, over all
#                  of the machine's GPUs (2+) → bench/results/train_step_overlap.json
#   train_overlap_emulated  the same variants and sp (the serial sequence-parallel step,
#                  each overlap row's baseline) with tensor parallelism emulated on one GPU
#                  (--emulate-tp 4 8), 350m then qwen-0.5b, one step each, merged (--update):
#                  what chunking the GEMMs and the codecs' kernels cost the step without a
#                  link, against the overlap model's assumptions
#                  → bench/results/train_step_emulated_overlap.json
#   gemm_codec     python -m bench.gemm_codec: the row-parallel GEMM whose epilogue encodes
#                  (kernels.gemm) as a loopback on one GPU, per codec of GEMM_CODEC_CODECS
#                  (default taco echo4) and exchange of GEMM_CODEC_EXCHANGES (default all
#                  owner: the all-reduce, the reduce-scatter), each its own run ≤ 540 s,
#                  merged with --update (one pair a call keeps a call under 10 min):
#                  checks at P = GEMM_CODEC_P (default 2 4 8), bf16, 350m's and
#                  comm_heavy's attention-output and MLP-output GEMMs and an odd shape (the
#                  same bits on every virtual device, or the owners' rows the all-reduce's;
#                  NaN rows; error ≤ 1.05 × its jnp reference's; 3 calls), then the device
#                  time of each passed configuration: the GEMM with its encode and exchange,
#                  the decode with the residual, the same GEMM plain, XLA's dot, the
#                  three-launch path → bench/results/gemm_codec_checks.json,
#                  gemm_codec_loopback.json
#   gemm_codec_levers  the same GEMM's launch shapes side by side (taco, or the first of
#                  GEMM_CODEC_CODECS; exchange owner; P = 2, 8; 350m's two row-parallel
#                  GEMMs; 2 calls): the default (two compute warpgroups sharing w, their
#                  epilogues together) and ping-pong (each its own tiles, one's epilogue
#                  beside the other's mainloop) with 2 × 2 slots of tile_k 64 and 2 × 3 of
#                  32, each checked then timed (≤ 180 s each) → bench/results/
#                  gemm_codec_levers_checks.json, gemm_codec_levers.json
#   gather_gemm    python -m bench.gather_gemm: the column-parallel GEMM with its all-gather
#                  compressed, one launch, on one GPU for P = 2, 4, 8 virtual devices (of
#                  GATHER_GEMM_P), per codec of GATHER_GEMM_CODECS (default taco echo4), at
#                  350m's QKV and FC1 and an odd shape: checks (the same bits on every
#                  device, the NaN row, error ≤ 1.05 × the jnp reference's), then device time
#                  beside the plain GEMM of the gathered shape and XLA's all_gather + dot
#                  → bench/results/gather_gemm_checks.json, gather_gemm_loopback.json
#   train3d        python -m bench.train_step on (data, pipe, tp) meshes of 2 GPUs: pipeline
#                  hand-offs and data-parallel buckets, plain and compressed
#   fidelity       python -m experiments.fidelity on `small`: codec error on real TP tensors
#   ncu_time       Nsight Compute kernel durations of x + 1, compress and decompress
#   ncu_src        Nsight Compute full set of compress at 16 MiB (NCU_MIB) of the codec
#                  NCU_CODEC (taco; echo4: its Triton kernel): SASS source page summarized by
#                  bench.ncu_source (bench/results/ncu_src.json, ncu_src_echo4.json), and the
#                  details page
#   ncu_fused      Nsight Compute full set of the one-launch fused all-reduce (P = 2 loopback,
#                  bf16, NCU_MIB MiB, default 16; one checked call of bench.fused): its SASS
#                  source page summarized (bench/results/ncu_src_fused.json), the details page
#   ncu_two_shot   the same for the one-launch two-shot (P = NCU_P, default 8, loopback,
#                  bf16, NCU_MIB MiB, default 64, codec NCU_CODEC, default echo4): where its
#                  phases stall, per SASS line → bench/results/ncu_src_two_shot_<codec>.json
#   ablation       python -m experiments.ablation (convergence per codec; ABL_* variables:
#                  ABL_BUDGET seconds, ABL_VARIANTS, ABL_NAME, ABL_SET, ABL_WORKERS)
#   echo4_variants python -m experiments.echo_variants on the TP8 fidelity protocol (fidelity
#                  preset, emulated TP8 on one GPU, 800 steps, seeds ECHO_SEEDS, default 0-5,
#                  each paired with bf16 of its seed, the whole validation split): the
#                  variants ECHO_VARIANTS (default the two that docs/fidelity.md section 9
#                  sends to the GPU); resumable, ECHO_BUDGET seconds a call (default 520:
#                  18 runs take two calls) → bench/results/echo4_variants_tp8.json
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/jaxcache
export PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1          # no NVLink multicast, anywhere
export TACO_JAX_CALIBRATION=${TACO_JAX_CALIBRATION:-/tmp/taco_jax_calibration.json}
: "${GIT_COMMIT:?set GIT_COMMIT (the copy of the tree on the GPU machine has no git history)}"
export GIT_COMMIT
DEVICE=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
NGPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
JAXV=$(python -c 'import jax; print(jax.__version__)')

step() {  # step NAME TIMEOUT_S CMD...
  local name=$1 t=$2 rc; shift 2
  echo "=== $name: $* ($(date +%T))"
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "=== $name: rc=$rc ($(date +%T))"
  tail -n 40 "$OUT/$name.log"
  return $rc
}

ncu_pages() {  # ncu_pages REPORT TAG LABEL JSON: a profile's SASS source page (summarized
  # by bench.ncu_source into JSON) and its details page, as $OUT/ncu_{src,details}_TAG.*
  ncu -i "$1.ncu-rep" --page source --csv --print-source sass | gzip > "$OUT/ncu_src_$2.csv.gz"
  ncu -i "$1.ncu-rep" --page details --csv > "$OUT/ncu_details_$2.csv"
  python -m bench.ncu_source "$OUT/ncu_src_$2.csv.gz" --label "$3" --device "$DEVICE" \
    --jax "$JAXV" --out "$4" > "$OUT/ncu_$2_summary.log" 2>&1
}

# The fused transport takes part in the later steps only if the fused step passed (or did
# not run in this batch).
FUSED=(fused)
no_fused() {
  FUSED=()
  echo "=== the fused transport failed its check: later steps leave it out"
}

# The one-shot kernel's loopback at its default launch: the checks at P (5 calls on fresh
# inputs, bf16 and f32, 1 KiB … 1 GiB), and the P = 2 timing.
loopback_checks() {  # loopback_checks P
  step "loopback_p$1" 400 python -m bench.fused --p "$1" --isolate group --calls 5 \
    --timeout 80 --sizes 1KiB 1MiB+5 16MiB 64MiB 256MiB 1024MiB \
    --out "bench/results/fused_loopback_checks_p$1.json"
}
loopback_time() {
  step loopback_time 300 python -m bench.fused --p 2 --dtypes bf16 --time \
    --sizes 16MiB 64MiB 256MiB --isolate group --calls 1 --timeout 90 \
    --out bench/results/fused_loopback.json
}

for s in "$@"; do
  case $s in
    kernels) step kernels 540 python -m bench.kernels --codecs taco echo4 ;;
    kernels_echo4) step kernels_echo4 300 python -m bench.kernels --codecs echo4 \
                     --impls triton --update ;;
    kernels_check|kernels_check_echo4|kernels_check_taco)
      if [[ $s != kernels_check_taco ]]; then
        step kernels_check_echo4 420 python -m bench.kernels --codecs echo4 --impls triton \
          --check --no-timings --out bench/results/kernels_check_echo4.json
      fi
      if [[ $s != kernels_check_echo4 ]]; then
        step kernels_check_taco 540 python -m bench.kernels --codecs taco --check \
          --no-timings --out bench/results/kernels_check_taco.json
      fi ;;
    echo4_tune) kinds=${ECHO4_TUNE_KERNELS:-compress}
                step echo4_tune 420 python -m bench.kernels --codecs echo4 --impls triton \
                  --sizes-mib 16 --tune --no-timings --tune-kernels $kinds \
                  --out "bench/results/kernels_echo4_tune_${kinds// /_}.json" ;;
    collectives) step collectives 420 python -m bench.collectives --check \
                   --transports xla "${FUSED[@]}" ${FUSED[0]:+fused-none} lax-kernels ;;
    links) step links_pcie 300 python -m bench.collectives --link pcie \
             --out bench/results/collectives_pcie.json
           step links_network 300 python -m bench.collectives --link network \
             --transports xla --out bench/results/collectives_network.json ;;
    calibrate) step calibrate 300 python -m taco_jax.calibrate --transports xla "${FUSED[@]}" \
                 --json bench/results/calibrate.json ;;
    psum) step psum 200 python -m bench.profile psum --mib 16 256 \
            --out bench/results/profile_psum.json ;;
    train) step train_profile 330 python -m bench.profile train \
             --presets comm_heavy small 350m --variants none taco \
             --out bench/results/profile_train.json
           step train_step 240 python -m bench.train_step --presets comm_heavy small 350m \
             --variants none taco ;;
    fused) step fused 540 python -m bench.fused --impl mesh --p "$NGPU" --time --isolate group \
             --sizes 1KiB 1MiB+5 16MiB 64MiB 256MiB --timeout 100 \
             --out "bench/results/fused_${NGPU}gpu.json" || no_fused ;;
    loopback) for P in 2 4 8; do    # all of them took ~9 min on one H200 at 44319c9
                loopback_checks $P
              done
              loopback_time ;;
    fused_ablate) step fused_ablate "${FUSED_ABLATE_S:-300}" python -m bench.fused --ablate \
                    --variants one_warpgroup no_sync no_signal no_peer_stores no_decode \
                    no_encode decode_twice encode_twice --base one_warpgroup --isolate group \
                    --timeout 20 --out bench/results/fused_ablation.json ;;
    fused_levers) step fused_levers 300 python -m bench.fused --ablate --variants default \
                    one_warpgroup halved_encode one_part --isolate group --calls 3 \
                    --timeout 40 --out bench/results/fused_levers.json ;;
    fused_echo4_levers) step fused_echo4_levers 240 python -m bench.fused --ablate \
                          --codec echo4 --variants default one_warpgroup --isolate group \
                          --calls 3 --timeout 40 --out bench/results/fused_echo4_levers.json ;;
    fused_two_shot) step fused_two_shot "${FUSED_TWO_SHOT_S:-540}" python -m bench.fused \
                      --kernel two_shot --codec "${FUSED_TWO_SHOT_CODEC:-taco}" \
                      --p ${FUSED_TWO_SHOT_P:-8 4 3 5 6 7} \
                      --dtypes ${FUSED_TWO_SHOT_DTYPES:-bf16 f32 f16} \
                      --sizes ${FUSED_TWO_SHOT_SIZES:-16MiB 1KiB 1MiB+5 64MiB 256MiB} \
                      --calls 5 --isolate group --timeout 60 --fail-fast --update \
                      --out "bench/results/fused_two_shot_checks${FUSED_TWO_SHOT_TAG:-}.json" ;;
    fused_two_shot_matrix)
      jobs=${FUSED_MATRIX_JOBS:-4} k=0 prealloc=true
      [ "$jobs" -gt 1 ] && prealloc=false
      for run in "taco bf16 8 3 4 5 6 7" "taco f32 5 6 7 8 3 4" "echo4 bf16 3 4 8 5 6 7" \
                 "echo4 f32 6 7 3 4 5 8"; do
        set -- $run
        step "fused_two_shot_matrix_$1_$2" "${FUSED_MATRIX_S:-520}" \
          env XLA_PYTHON_CLIENT_PREALLOCATE=$prealloc python -m bench.fused \
          --kernel two_shot --codec "$1" --dtypes "$2" --p "${@:3}" \
          --sizes 1KiB 1MiB+5 16MiB 64MiB 256MiB 1024MiB --calls 5 --isolate group \
          --timeout 90 --fail-fast --update --missing \
          --out bench/results/fused_two_shot_checks.json &
        k=$((k + 1))
        [ $((k % jobs)) -eq 0 ] && wait
      done
      wait ;;
    fused_p2) loopback_checks 2 && loopback_time ;;
    fused_checks)
      fused_check() {  # fused_check CODEC KERNEL
        local ps=2
        [ "$2" = two_shot ] && ps=${FUSED_CHECK_P3:-3 4 8}
        XLA_PYTHON_CLIENT_PREALLOCATE=false step "fused_checks_$1_$2" \
          "${FUSED_CHECK_S:-520}" python -m bench.fused \
          --kernel "$2" --codec "$1" --p $ps --dtypes bf16 f32 f16 \
          --sizes 1KiB 1MiB+5 16MiB 64MiB 256MiB --calls 5 --isolate group --timeout 90 \
          --fail-fast --update --missing --out bench/results/fused_checks.json
      }
      codecs=${FUSED_CHECK_CODECS:-taco echo4 taco-e5m2 taco-1scale}
      n=0
      for codec in $codecs; do fused_check "$codec" one_shot & done
      # the two-shots FUSED_CHECK_JOBS at a time: four at P = 8, 256 MiB ran an 80 GB H100
      # out of memory (bench/results/fused_checks.json, taco-e5m2's P = 8 rows)
      for codec in $codecs; do
        fused_check "$codec" two_shot &
        n=$((n + 1))
        [ $((n % ${FUSED_CHECK_JOBS:-2})) -eq 0 ] && wait
      done
      wait ;;
    fused_echo4_own) step fused_echo4_own_checks 240 python -m bench.fused --codec echo4 \
                       --p 2 --isolate group --calls 5 --timeout 60 \
                       --sizes 1KiB 1MiB+5 16MiB 64MiB 256MiB --config own_from_smem=true \
                       --out bench/results/fused_echo4_own_checks_p2.json \
                     && step fused_echo4_own_time 150 python -m bench.fused --codec echo4 \
                       --p 2 --dtypes bf16 --time --sizes 16MiB 64MiB 256MiB --isolate group \
                       --calls 1 --timeout 90 --config own_from_smem=true \
                       --out bench/results/fused_echo4_loopback_own.json ;;
    fused_two_shot_time)
      for codec in taco echo4; do
        step "fused_two_shot_time_$codec" 240 python -m bench.fused --kernel two_shot \
          --codec "$codec" --p 4 8 --dtypes bf16 --time --sizes 16MiB 64MiB 256MiB \
          --calls 1 --isolate group --timeout 90 --update \
          --out bench/results/fused_two_shot_loopback.json || break
      done ;;
    fused_two_shot_phases)
      rm -f bench/results/fused_two_shot_phases.json
      for codec in taco echo4; do
        for cfg in "" "--config ablate=scatter_only" "--config ablate=no_gather"; do
          step "fused_two_shot_phases_$codec" 90 python -m bench.fused --kernel two_shot \
            --codec "$codec" --p 4 8 --dtypes bf16 --time --sizes 256MiB --calls 1 \
            --isolate group --timeout 80 --update $cfg \
            --out bench/results/fused_two_shot_phases.json || break 2
        done
      done ;;
    fused_echo4)
      step fused_echo4_tiles 30 python -m pytest -x -q tests/kernels/test_mosaic_echo4.py -k gpu
      step fused_echo4_checks 195 python -m bench.fused --codec echo4 --p 2 4 8 \
        --dtypes bf16 f32 --sizes 1KiB 1MiB+5 16MiB 64MiB --calls 2 --isolate group \
        --timeout 20 --fail-fast --out bench/results/fused_echo4_checks.json \
        && step fused_echo4_time 75 python -m bench.fused --codec echo4 --p 2 --dtypes bf16 \
          --time --sizes 16MiB 64MiB 256MiB --calls 1 --isolate group --timeout 25 \
          --fail-fast --out bench/results/fused_echo4_loopback.json ;;
    train_step_emulated)
      for preset in ${TRAIN_EMULATED_PRESETS:-comm_heavy small 350m}; do
        step "train_step_emulated_$preset" 540 python -m bench.train_step --presets "$preset" \
          --mesh 1,1,1 --emulate-tp 2 4 8 --variants none taco:xla taco:fused echo4:fused \
          --steps 10 --update --out bench/results/train_step_emulated.json \
          ${TRAIN_EMULATED_SET:+--set $TRAIN_EMULATED_SET}
      done
      step step_projection 60 python -m bench.step_projection ;;
    gemm_table) step gemm_table 420 python -m bench.gemm_table --presets 350m --p 2 4 8 \
                  --out bench/results/gemm_table.json \
                && step step_projection 60 python -m bench.step_projection ;;
    train_overlap) step train_overlap 540 python -m bench.train_step --presets 350m \
                     --variants none none:overlap taco:overlap echo4:overlap \
                     --out bench/results/train_step_overlap.json ;;
    train_overlap_emulated) for preset in 350m qwen-0.5b; do
                  step "train_overlap_emulated_$preset" 540 python -m bench.train_step \
                    --presets "$preset" --mesh 1,1,1 --emulate-tp 4 8 --variants none sp \
                    none:overlap taco:overlap echo4:overlap --steps 10 --update \
                    --out bench/results/train_step_emulated_overlap.json
                done ;;
    gemm_codec) for codec in ${GEMM_CODEC_CODECS:-taco echo4}; do
                  for exchange in ${GEMM_CODEC_EXCHANGES:-all owner}; do
                    step "gemm_codec_${codec}_$exchange" 540 python -m bench.gemm_codec \
                      --codecs "$codec" --exchanges "$exchange" --p ${GEMM_CODEC_P:-2 4 8} \
                      --calls 3 --timeout 100 --update
                  done
                done ;;
    gather_gemm) for codec in ${GATHER_GEMM_CODECS:-taco echo4}; do
                   step "gather_gemm_$codec" 540 python -m bench.gather_gemm --codecs "$codec" \
                     --p ${GATHER_GEMM_P:-2 4 8} --calls 3 --timeout 100 --update
                 done ;;
    gemm_codec_levers)
      k=0
      for cfg in "" "pingpong=true steps=2" "pingpong=true tile_k=32 steps=3"; do
        k=$((k + 1))
        step "gemm_codec_levers_$k" 180 python -m bench.gemm_codec \
          --codecs "$(echo ${GEMM_CODEC_CODECS:-taco} | cut -d' ' -f1)" --exchanges owner \
          --p 2 8 --shapes 350m.attn_out 350m.mlp_out --calls 2 --timeout 60 --update \
          ${cfg:+--gemm-config $cfg} --checks-out bench/results/gemm_codec_levers_checks.json \
          --times-out bench/results/gemm_codec_levers.json
      done ;;
    train3d) step train3d_pp 300 python -m bench.train_step --presets small comm_heavy \
               --mesh 1,2,1 --microbatches 8 --variants none pp pp@default \
               --out bench/results/train_step_pp.json
             step train3d_dp 240 python -m bench.train_step --presets small comm_heavy \
               --mesh 2,1,1 --variants none dp dp@default \
               --out bench/results/train_step_dp.json ;;
    fidelity) step fidelity 300 python -m experiments.fidelity --config small --steps 1000 \
                --capture-at 100 1000 --set train.progress=false ;;
    ncu_time) step ncu_time_raw 200 ncu --clock-control none --metrics \
                gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum --csv \
                python -m bench.one_kernel decompress taco --roofline
              python -m bench.ncu_time "$OUT"/ncu_time_raw.log --label default \
                --commit "$GIT_COMMIT" --device "$DEVICE" --jax "$JAXV" \
                > "$OUT/ncu_time.log" 2>&1 ;;
    ncu_src) codec=${NCU_CODEC:-taco}
             suffix=$([[ $codec == taco ]] || echo "_$codec")
             step ncu_src 200 ncu -k "regex:${codec}_compress" -c 1 --set full \
               -o /tmp/ncu_src python -m bench.one_kernel compress "$codec" \
               --mib "${NCU_MIB:-16}"
             ncu_pages /tmp/ncu_src "compress$suffix" "compress-$codec" \
               "bench/results/ncu_src$suffix.json" ;;
    ncu_fused) step ncu_fused 240 ncu -k regex:fused_allreduce -c 1 --set full \
                 -o /tmp/ncu_fused python -m bench.fused --one 2 \
                 "$(( ${NCU_MIB:-16} << 20 ))" bf16 --impl kernel --calls 1 --codec taco
               ncu_pages /tmp/ncu_fused fused fused-allreduce bench/results/ncu_src_fused.json ;;
    ncu_two_shot) codec=${NCU_CODEC:-echo4}
                  step ncu_two_shot 240 ncu -k regex:taco_fused_two_shot -c 1 --set full \
                    -o /tmp/ncu_two_shot python -m bench.fused --kernel two_shot --one \
                    "${NCU_P:-8}" "$(( ${NCU_MIB:-64} << 20 ))" bf16 --impl kernel --calls 1 \
                    --codec "$codec"
                  ncu_pages /tmp/ncu_two_shot two_shot "two-shot-$codec" \
                    "bench/results/ncu_src_two_shot_$codec.json" ;;
    ablation) step ablation $(( ${ABL_BUDGET:-520} + 60 )) python -m experiments.ablation \
                --config small --steps 2000 --budget-s "${ABL_BUDGET:-520}" \
                --workers "${ABL_WORKERS:-1}" \
                --out-dir "runs/${ABL_NAME:-ablation}" \
                --json "bench/results/${ABL_NAME:-ablation}.json" \
                --plot "docs/${ABL_NAME:-ablation}.png" \
                --variants ${ABL_VARIANTS:-none@seed2 taco@seed2} \
                --set train.progress=false train.ckpt_every=0 train.eval_every=250 \
                      train.eval_batches=32 ${ABL_SET:-} ;;
    echo4_variants) step echo4_variants $(( ${ECHO_BUDGET:-520} + 60 )) python -m \
                      experiments.echo_variants --preset fidelity --tp 8 \
                      --seeds ${ECHO_SEEDS:-0 1 2 3 4 5} --eval-batches 0 --log-every 100 \
                      --budget-s "${ECHO_BUDGET:-520}" \
                      --variants none \
                        ${ECHO_VARIANTS:-echo4+feedback,head=taco echo4-g64c+feedback} \
                      --json bench/results/echo4_variants_tp8.json ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac
done
tar czf "$OUT/results.tgz" bench/results docs/*.png
ls -la "$OUT"
