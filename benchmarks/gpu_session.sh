#!/usr/bin/env bash
# The GPU measurements and tests still open, in one call on a GPU machine (about 10 minutes on
# one H100): the CUDA tests (the core against float64 references, no host synchronisation inside
# it, bf16 Gram products with float32 output, the stack budget from the free memory, the op
# count on CUDA against the GPU algorithm on CPU, the asynchronous mode on CUDA streams), then
# bench_snapshot.py on the Llama-3.2-1B and the 70B-shaped q/k stack (layer and per head,
# synchronous and async) with the 1B Trainer ratio. Each snapshot row prints the non-view ATen
# op count of one synchronous snapshot (attn_probe.op_count) beside torch.profiler's count of
# CUDA launches of the same snapshot (--kernels), which calibrates the device-independent count.
# Logs and JSON go to $OUT (default /tmp/attn_probe_gpu). Record the results, with the device
# name printed first, in docs/performance.md.
#
#     bash benchmarks/gpu_session.sh
set -o pipefail
OUT=${OUT:-/tmp/attn_probe_gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$OUT/device.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$OUT/test_cuda.log"
python3 benchmarks/bench_snapshot.py --shapes llama-1b llama-70b-attn --per-head --repeats 10 --kernels \
  --trainer-steps 60 --trainer-repeats 3 --json "$OUT/bench_snapshot.json" 2>&1 | tee "$OUT/bench_snapshot.log"
