#!/usr/bin/env bash
# The FP8 step's kernel settings on one GPU, from the repository root after `pip install -e .`:
# the LoRA activation's tiles and the quantisation's row walk timed alone, the GPU tests of the
# kernels they set, then the 8B step: bf16 and FP8 bases as they are, FP8 with the old 64x64x4
# tile, and FP8 with the fastest tile (and rows read once where that was faster alone). Results
# (JSON, logs) go to $OUT.
#   OUT=/path bash benchmarks/fp8_step_tuning.sh
# STEPS_ONLY=1: the kernels' settings as they are (no kernel benchmarks; their GPU tests after the
# steps), and the bf16/FP8 pair timed a second time after the old tile, so the pair's ratio is read
# twice around it; WARMUP and TIMED set the steps (3 and 8 unless given).
set -uo pipefail
OUT=${OUT:-$PWD/benchmarks/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
steps=(scenario.workload.warmup_steps="${WARMUP:-3}" scenario.workload.timed_steps="${TIMED:-8}")
step() {  # tag, then systems; the environment of the call sets the kernels' settings
    python -m lightning_sloth.bench scenario=llama_3_1_8b "systems.names=[$2]" "${steps[@]}" \
        out_dir="$OUT" tag="$1" 2>&1 | tee "$OUT/bench_$1.log" | tail -6
}

kernel_tests() {
    python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_glu_lora_gpu.py tests/gpu/test_fp8_gpu.py \
        -k "kernels_match or quantisation_kernel" 2>&1 | tee "$OUT/gpu_tests_fp8_tuning.log" | tail -3
}
default=$(python -c "from lightning_sloth.kernels.glu import LORA_TILE as t; print('x'.join(map(str, t)))")
if [ "${STEPS_ONLY:-0}" = 1 ]; then
    tile=$default one_pass=4096
else
    python benchmarks/glu_lora_tiles_bench.py --shapes llama_3_1_8b --out "$OUT/glu_lora_tiles.json" \
        | tee "$OUT/glu_lora_tiles.log"
    python benchmarks/fp8_quantize_bench.py --out "$OUT/fp8_quantize.json" | tee "$OUT/fp8_quantize.log"
    tile=$(python benchmarks/glu_lora_tiles_bench.py --best "$OUT/glu_lora_tiles.json") || exit 1
    echo "fastest LoRA activation tile: $tile"
    kernel_tests
    one_pass=$(python benchmarks/fp8_quantize_bench.py --best "$OUT/fp8_quantize.json") || exit 1
    echo "rows read once up to: $one_pass columns"
fi

step tuning_base sloth_kernels,sloth_fp8
# The step with the tile that was the default before 16x256x8, and with the fastest settings unless
# they are the defaults already (then tuning_base ran them).
LIGHTNING_SLOTH_GLU_LORA_TILE=64x64x4 step tuning_old_tile sloth_fp8
if [ "$tile" != "$default" ] || [ "$one_pass" != 4096 ]; then
    LIGHTNING_SLOTH_GLU_LORA_TILE=$tile LIGHTNING_SLOTH_FP8_ONE_PASS_COLS=$one_pass step tuning_tuned sloth_fp8
fi
if [ "${STEPS_ONLY:-0}" = 1 ]; then
    step tuning_base_b sloth_kernels,sloth_fp8
    kernel_tests
fi
