#!/usr/bin/env bash
# Dispatched operators per training step at the seed experiment's depth (a 12-block Conformer + a
# 28-layer Qwen2, tiny widths: conf/seed_depth_tiny.yaml), per batch mode, on this machine's device:
# the launch-count table of docs/benchmarks.md ("Dispatched operators per step"). From nothing:
#   1. the recipe's synthesized corpus and tokenizer (run.sh stages 0-4: 400 train utterances,
#      synthesis seed 0, no LLM pretraining), unless WORK already has them;
#   2. a random 28-layer 96-d Qwen2 (tools/make_seed_llm.py --shape seed-depth-tiny);
#   3. tools/count_ops.py on the same NUM_UTTS utterances in static 32 / dynamic 4096 / pack 8192 /
#      pack with the encoder padded -> WORK/exp/seed_depth_ops/ops.{md,json}.
# Counts depend on the code, torch and the device, not on the machine's speed (2-3 min on a 2-core CPU).
#
#   bash tools/seed_depth_ops.sh --work_dir /tmp/ops_work
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
work_dir=
python=$repo/.venv/bin/python
[ -x "$python" ] || python=python3
num_utts=200
threads=1
while [ $# -gt 0 ]; do
  case $1 in
    --work_dir|--python|--num_utts|--threads) declare "${1#--}=$2"; shift 2 ;;
    -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "seed_depth_ops.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
[ -n "$work_dir" ] || { echo "seed_depth_ops.sh: --work_dir DIR is required" >&2; exit 2; }
data=$work_dir/data; exp=$work_dir/exp
if [ ! -f "$data/train/data.list" ] || [ ! -f "$exp/tiny_llm/tokenizer.json" ]; then
  bash "$repo/recipes/aishell/run.sh" --work_dir "$work_dir" --python "$python" --stop_stage 4 \
    --num_train 400 --num_dev 20 --num_test 20 --llm_pretrain_steps 0
fi
llm=$exp/seed_depth_llm
[ -f "$llm/config.json" ] || "$python" "$repo/tools/make_seed_llm.py" "$llm" --tokenizer "$exp/tiny_llm" --shape seed-depth-tiny
PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" "$python" "$repo/tools/count_ops.py" \
  --config "$repo/recipes/aishell/conf/seed_depth_tiny.yaml" --model.llm.path "$llm" \
  --data.cmvn "$data/train/global_cmvn.json" --data "$data/train/data.list" --num_utts "$num_utts" \
  --out_dir "$exp/seed_depth_ops" --threads "$threads"
