#!/usr/bin/env bash
# The seed experiment's shapes on whatever machine this is: a 40M-class Conformer
# (conf/seed_gpu.yaml) + a Qwen2-1.5B-shaped LLM with random weights (tools/make_seed_llm.py,
# published config values, vocabulary 151,936, bf16), no download. Three parts, each printed:
#   1. west-benchmark in every batch mode: step time, peak memory, FLOPs;
#   2. west-train for a few steps in pack mode: a lean checkpoint at that size (its bytes vs the LLM's);
#   3. the same with --model.lora (conf/seed_gpu_lora.yaml): adapters in the checkpoint.
# On a CPU keep the sizes small (the defaults); on a GPU use the seed's (see docs/benchmarks.md).
# Not a test. Needs the recipe's data and tokenizer (run.sh stages 0-4) in WORK.
#
#   bash tools/seed_smoke.sh --work_dir /tmp/work                  # CPU smoke
#   bash tools/seed_smoke.sh --work_dir W --device cuda --batch_size 32 --max_tokens 4096 \
#       --pack_tokens 8192 --num_utts 1500 --repeats 2 --steps 20   # the real size on one GPU
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
work_dir=recipes/aishell
python=$repo/.venv/bin/python
[ -x "$python" ] || python=python3
device=cpu
shape=qwen2-1.5b
batch_size=2
max_tokens=512
pack_tokens=1024
num_utts=8
repeats=1
steps=2
threads=0
while [ $# -gt 0 ]; do
  case $1 in
    --work_dir|--python|--device|--shape|--batch_size|--max_tokens|--pack_tokens|--num_utts|--repeats|--steps|--threads)
      declare "${1#--}=$2"; shift 2 ;;
    -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "seed_smoke.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
data=$work_dir/data; exp=$work_dir/exp
[ -f "$data/train/data.list" ] || { echo "seed_smoke.sh: no $data/train/data.list: run recipes/aishell/run.sh --work_dir $work_dir --stop_stage 4 first" >&2; exit 1; }
llm=$exp/seed_llm_$shape
conf=$repo/recipes/aishell/conf
log() { echo "[seed_smoke $(date +%H:%M:%S)] $*"; }

[ -f "$llm/config.json" ] || "$python" "$repo/tools/make_seed_llm.py" "$llm" --tokenizer "$exp/tiny_llm" --shape "$shape"
common=(--model.llm.path "$llm" --train.device "$device" --data.num_workers 0 --data.pin_memory false)

log "1. benchmark: static $batch_size / dynamic $max_tokens / pack $pack_tokens on $num_utts utterances, $device"
"$python" -m west.bin.benchmark --config "$conf/seed_gpu.yaml" "${common[@]}" --data "$data/train/data.list" \
  --num_utts "$num_utts" --out_dir "$exp/seed_smoke/benchmark" --repeats "$repeats" --threads "$threads" \
  --batch_size "$batch_size" --max_tokens_in_batch "$max_tokens" --pack_tokens "$pack_tokens" --profile never

for variant in frozen_llm lora; do
  if [ $variant = lora ]; then cfg=$conf/seed_gpu_lora.yaml; else cfg=$conf/seed_gpu.yaml; fi
  out=$exp/seed_smoke/train_$variant
  rm -rf "$out"
  log "2. west-train $steps steps ($variant, pack $pack_tokens) -> $out"
  "$python" -m west.bin.train --config "$cfg" "${common[@]}" --train_data "$data/train/data.list" \
    --output_dir "$out" --batch_type pack --pack_tokens "$pack_tokens" --max_steps "$steps" \
    --train.save_every "$steps" --train.warmup_steps 1 --train.log_every 1 --train.tensorboard false \
    --train.progress_bar false --train.nvml false
  ckpt=$(ls -d "$out"/checkpoints/step_* | tail -1)
  log "checkpoint $ckpt: $(du -sh "$ckpt" | cut -f1) (the base LLM's safetensors: $(du -ch "$llm"/*.safetensors | tail -1 | cut -f1))"
  ls -l "$ckpt"
done
log "done: $exp/seed_smoke/benchmark/benchmark.md, $exp/seed_smoke/train_*/"
