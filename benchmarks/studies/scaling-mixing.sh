#!/usr/bin/env bash
# The second round of one-GPU comparisons (results/README.md, "Round two").
#
#   bash benchmarks/studies/scaling-mixing.sh SECTION OUT_DIR
#
# OUT_DIR receives the comparison folders (OUT_DIR/scale-ptb-small, OUT_DIR/encoder-rte, ...) and
# the logs (OUT_DIR/logs); `mixing` adds two kinds to the encoder comparisons already in OUT_DIR
# (those of benchmarks/studies/paper.sh encoder OUT_DIR).
#
# SECTION: scaling   Appendix D on one GPU: decoders of three sizes (gpu-scale-{ptb,wikitext-2}-
#                    {small,medium,large}) trained to convergence, kinds $KINDS (default mha,mhe-mul),
#                    $SEEDS seeds (default 3); two streams of comparisons side by side, PTB first
#          mixing    Appendix A's FNet and Linear encoders added to OUT_DIR/encoder-*: MLM pre-training
#                    (gpu-mlm), then the same GLUE / SuperGLUE fine-tuning, $SEEDS seeds (the seven
#                    kinds there are finished and reported)
#
# Every step is `mhe compare --resume`, so a section can be run again to finish what a deadline
# cut short. OUT_DIR/SECTION.done marks the end.
#
# Environment: MHE_DATA (default data-cache), KINDS, SEEDS, FT_WORKERS (fine-tuning runs at a
# time per stream, default 6), DEADLINE (seconds after the start; later steps are skipped, running
# ones stopped; 0 = none), SET (extra KEY=VALUE settings for every comparison, for a quick check:
# SET="train.steps=20 train.batch_size=4 data.limit_lines=500").
set -u
export PYTHONUNBUFFERED=1
section=$1; out=$2; data=${MHE_DATA:-data-cache}; deadline=${DEADLINE:-0}
kinds=${KINDS:-mha,mhe-mul}; seeds=${SEEDS:-3}
mkdir -p "$out/logs"

run() {  # mhe ARGS..., stopped at the deadline (SIGTERM: the runs save what they can)
  local limit=86400
  if (( deadline > 0 )); then
    limit=$(( deadline - SECONDS ))
    (( limit < 30 )) && { echo "skip (deadline): mhe $*"; return; }
  fi
  local extra=() item
  for item in ${SET:-}; do extra+=(--set "$item"); done
  echo "+ mhe $* ${extra[*]}  [$(date +%T), ${limit}s left]"
  timeout "$limit" python -m mhe "$@" --resume "${extra[@]}"
  echo "rc=$? [$(date +%T)]"
}

scale() {  # DATA SIZE: one size on one corpus, every (kind, seed) at once, beside the paper's GPT-2 base
  local n_kinds paper=tableD-ptb-decoder-base
  n_kinds=$(tr ',' '\n' <<<"$kinds" | wc -l)
  [ "$1" = ptb ] || paper=tableD-wikitext-103-decoder-base
  run compare --preset "gpu-scale-$1-$2" --kinds "$kinds" --seeds "$seeds" --data-dir "$data" \
    --workers $(( n_kinds * seeds )) --paper "$paper" --out "$out/scale-$1-$2"
}

ENCODER_KINDS=${ENCODER_KINDS:-sha,mha,el-att,mqa,skv,mhe-add,mhe-mul,fnet,linear}  # encoder-*: seven, FNet, Linear

finetune() {  # TASK: fine-tune the kinds of OUT_DIR/encoder-mlm without a finished run (FNet, Linear)
  local task=$1 epochs=5
  [ "$task" = sst2 ] && epochs=1  # 67k training examples: one epoch is 2,100 steps
  run compare --task "$task" --pretrained "$out/encoder-mlm" --kinds "$ENCODER_KINDS" --seeds "$seeds" \
    --data-dir "$data" --workers "${FT_WORKERS:-6}" --out "$out/encoder-$task" --set train.epochs="$epochs" \
    --set train.patience=3 --set train.lr=1e-4 --set train.save_every=0 --set train.keep_checkpoints=false
}

case $section in
  scaling)  # stream lengths balanced by the measured cost of a 768-wide step (docs/dev-notes.md)
    ( scale ptb large; scale wikitext-2 medium; scale wikitext-2 small ) &
    ( scale ptb small; scale ptb medium; scale wikitext-2 large ) &
    wait ;;
  mixing)
    run compare --preset gpu-mlm --kinds "$ENCODER_KINDS" --data-dir "$data" --workers 2 --out "$out/encoder-mlm"
    for stream in sst2,mrpc,rte,cb,copa cola,stsb,wic; do
      ( for task in ${stream//,/ }; do finetune "$task"; done ) &
    done
    wait ;;
  *)
    echo "unknown section '$section'; valid: scaling, mixing" >&2; exit 2 ;;
esac

touch "$out/$section.done"
