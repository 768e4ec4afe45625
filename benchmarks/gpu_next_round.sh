#!/usr/bin/env bash
# The next GPU session's runs for issues 40, 41 and 42 after the `next-round` changes, on one
# 4-GPU host in two device calls of under ten minutes (docs/dev-notes.md, "Where this round stopped").
#
#   bash benchmarks/gpu_next_round.sh a|b OUT_DIR
#
# a: GPU 0: every GPU test (one GPU), then decoding against the previous release (OLD_SRC, default
#    gpu/old-src) at 1 x 512 with kernel counts; GPUs 1-2: every GPU test (two GPUs), then GPU 1
#    profiles llama-1.1b's compiled decode step at 64 x 4,096 (issue 41's missing profile) and GPU 2
#    profiles gpt2-base's training step (issue 42's 480,000 tokens/s); GPU 3: llama-135m MHA, GQA,
#    MHE-Mul and the warm run, one card (issue 42's ratios under the new training kernel rule).
# b: FSDP against DDP on four GPUs, the MHE-Mul pair first, 30 steps.
# Needs MHE_DATA (default data-cache/data) with wikitext-2. Writes OUT_DIR/env.txt (with the src
# files' sha256 for benchmarks/gpu_tests_record.py) and OUT_DIR/JOB/ per job.
set -u
section=${1:?SECTION (a or b)}; out=${2:?OUT_DIR}; old=${OLD_SRC:-gpu/old-src}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src" MHE_DATA=${MHE_DATA:-data-cache/data}
mkdir -p "$out"; t0=$SECONDS; left() { echo $((565 - (SECONDS - t0))); }
suite() {  # devices, name
  echo "+ CUDA_VISIBLE_DEVICES=$1 python -m pytest -m gpu -o addopts=\"\" -q -rs -p no:cacheprovider" > "$out/gpu-tests-$2.log"
  CUDA_VISIBLE_DEVICES=$1 timeout 420 python -m pytest -m gpu -o addopts="" -q -rs -p no:cacheprovider \
      --basetemp="/tmp/pt-$2" >> "$out/gpu-tests-$2.log" 2>&1
  echo "exit $? after $((SECONDS - t0)) s" >> "$out/gpu-tests-$2.log"
}
case $section in
  a) python -c "import torch,sys;print('torch',torch.__version__,'cards',torch.cuda.device_count(),'x',torch.cuda.get_device_name(0))" > "$out/env.txt"
     echo "src sha256 (sorted .py files): $(find src -type f -name '*.py' | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-64)" >> "$out/env.txt"
     mkdir -p "$out/l135"
     (CUDA_VISIBLE_DEVICES=3 timeout 560 python benchmarks/llama_speed.py "$out/l135" --stages llama-135m --deadline 540 \
         > "$out/l135/console.log" 2>&1) &
     (suite 0 1gpu; CUDA_VISIBLE_DEVICES=0 timeout "$(left)" python benchmarks/decode_speed.py "$out/decode-vs-old" \
         --old-src "$old" --settings 1x512 --modes "" --sections table,kernels > "$out/decode-vs-old.log" 2>&1) &
     suite 1,2 2gpu
     (CUDA_VISIBLE_DEVICES=1 timeout "$(left)" python benchmarks/profile_decode.py --preset llama-1.1b \
         --kinds mha,gqa,mhe-mul --modes compile --batch 64 --context 4352 --prompt 4096 --top 14 \
         --json "$out/profile-l1b-b64.json" > "$out/profile-l1b.log" 2>&1) &
     (CUDA_VISIBLE_DEVICES=2 timeout "$(left)" python benchmarks/profile_train_step.py "$out/profile-gpt2" \
         --presets gpt2-base --kinds mha,mhe-mul --no-dropout-kinds "" --deadline $(($(left) - 30)) \
         > "$out/profile-gpt2.log" 2>&1) &
     wait ;;
  b) timeout 560 python benchmarks/fsdp_speed.py "$out/fsdp" --gpus 4 --steps 30 --deadline 540 \
         --only base-mhe-mul-ddp,base-mhe-mul-fsdp > "$out/fsdp.log" 2>&1 ;;
  *) echo "unknown section '$section': a or b" >&2; exit 2 ;;
esac
echo "wall $((SECONDS - t0)) s"
