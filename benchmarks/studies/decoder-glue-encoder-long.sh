#!/usr/bin/env bash
# The third round of comparisons, on one machine with several GPUs (results/README.md, "Round three").
#
#   bash benchmarks/studies/decoder-glue-encoder-long.sh SECTION OUT_DIR
#
# OUT_DIR receives the comparison folders (OUT_DIR/decoder-lm, OUT_DIR/decoder-rte, ...) and the log
# (OUT_DIR/logs/round3-SECTION.log).
#
# SECTION: decoder-glue  Table 2's GLUE column: the GPT-2-shaped decoder pre-trained with causal LM on
#                        offline-english (gpu-lm-glue -> OUT_DIR/decoder-lm), then fine-tuned on RTE,
#                        SST-2, MRPC, CoLA, STS-B (OUT_DIR/decoder-TASK, beside the paper's table2-TASK)
#          encoder-long  the encoder pre-trained 2.5 times longer on offline-english (gpu-mlm-long ->
#                        OUT_DIR/encoder-long-mlm), then RTE, SST-2, MRPC, CoLA, STS-B, CB, COPA, WiC
#                        (OUT_DIR/encoder-long-TASK, beside the paper's table1-TASK)
#          all           both side by side (the encoder's runs placed on the GPUs in reverse order, so
#                        the cards the decoder leaves lighter take more of the encoder's)
#
# Fine-tuning: $SEEDS seeds (default 3), 5 epochs (SST-2: 1), patience 3, lr 1e-4, no checkpoints
# kept, as in results/encoder-*. Every step is `mhe compare --resume`, which places its runs
# round-robin on the visible GPUs, reports finished runs and resumes unfinished ones, so a section
# can be run again to finish what a deadline cut short. OUT_DIR/SECTION.done marks a section's end.
#
# Data: offline-english reads the whole data folder (17 MiB: ptb, wikitext-2, multi30k, wmt14, squad,
# glue, superglue), not only the parts round one needed; the script checks it before starting.
# Environment: MHE_DATA (default data-cache), KINDS (default the paper's seven), SEEDS,
# PRE_WORKERS (pre-training runs at a time, default 8: all seven at once), FT_WORKERS (fine-tuning
# runs at a time per stream, default 8; two streams side by side), DEADLINE (seconds after the
# start; later steps are skipped, running ones stopped; 0 = none), SET (extra KEY=VALUE settings
# for every comparison, for a quick check: SET="train.steps=6 train.batch_size=4
# data.limit_lines=300"), FT_SET (the same, fine-tuning only), DEC_STREAMS / ENC_STREAMS (the
# fine-tuning streams, tasks of a stream in turn: default "rte,mrpc,sst2 cola,stsb" and
# "rte,mrpc,cb,copa cola,stsb,wic,sst2", so a deadline cuts the tasks that matter least).
set -u
export PYTHONUNBUFFERED=1
section=${1:?SECTION}; out=${2:?OUT_DIR}; data=${MHE_DATA:-data-cache}; deadline=${DEADLINE:-0}
kinds=${KINDS:-sha,mha,el-att,mqa,skv,mhe-add,mhe-mul}; seeds=${SEEDS:-3}
mkdir -p "$out/logs"
exec > >(tee -a "$out/logs/round3-$section.log") 2>&1

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

pretrain() {  # PRESET OUT: every kind at once, placed round-robin on the GPUs
  run compare --preset "$1" --kinds "$kinds" --data-dir "$data" --workers "${PRE_WORKERS:-8}" --out "$2"
}

finetune() {  # PRETRAINED PREFIX TASK: fine-tune every kind's pre-training run on one task
  local task=$3 epochs=5 item ft=()
  [ "$task" = sst2 ] && epochs=1  # 67k training examples: one epoch is 2,100 steps
  for item in ${FT_SET:-}; do ft+=(--set "$item"); done
  run compare --task "$task" --pretrained "$1" --kinds "$kinds" --seeds "$seeds" --data-dir "$data" \
    --workers "${FT_WORKERS:-8}" --out "$out/$2-$task" --set train.epochs="$epochs" --set train.patience=3 \
    --set train.lr=1e-4 --set train.save_every=0 --set train.keep_checkpoints=false "${ft[@]}"
}

streams() {  # PRETRAINED PREFIX STREAM...: the streams side by side, the tasks of one in turn
  local pre=$1 prefix=$2 stream pids=()
  shift 2
  for stream in "$@"; do
    ( for task in ${stream//,/ }; do finetune "$pre" "$prefix" "$task"; done ) &
    pids+=($!)
  done
  wait "${pids[@]}"  # these only: a bare wait would also wait for the log's tee
}

decoder_glue() {
  pretrain gpu-lm-glue "$out/decoder-lm"
  streams "$out/decoder-lm" decoder ${DEC_STREAMS:-rte,mrpc,sst2 cola,stsb}
}

encoder_long() {
  pretrain gpu-mlm-long "$out/encoder-long-mlm"
  streams "$out/encoder-long-mlm" encoder-long ${ENC_STREAMS:-rte,mrpc,cb,copa cola,stsb,wic,sst2}
}

reversed_gpus() {  # the visible GPUs, last first ("" without GPUs)
  local ids
  ids=${CUDA_VISIBLE_DEVICES:-$(python -c 'import torch; print(",".join(map(str, range(torch.cuda.device_count()))))')}
  tr ',' '\n' <<<"$ids" | grep -v '^$' | tac | paste -sd, -
}

corpus_check() {  # every offline-english file readable (a missing one would fail each run), counts logged
  python - "$data" <<'PY' || { echo "offline-english cannot be read from $data (it needs the whole data folder)"; exit 2; }
import json, sys
from mhe.data.offline_english import source_counts
from mhe.errors import MheError
try:
    print("offline-english:", json.dumps(source_counts(sys.argv[1])))
except MheError as e:
    sys.exit(f"error: {e}")
PY
}

case $section in
  decoder-glue|encoder-long|all) corpus_check ;;
  *) echo "unknown section '$section'; valid: decoder-glue, encoder-long, all" >&2; exit 2 ;;
esac
case $section in
  decoder-glue) decoder_glue ;;
  encoder-long) encoder_long ;;
  all)
    decoder_glue &
    first=$!
    gpus=$(reversed_gpus)
    ( [ -n "$gpus" ] && export CUDA_VISIBLE_DEVICES=$gpus; encoder_long ) &
    wait "$first" $! ;;
esac

touch "$out/$section.done"
