#!/usr/bin/env bash
# Issue 43 on one GPU: MHE in a Llama-style decoder (results/README.md, "Llama-style decoders").
#
#   bash benchmarks/studies/llama.sh SECTION [RESULTS_DIR]
#
# SECTION: scratch  mhe compare --preset gpu-llama-6x512: MHA, GQA, MQA, SHA, MHE-Add, MHE-Mul in both
#                   rotary orders, 3 seeds, all 21 runs at once on the card -> RESULTS_DIR/llama-6x512
#          uptrain  benchmarks/uptrain.py study --preset llama-6x512: the MHA source pre-trained, converted
#                   to MQA, GQA, MHE-Mul, MHE-Add, uptrained 5% and 10% x 3 seeds, from-scratch references
#                   -> RESULTS_DIR/uptrain-llama-6x512
#          methods  benchmarks/uptrain.py methods (issue 61): the same source, converted and uptrained by each
#                   method (output fit, psi-then-rope, distillation; MQA and MHE-Mul re-run beside them), on every
#                   GPU of the host -> RESULTS_DIR/uptrain-llama-6x512/methods (STUDY_ARGS: e.g. "--methods
#                   mqa,mhe-mul-outputs-kd --fractions 0.1")
#
# RESULTS_DIR defaults to results. Each section writes its console to RESULTS_DIR/logs/llama-SECTION.log
# (card, torch, start and end times). With $OUT set (the device machine's return folder) the
# section's folder is packed into $OUT/SECTION.tar.gz without weights and tokenizers (the committed
# run folders keep config.json, run.json, metrics.jsonl, results.json and the logs), and the log
# is copied beside it. A section is stopped at DEADLINE seconds (default 560: the device machine
# allows 600 a command, and the packing must still run): the runs still going save and exit, the
# table is written from the finished ones, and the same command with the same RESULTS_DIR continues
# either section (scratch: --resume; uptrain: finished runs and the conversions are kept, stopped runs resume). Environment: MHE_DATA (default data-cache/data: the whole data
# folder, which offline-english reads), WORKERS (scratch: runs at a time, default 11), SET (extra KEY=VALUE
# settings for every run, for a quick check: SET="train.steps=4 data.limit_lines=200"), STUDY_ARGS
# (uptrain: extra arguments of `uptrain.py study`, e.g. "--steps 40 --limit-lines 200").
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
section=${1:?SECTION (scratch, uptrain or methods)}; results=${2:-results}; data=${MHE_DATA:-data-cache/data}
case $section in
  scratch) folder=llama-6x512 ;;
  uptrain) folder=uptrain-llama-6x512 ;;
  methods) folder=uptrain-llama-6x512/methods ;;
  *) echo "unknown section '$section': scratch, uptrain or methods" >&2; exit 2 ;;
esac
[ -d "$data/wikitext-2" ] && [ -d "$data/ptb" ] || { echo "no data folder at $data (set MHE_DATA)" >&2; exit 2; }
mkdir -p "$results/logs"
log="$results/logs/llama-$section.log"
{
  echo "+ issue 43, $section, $(date -u '+%F %T') UTC"
  python - <<'EOF'
import torch
card = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
print(f"card: {card}; torch {torch.__version__}; GPUs: {torch.cuda.device_count()}")
EOF
  start=$SECONDS
  if [ "$section" = scratch ]; then
    extra=(); for item in ${SET:-}; do extra+=(--set "$item"); done
    timeout "${DEADLINE:-560}" python -m mhe compare --preset gpu-llama-6x512 --data-dir "$data" \
        --workers "${WORKERS:-11}" --out "$results/$folder" --resume "${extra[@]}"
    rc=$?
    [ -f "$results/$folder/summary.json" ] || python -m mhe report "$results/$folder" >/dev/null
  elif [ "$section" = methods ]; then
    # shellcheck disable=SC2086  # STUDY_ARGS is a list of words
    timeout "${DEADLINE:-560}" python benchmarks/uptrain.py methods --data-dir "$data" --out "$results/$folder" \
        --budget-s "$(( ${DEADLINE:-560} - 20 ))" ${STUDY_ARGS:-}
    rc=$?
  else
    # shellcheck disable=SC2086  # STUDY_ARGS is a list of words
    timeout "${DEADLINE:-560}" python benchmarks/uptrain.py study --preset llama-6x512 --data-dir "$data" \
        --out "$results/$folder" --budget-s "$(( ${DEADLINE:-560} - 20 ))" ${STUDY_ARGS:-}
    rc=$?
  fi
  echo "rc=$rc; wall $((SECONDS - start)) s; $(date -u '+%F %T') UTC"
  exit "$rc"
} 2>&1 | tee -a "$log"
rc=${PIPESTATUS[0]}
if [ -n "${OUT:-}" ]; then
  tar -czf "$OUT/$section.tar.gz" -C "$results" --exclude='*.safetensors' --exclude='*.pt' \
      --exclude='tokenizer.json' --exclude='checkpoints' --exclude='best' "$folder"
  cp "$log" "$OUT/"
  ls -l "$OUT"
fi
exit "$rc"
