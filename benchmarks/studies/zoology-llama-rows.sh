#!/usr/bin/env bash
# Issue 60 on one GPU host: recall at Zoology's scale and Llama-style rows whose seeds agree
# (results/README.md, "Recall at Zoology's scale and Llama-style rows").
#
#   bash benchmarks/studies/zoology-llama-rows.sh SECTION [RESULTS_DIR]
#
# SECTION: recall      mhe compare --preset gpu-recall-zoology (PRESET to choose another grid): 2-layer
#                      attention-only decoders, widths 64-512, lengths 64-512 with 4-64 pairs, 11 entries
#                      x 3 learning rates (one more past an edge the best lies on), then 3 seeds at the
#                      best rate, in pooled workers (WORKERS, default 8 per GPU) ->
#                      RESULTS_DIR/recall-zoology. About 1,000 runs with the added rates, of 32k-64k
#                      tokens a step; lengths 256 and 512 compiled (RECALL_COMPILED_FROM).
#                      Measured on one H200: length 64 (259 runs) about 16 minutes shared at 4 workers,
#                      length 128 about 60 runs a 530-s call alone at 8; length 512 on two H200s
#                      32-48 runs a 565-s call under MPS=1 at widths 256-64 (16 at widths 512 and
#                      256 without it); every call is in results/recall-zoology/RUN.md, "This run"
#                      and "Step times"
#          llama-rows  mhe compare --preset gpu-llama-rows (PRESET: gpu-llama-rows-6x512): MHA, GQA, MQA,
#                      SHA, MHE-Add, MHE-Mul in both rotary orders, 3 seeds, every run at once (WORKERS,
#                      default 21) -> RESULTS_DIR/llama-rows (FOLDER to name it otherwise)
#
# RESULTS_DIR defaults to results. Each section writes its console to RESULTS_DIR/logs/i60-SECTION.log
# (card, torch, start and end times). A section stops at DEADLINE seconds (default 540: the device
# machine allows 600 a command and the packing must still run): runs still going save and stop,
# the tables are written from the finished ones, and the same command with the same RESULTS_DIR
# continues (--resume). The recall grid starts no run that its cell's finished runs say cannot
# end by then (--finish-by DEADLINE-10; exit 3 when runs wait): they wait for the next call
# instead of being cut midway. With $OUT set (the device machine's return folder) the section's folder is
# packed into $OUT/i60-SECTION.tar.gz without weights, checkpoints and tokenizers, the log beside it;
# a second call into a fresh copy unpacks $IN/i60-SECTION.tar.gz first when IN names the folder
# holding the first call's archive. Environment: MHE_DATA (default data-cache/data), WORKERS, PRESET,
# FOLDER, SET (extra KEY=VALUE settings for every run, for a quick check:
# SET="train.steps=4 data.task_options.train_size=200"), MPS=1 (NVIDIA's MPS daemon started for the
# pooled workers, so that their processes share the card's SMs instead of taking turns on it;
# `python benchmarks/train_bench.py recall-step --mps no,yes` measures whether it pays).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
section=${1:?SECTION (recall or llama-rows)}; results=${2:-results}; data=${MHE_DATA:-data-cache/data}
case $section in
  recall) preset=${PRESET:-gpu-recall-zoology}; folder=${FOLDER:-recall-zoology} ;;
  llama-rows) preset=${PRESET:-gpu-llama-rows}; folder=${FOLDER:-llama-rows}
    [ -d "$data/wikitext-2" ] && [ -d "$data/ptb" ] || { echo "no data folder at $data (set MHE_DATA)" >&2; exit 2; } ;;
  *) echo "unknown section '$section': recall or llama-rows" >&2; exit 2 ;;
esac
mkdir -p "$results/logs"
log="$results/logs/i60-$section.log"
if [ "${MPS:-0}" = 1 ]; then
  CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d); CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
  export CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  nvidia-cuda-mps-control -d || { echo "MPS=1: nvidia-cuda-mps-control could not start its daemon" >&2; exit 2; }
  trap 'echo quit | nvidia-cuda-mps-control; rm -rf "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"' EXIT
fi
if [ -n "${IN:-}" ] && [ -f "$IN/i60-$section.tar.gz" ] && [ ! -e "$results/$folder" ]; then
  tar -xzf "$IN/i60-$section.tar.gz" -C "$results"   # a first call's folder, to continue it
fi
if [ -f "$results/$folder/runs.tar.xz" ]; then        # packed: unpack to train more
  python -m mhe report --unpack "$results/$folder" || exit 2
fi
{
  echo "+ issue 60, $section ($preset), $(date -u '+%F %T') UTC"
  python - <<'EOF'
import torch
card = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
print(f"card: {card}; torch {torch.__version__}; GPUs: {torch.cuda.device_count()}")
EOF
  start=$SECONDS
  extra=(); for item in ${SET:-}; do extra+=(--set "$item"); done
  workers=${WORKERS:-}
  if [ -z "$workers" ]; then
    gpus=$(python -c 'import torch; print(torch.cuda.device_count())')
    if [ "$section" = recall ]; then workers=$(( gpus > 0 ? 8 * gpus : 2 )); else workers=21; fi
  fi
  finish=(); deadline=${DEADLINE:-540}   # --finish-by only for a whole number of seconds over 20
  if [ "$section" = recall ] && [[ $deadline =~ ^[0-9]+$ ]] && [ "$deadline" -gt 20 ]; then
    finish=(--finish-by "$((deadline - 10))")
  fi
  timeout -k 60 "${DEADLINE:-540}" python -m mhe compare --preset "$preset" --data-dir "$data" \
      --workers "$workers" --out "$results/$folder" --resume "${finish[@]}" "${extra[@]}"
  rc=$?
  [ -f "$results/$folder/summary.json" ] || python -m mhe report "$results/$folder" >/dev/null
  echo "rc=$rc; wall $((SECONDS - start)) s; $(date -u '+%F %T') UTC"
  exit "$rc"
} 2>&1 | tee -a "$log"
rc=${PIPESTATUS[0]}
if [ -n "${OUT:-}" ]; then
  tar -czf "$OUT/i60-$section.tar.gz" -C "$results" --exclude='*.safetensors' --exclude='*.pt' \
      --exclude='tokenizer.json' --exclude='checkpoints' --exclude='best' "$folder"
  cp "$log" "$OUT/"
  ls -l "$OUT"
fi
exit "$rc"
