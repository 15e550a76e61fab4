#!/usr/bin/env bash
# The four-GPU run, from the repository root: the multi-GPU GPU tests at world size $GPUS (4), the
# expert-parallelism probe, then the benchmark rows of Qwen3-30B-A3B at full depth (sloth_fsdp, and
# transformers + PEFT + FSDP2 with grouped_mm experts) and of the Llama-3.1-70B shape in NF4 (QLoRA,
# each rank quantising its own shards). JSON and logs go to $OUT. Every part has a time cap and the
# whole run ends within BUDGET seconds (default 530); a part cut short says so in its log.
# PARTS picks parts (default tests,ep,30b,70b,stock). On four H200s the tests alone take about eight
# minutes (each app run spawns its ranks one after the other, every one importing the stack),
# ep + 30b + 70b about five and stock about four, so within 10-minute calls run them apart:
#   OUT=/tmp/out PARTS=tests BUDGET=560 bash benchmarks/multi_gpu_suite.sh
#   OUT=/tmp/out PARTS=ep,30b,70b bash benchmarks/multi_gpu_suite.sh
#   OUT=/tmp/out PARTS=stock bash benchmarks/multi_gpu_suite.sh
set -uo pipefail
OUT=${OUT:-$PWD/benchmarks/results/multi_gpu}
BUDGET=${BUDGET:-530}
GPUS=${GPUS:-4}
PARTS=${PARTS:-tests,ep,30b,70b,stock}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 SLOTH_TEST_GPUS=$GPUS
start=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - start))); }
cap() { local want=$1 rest; rest=$(left); echo $((rest < want ? (rest > 1 ? rest : 1) : want)); }
part() { [[ ",$PARTS," == *",$1,"* ]]; }
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)

python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"

if part tests; then
    log="$OUT/gpu_tests_world${GPUS}.log"
    timeout "$(cap 540)" python3 -m pytest -m gpu -q -rA -p no:cacheprovider \
        tests/gpu/test_fsdp_gpu.py tests/gpu/test_ddp_gpu.py 2>&1 | tee "$log"
    echo "gpu tests exit code: ${PIPESTATUS[0]} (124: cut at the time cap)" | tee -a "$log"
fi
if part ep; then
    timeout "$(cap 45)" python3 benchmarks/ep_probe.py --gpus "$GPUS" --out "$OUT/ep_probe.json" 2>&1 \
        | tail -40 | tee "$OUT/ep_probe.log"
fi

bench() {  # bench <seconds> <log name> <fsdp_bench arguments...>
    local seconds=$1 name=$2
    shift 2
    seconds=$(cap "$seconds")
    timeout "$((seconds + 15))" python3 benchmarks/fsdp_bench.py --gpus "$GPUS" --system-timeout "$seconds" \
        --git-commit "$commit" "$@" 2>&1 | grep -v Warning | tail -60 | tee "$OUT/$name.log"
}
if part 30b; then
    bench 100 fsdp_qwen3_30b_a3b --shape qwen3_30b_a3b --lora --systems sloth_fsdp --warmup 2 --steps 3 \
        --profile --out "$OUT/fsdp_qwen3_30b_a3b.json"
fi
if part 70b; then
    bench 160 fsdp_llama_3_1_70b_nf4 --shape llama_3_1_70b --lora --quantize nf4 --systems sloth_fsdp \
        --warmup 1 --steps 2 --out "$OUT/fsdp_llama_3_1_70b_nf4.json"
fi
if part stock; then
    bench 200 fsdp_qwen3_30b_a3b_stock --shape qwen3_30b_a3b --lora --systems stock_fsdp --warmup 1 --steps 2 \
        --out "$OUT/fsdp_qwen3_30b_a3b_stock.json"
fi
echo "multi-GPU suite done in $(($(date +%s) - start)) s (parts: $PARTS)"
