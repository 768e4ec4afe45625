#!/usr/bin/env bash
# The measurements issues 41 and 42 still need, side by side on the four GPUs of one host, in one
# device call of under ten minutes (docs/dev-notes.md, "Where this round stopped").
#
#   bash benchmarks/gpu_open_issues.sh a|b OUT_DIR
#
# a: GPU 0 issue 42's llama-135m group (MHA, GQA, MHE-Mul, then MHA again on the warm caches);
#    GPU 1 and 2 issue 42's llama-1.1b MHA and MHE-Mul (about 5 minutes each on an H100, the final
#    evaluation included: two on one card would not fit); GPU 3 issue 41's compiled decode step
#    of llama-135m (MHA, GQA, MHE-Mul at batch 64 and 1 on one card, so its ratios are one run's).
# b: GPU 0 llama-1.1b GQA; GPU 1 gpt2-base MHA and MHE-Mul; GPU 2 llama-135m GQA and MHE-Mul over K/V
#    repeated (cuDNN). FSDP on four GPUs needs the host to itself: its own call,
#    `python benchmarks/fsdp_speed.py OUT --gpus 4` (the MHE-Mul pair first: --only).
# Each job writes under OUT_DIR/JOB and stops at DEADLINE seconds (default 560). Environment:
# MHE_DATA (default data-cache/data; WikiText-2 is read).
set -u
section=${1:?SECTION (a or b)}; out=${2:?OUT_DIR}; deadline=${DEADLINE:-560}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" MHE_DATA=${MHE_DATA:-data-cache/data}
[ -d "$MHE_DATA/wikitext-2" ] || { echo "no data folder at $MHE_DATA (set MHE_DATA)" >&2; exit 2; }
speed() {  # GPU, folder, stages
  mkdir -p "$out/$2"
  CUDA_VISIBLE_DEVICES=$1 timeout "$deadline" python benchmarks/llama_speed.py "$out/$2" --stages "$3" \
      --deadline $((deadline - 20)) > "$out/$2/console.log" 2>&1
}
case $section in
  a) speed 0 l135 llama-135m &
     speed 1 l1b-mha l1b-mha &
     speed 2 l1b-mhe-mul l1b-mhe-mul &
     mkdir -p "$out/floor"
     CUDA_VISIBLE_DEVICES=3 timeout "$deadline" python benchmarks/decode_floor.py --sections floor --mode compile \
         --presets llama-135m --kinds mha,gqa,mhe-mul --batches 64,1 --contexts 4096 --out "$out/floor" \
         --deadline $((deadline - 80)) > "$out/floor/console.log" 2>&1 & ;;
  b) speed 0 l1b-gqa l1b-gqa &
     speed 1 gpt2 gpt2 &
     speed 2 l135-expand llama-135m-expand & ;;
  *) echo "unknown section '$section': a or b" >&2; exit 2 ;;
esac
wait
tail -n 4 "$out"/*/console.log
