#!/usr/bin/env bash
# The one-GPU comparisons kept in results/ (see results/README.md for what each one ran).
#
#   bash benchmarks/studies/paper.sh SECTION OUT_DIR
#
# OUT_DIR receives one comparison folder per experiment (OUT_DIR/lm-ptb, OUT_DIR/encoder-rte, ...),
# as results/ holds them; `mhe report OUT_DIR/lm-ptb` rebuilds its tables.
#
# SECTION: lm        PTB and WikiText-2 language modelling (gpu-ptb, gpu-wikitext-2), 3 seeds
#          mt        Multi30k translation (gpu-multi30k), $MT_SEEDS seeds (default 3)
#          encoder   MLM pre-training (gpu-mlm), then the `finetune` section from it
#          finetune  GLUE / SuperGLUE fine-tuning from OUT_DIR/encoder-mlm, $SEEDS seeds (default 3)
#
# Every step is `mhe compare --resume`, so a section can be run again to finish what a deadline
# cut short: finished runs are reported, unfinished ones resume. OUT_DIR/SECTION.done marks the end.
#
# Environment: MHE_DATA (default data-cache), WORKERS (runs sharing the GPU, default 7),
# DEADLINE (seconds after the start; later steps are cut short, 0 = none), STREAMS (fine-tuning
# task lists run side by side; default below), FT_WORKERS (runs at a time per stream, default 6),
# EPOCHS (fine-tuning epochs, default 5; SST-2 takes 1), KINDS (fine-tuning: a subset of kinds).
set -u
export PYTHONUNBUFFERED=1
section=$1; out=$2; data=${MHE_DATA:-data-cache}; w=${WORKERS:-7}; deadline=${DEADLINE:-0}
mkdir -p "$out"

run() {  # mhe ARGS..., stopped at the deadline (SIGTERM: the runs save a checkpoint and can resume)
  local limit=86400
  if (( deadline > 0 )); then
    limit=$(( deadline - SECONDS ))
    (( limit < 30 )) && { echo "skip (deadline): mhe $*"; return; }
  fi
  echo "+ mhe $*  [$(date +%T), ${limit}s left]"
  timeout "$limit" python -m mhe "$@" --resume
  echo "rc=$? [$(date +%T)]"
}

finetune() {  # TASK: fine-tune every kind's MLM checkpoint on one GLUE / SuperGLUE task
  local task=$1 epochs=${EPOCHS:-5}
  [ "$task" = sst2 ] && epochs=1  # 67k training examples: one epoch is 2,100 steps
  run compare --task "$task" --pretrained "$out/encoder-mlm" --seeds "${SEEDS:-3}" --data-dir "$data" \
    --workers "${FT_WORKERS:-6}" ${KINDS:+--kinds "$KINDS"} --out "$out/encoder-$task" --set train.epochs="$epochs" --set train.patience=3 \
    --set train.lr=1e-4 --set train.save_every=0 --set train.keep_checkpoints=false
}

finetune_all() {  # the streams run side by side; the tasks of one stream one after another
  local stream
  for stream in ${STREAMS:-sst2,mrpc,rte,cb,copa cola,stsb,wic}; do
    ( for task in ${stream//,/ }; do finetune "$task"; done ) &
  done
  wait
}

case $section in
  lm)
    run compare --preset gpu-ptb --data-dir "$data" --workers "$w" --out "$out/lm-ptb" \
      --set train.keep_checkpoints=false
    run compare --preset gpu-wikitext-2 --data-dir "$data" --workers "$w" --out "$out/lm-wikitext-2" \
      --set train.keep_checkpoints=false ;;
  mt)
    run compare --preset gpu-multi30k --seeds "${MT_SEEDS:-3}" --data-dir "$data" --workers "$w" \
      --out "$out/mt-multi30k" --set train.keep_checkpoints=false ;;
  encoder)
    run compare --preset gpu-mlm --data-dir "$data" --workers "$w" --out "$out/encoder-mlm"
    finetune_all ;;
  finetune)
    finetune_all ;;
  *)
    echo "unknown section '$section'; valid: lm, mt, encoder, finetune" >&2; exit 2 ;;
esac

echo "finished runs per folder:"
for d in "$out"/*/; do printf '  %-28s %s\n' "$d" "$(ls "$d"runs/*/results.json 2>/dev/null | wc -l)"; done
touch "$out/$section.done"
