#!/usr/bin/env bash
# The GPU measurements and tests still open, in one call on a GPU machine (about 10 minutes on
# one H100): the CUDA tests (the core against float64 references, no host synchronisation inside
# it, bf16 Gram products with float32 output, the stack budget from the free memory, the op
# count on CUDA against the GPU algorithm on CPU, the asynchronous mode on CUDA streams), then
# bench_snapshot.py on the Llama-3.2-1B and the 70B-shaped q/k stack (layer and per head,
# synchronous and async) with the 1B Trainer ratio. Each snapshot row prints the non-view ATen
# op count of one synchronous snapshot (attn_probe.core.op_count) beside torch.profiler's count of
# CUDA launches of the same snapshot (--kernels), which calibrates the device-independent count.
# Logs and JSON go to $OUT (default /tmp/attn_probe_gpu). Record the results, with the device
# name printed first, in docs/performance.md.
#
#     bash benchmarks/gpu_session.sh [all|weights|attention|demo|emergence|both]     (or SECTION=attention)
#
# Sections: "weights" is the above; "attention" (about 5 minutes on an H100) runs the
# attention-statistics CUDA tests (tests/activations/test_attention_cuda.py: sdpa == eager, bf16 against
# float64, CUDA == CPU), then bench_attention_stats.py on the Llama-3.2-1B shape at sequences
# 2,048 and 8,192 in bf16, under sdpa, eager and (if installed) flash_attention_2 (due and
# not-due step time, peak memory) and the Trainer wall-time ratio at every=10 with
# attention_stats=True, then bench_flex_stats.py at the 1B width (flex eager; compiled with
# inductor, with and without attention_flex_compiled); "all" (the default) runs both. DRY_RUN=1 runs the
# selected sections' logic on the CPU with tiny shapes (no GPU numbers: a check of the script).
#
# The demo's sections, separate because each takes most of a lent GPU's time, run
# benchmarks/gpu_emergence.sh (its header says what they do; first `bash benchmarks/gpu_emergence.sh
# prepare` where you call from, and carry .gpu_corpus): "demo" times `attn-probe demo` on the GPU
# preset; "emergence" trains a character-level decoder, a word-level decoder and a character-level
# encoder at 512 positions; "both" runs the two at once. "all" does not include them.
set -o pipefail
SECTION=${1:-${SECTION:-all}}
case "$SECTION" in
  all|weights|attention) ;;
  demo|emergence|both) exec bash "$(dirname "$0")/gpu_emergence.sh" "$SECTION";;
  *) echo "unknown section '$SECTION': all, weights, attention, demo, emergence or both" >&2; exit 2;;
esac
DRY_RUN=${DRY_RUN:-0}
OUT=${OUT:-/tmp/attn_probe_gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "$DRY_RUN" = 1 ]; then
  echo "DRY_RUN: CPU, tiny shapes" | tee "$OUT/device.txt"
  DEVICE=cpu SHAPE=small DTYPE=float32 SEQ=64 SEQS="64 128" BATCH=2 STEPS=4 REPEATS=1 FLEX_DIM=64 FLEX_HEADS=4
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
  DEVICE=cuda SHAPE=llama-1b DTYPE=bfloat16 SEQ=2048 SEQS="2048 8192" BATCH=1 STEPS=40 REPEATS=5 FLEX_DIM=2048 FLEX_HEADS=32
fi
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$OUT/device.txt"
if [ "$SECTION" != attention ] && [ "$DRY_RUN" != 1 ]; then
  python3 -m pytest -q -p no:cacheprovider tests/core/test_cuda.py 2>&1 | tee "$OUT/test_cuda.log"
  python3 benchmarks/bench_snapshot.py --shapes llama-1b llama-70b-attn --per-head --repeats 10 --kernels \
    --trainer-steps 60 --trainer-repeats 3 --json "$OUT/bench_snapshot.json" 2>&1 | tee "$OUT/bench_snapshot.log"
fi
if [ "$SECTION" != weights ]; then
  python3 -m pytest -q -p no:cacheprovider tests/activations/test_attention_cuda.py 2>&1 | tee "$OUT/test_attention_cuda.log"
  # the due-step cost per length and attention path (issue 37): sdpa and eager always,
  # flash_attention_2 where the flash-attn package is installed; FlexAttention below.
  IMPLS="sdpa eager"
  if python3 -c "import flash_attn" 2>/dev/null; then IMPLS="$IMPLS flash_attention_2"; fi
  for L in $SEQS; do
    for IMPL in $IMPLS; do
      echo "== seq $L, $IMPL" | tee -a "$OUT/bench_attention_step.log"
      python3 benchmarks/bench_attention_stats.py --device "$DEVICE" --shape "$SHAPE" --dtype "$DTYPE" --seq "$L" \
        --batch "$BATCH" --repeats "$REPEATS" --impl "$IMPL" 2>&1 | tee -a "$OUT/bench_attention_step.log"
    done
  done
  python3 benchmarks/bench_attention_stats.py --device "$DEVICE" --shape "$SHAPE" --dtype "$DTYPE" --seq "$SEQ" \
    --batch "$BATCH" --trainer "$STEPS" --every 10 2>&1 | tee "$OUT/bench_attention_trainer.log"
  # FlexAttention on the 1B width (2,048, 32 heads), two blocks: flex called eagerly (measured by
  # default), flex compiled with inductor (not measured by default: the due step costs a normal
  # one) and the same with attention_flex_compiled (the statistics traced into the graph)
  for FLEXRUN in "--flex eager" "--flex compiled" "--flex compiled --opt-in"; do
    echo "== $FLEXRUN" | tee -a "$OUT/bench_flex_step.log"
    python3 benchmarks/bench_flex_stats.py $SEQS --device "$DEVICE" --dtype "$DTYPE" --dim "$FLEX_DIM" \
      --heads "$FLEX_HEADS" --batch "$BATCH" --repeats "$REPEATS" $FLEXRUN 2>&1 | tee -a "$OUT/bench_flex_step.log"
  done
fi
