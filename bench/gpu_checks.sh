#!/usr/bin/env bash
# GPU checks of the training speed work, ready to run unchanged on a machine with CUDA GPUs (one or more):
#   1. bf16 MFU of llama-style-1b on one GPU (train.py's own log line: measured against the
#      data-sheet peak on H100/H200/A100, training/mfu.py), with and without --profile;
#   2. the transformers comparison (bench/train_throughput.py) on the GPU, bf16 and fp32;
#   3. with 2+ GPUs: NCCL tensor parallel and data parallel of the same model
#      (tokens/s and MFU per layout, same global batch), plus the ZeRO bench.
# Usage: bash bench/gpu_checks.sh [OUT_DIR]   (OUT_DIR default: runs/gpu-checks)
# Every step has a time limit so a hang cannot eat the machine's time; the summary is the last lines.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu-checks}
mkdir -p "$OUT"
N=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$N" -lt 1 ]; then echo "no CUDA device: these checks need a GPU" >&2; exit 2; fi
python -c "import torch; print('GPUs:', [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])"

# the embedded corpus at seq 2048 (llama-style-1b keeps its shape; the demo tokenizer sets
# the vocabulary to 8,192, which makes the output layer small: say so when quoting MFU)
RUN=(--model llama-style-1b --seq-length 2048 --bf16 --micro-batch-size 4
     --global-batch-size 32 --train-iters 20 --log-interval 5 --eval-interval 0
     --no-tensorboard --recompute-granularity selective)

echo "== 1. llama-style-1b bf16 on one GPU"
timeout 900 python train.py "${RUN[@]}" --log-dir "$OUT/1gpu" | tee "$OUT/1gpu.log" | grep -E "^iter|^done"
timeout 900 python train.py "${RUN[@]}" --train-iters 14 --profile --profile-step-start 10 \
    --profile-step-end 12 --log-dir "$OUT/1gpu-profile" | tee "$OUT/1gpu-profile.log" \
    | sed -n '/^profile of/,/top operators/p'

echo "== 2. against transformers on the GPU"
timeout 900 python bench/train_throughput.py --model small-llama | tee "$OUT/train_throughput.log" | tail -12

if [ "$N" -ge 2 ]; then
  echo "== 3. NCCL layouts on $N GPUs"
  declare -A LAYOUTS=([tp$N-sp]="--tp $N --sequence-parallel" [dp$N]=""
                      [dp$N-zero1]="--use-distributed-optimizer")
  for name in "${!LAYOUTS[@]}"; do
    # shellcheck disable=SC2086  # the layout's flags are meant to split
    timeout 900 torchrun --standalone --nproc-per-node "$N" train.py "${RUN[@]}" \
        ${LAYOUTS[$name]} --log-dir "$OUT/$name" | tee "$OUT/$name.log" | grep -E "^done" \
        | sed "s/^/[$name] /"
  done
  timeout 900 python bench/zero_throughput.py --iters 5 --rounds 1 -- --model llama-style-1b \
      --seq-length 2048 --micro-batch-size 2 --global-batch-size "$((2 * N))" --bf16 \
      | tee "$OUT/zero_throughput.log" | tail -8
fi
echo "== logs in $OUT"
