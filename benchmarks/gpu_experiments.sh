#!/usr/bin/env bash
# The one-GPU comparisons of docs/results (issue: reproduce the paper at one-GPU scale).
# Usage: bash benchmarks/gpu_experiments.sh SECTION OUT_DIR   (SECTION: lm | mt | encoder)
# Each section runs `mhe compare` (resumable) and packs every folder, without checkpoints,
# into OUT_DIR/SECTION.tar.gz. Several runs share the GPU at once (--workers).
set -u
section=$1; out=$2; data=${MHE_DATA:-data-cache}; w=${WORKERS:-4}
mkdir -p "$out"
deadline=${DEADLINE:-0}  # seconds after start; later compares are skipped or cut short
run() {
  local limit=${LIMIT:-560}
  if (( deadline > 0 )); then
    local left=$(( deadline - SECONDS )); (( left < 20 )) && { echo "skip (deadline): mhe $*"; return; }
    (( left < limit )) && limit=$left
  fi
  echo "+ mhe $*"; timeout "$limit" python -m mhe "$@"; echo "rc=$?"
}
case $section in
  lm)
    run compare --preset gpu-ptb --data-dir "$data" --workers "$w" --out results/lm-ptb
    run compare --preset gpu-wikitext-2 --data-dir "$data" --workers "$w" --out results/lm-wikitext-2 ;;
  mt)
    run compare --preset gpu-multi30k --data-dir "$data" --workers "$w" --out results/mt-multi30k ;;
  encoder)
    LIMIT=${MLM_LIMIT:-${LIMIT:-560}} run compare --preset gpu-mlm --data-dir "$data" --workers "$w" --out results/encoder-mlm
    for task in ${TASKS:-rte mrpc cola stsb cb copa sst2 wic}; do
      extra=(); [ "$task" = sst2 ] && extra=(--set train.epochs=1)
      run compare --task "$task" --pretrained results/encoder-mlm --seeds "${SEEDS:-2}" --data-dir "$data" \
        --workers "$w" --out "results/encoder-$task" --set train.epochs="${EPOCHS:-5}" --set train.patience=3 \
        --set train.lr=1e-4 "${extra[@]}"
    done ;;
esac
tar --exclude='checkpoints' --exclude='best' --exclude='tokenizer.json' --exclude='*.tmp*' \
    -czf "$out/$section.tar.gz" results/ 2>/dev/null
ls -la "$out"
