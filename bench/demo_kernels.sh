#!/usr/bin/env bash
# The default run (`python train_dpo.py`, the demo's SFT stage then DPO) from a fresh cache under each of
# PyTorch's CPU kernel sets, from the repo root: the same seed on other kernels rounds otherwise, so it samples
# otherwise, as on another kind of CPU. Each run's last line (the scorer's preferred share at the first, the last
# and the best evaluation) goes to runs/bench/demo-kernels/lines.txt.
#   bash bench/demo_kernels.sh && cat runs/bench/demo-kernels/lines.txt
# KERNELS: the ATEN_CPU_CAPABILITY values to run ("native" is the CPU's own: avx512 where it has it).
set -eu
PY=${PY:-python} O=runs/bench/demo-kernels
mkdir -p $O
: > $O/lines.txt
for kernels in ${KERNELS:-native avx2 default}; do
  if [ "$kernels" = native ]; then unset ATEN_CPU_CAPABILITY; else export ATEN_CPU_CAPABILITY=$kernels; fi
  rm -rf $O/$kernels
  $PY train_dpo.py --cache-dir $O/$kernels/cache --out-dir $O/$kernels/dpo > $O/$kernels.log 2>&1
  echo "$kernels: $(tail -1 $O/$kernels.log)" >> $O/lines.txt
done
