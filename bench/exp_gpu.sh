#!/usr/bin/env bash
# EXPERIMENT (session 4): kernel variants + Triton/PTX dumps of compress/decompress.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
timeout 330 python bench/exp_variants.py > "$OUT/variants.log" 2>&1; echo "variants rc=$?"
grep -v Warn "$OUT/variants.log" | tail -45
cp bench/results/kernel_variants.json "$OUT/" 2>/dev/null
for v in "compress ''" "compress L" "decompress ''" "decompress L"; do
  eval set -- $v
  d=/tmp/xd_$1_${2:-base}
  MLIR_ENABLE_DUMP=1 XLA_FLAGS="--xla_dump_to=$d --xla_gpu_dump_llvmir" timeout 90 \
    python bench/one_kernel.py "$1" taco --mib 16 --exp "$2" > "$d.log" 2>&1
  echo "dump $1 $2 rc=$? files=$(ls $d | wc -l)"
done
ls /tmp/xd_compress_base | head -30
cd /tmp && find xd_* -maxdepth 2 \( -name '*.ptx' -o -name '*ttir*' -o -name '*ttgir*' \
  -o -name '*triton*' -o -name '*.ll' -o -name '*after_optimizations.txt' \) -size -20M \
  > /tmp/dumplist; tar czf "$OUT/dumps.tgz" -T /tmp/dumplist xd_*.log
[ "$(stat -c %s "$OUT/dumps.tgz")" -lt 15000000 ] || tar czf "$OUT/dumps.tgz" -T /tmp/dumplist
ls -la "$OUT"
