#!/usr/bin/env bash
# Everything issue 23 measures on a GPU: builds the seed's shapes with random weights and the built-in
# corpus, then by default (issue 23, item 5; about 10 minutes on one H100) runs the seed's table with
# the memory-budget method, the attention kernels' check and a short west-train with the real loader.
# --parts open runs every part, the open questions first (about an hour: give --budget). Tables, JSON and
# logs go to OUT (at most 8 files, for the device tool). This script holds the options, the environment,
# part build and the loop; the other parts are in tools/gpu_suite/{train,profile,bench}_parts.sh.
#
#   bash tools/gpu_suite.sh OUT [--parts build,bench,attention,train | open | a list of parts]
#        (parts run in the order given; a failed part is logged and the next one runs; `open`: every part
#        but big and encoder_graphs_full, in the order of open_parts below)
#   bash tools/gpu_suite.sh OUT --parts open --budget 530   # a device call: the open questions that fit
#   bash tools/gpu_suite.sh OUT --parts build,big,encoder_graphs_full   # Whisper-large-v3 + Qwen2-7B shapes with
#        LoRA, pack against Whisper padded to 30 s; the encoder replayed without the LLM's checkpointing
#        [--num_utts 700] [--memory_budget 24GiB] [--python python3] [--work_dir /tmp/west_gpu] [--device cuda]
#        [--budget SECONDS]   # skip a part whose H100 estimate would end past SECONDS (for a call's limit)
#        [--plan]             # print what the call would run by the estimates and --budget; run nothing
#
# On a machine without the data stack (the lent GPU machines), first run, where pip works:
#   bash tools/gpu_wheels.sh            # -> .whl/ (wheels + a word list), carried with the call
# and the suite installs them into /tmp/site. Tested on the CPU with tiny sizes
# (tests/test_tools_gpu_suite{,_bench}.py run `--device cpu --tiny`); docs/benchmarks.md says what ran where.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
[ $# -ge 1 ] && [ "${1#--}" = "$1" ] || { sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
out=$(mkdir -p "$1" && cd "$1" && pwd); shift
seed_parts=build,bench,attention,train   # issue 23, item 5: the seed's table, the kernels' check, a short west-train
open_parts=build,optimes_train,preloaded,gil,optimes,configured,best,pyspy_train,syncs_train,cuts,prefix,best_sizes,late_readback,encoder_time,encoder_graphs_compiled,contention,roofline,gap,loss,swiglu,lora,queues,pyspy,encoder_graphs_compiled_train,train,encoder_graphs_exact,compile,rotary,qkv,hostpy,compile_encoder,cudnn,kernels,profile_compiled,norm,graphs,encoder_graphs,marks,floor,ring,weights,profile,syncs,attention,ckpt,headroom,bench   # open questions first
parts=$seed_parts
num_utts=700
num_train=3200   # ~40 packs of 8,192 per epoch: 20- and 40-step runs cross no epoch's start (800 crossed at step 10)
memory_budget=24GiB
python=python3
work_dir=/tmp/west_gpu
device=cuda
tiny=false
plan=false
budget=0
steps=40
workers=4
prof_steps=3; prof_utts=300   # profiled steps per mode and the utterances they come from (profile, profile_compiled)
launcher=()                    # what profile_run runs its tool under (part pyspy: the sampling profiler)
while [ $# -gt 0 ]; do
  case $1 in
    --parts|--num_utts|--memory_budget|--python|--work_dir|--device|--steps|--num_train|--budget) declare "${1#--}=$2"; shift 2 ;;
    --tiny) tiny=true; shift ;;
    --plan) plan=true; shift ;;
    *) echo "gpu_suite.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
[ "$parts" = open ] && parts=$open_parts
has() { [[ ",$parts," == *",$1,"* ]]; }
declare -A estimate=([build]=50 [train]=40 [bench]=300 [profile]=65 [compile]=120 [ckpt]=50 [syncs]=50
                     [attention]=90 [headroom]=130 [big]=300 [big_bench]=200 [train_again]=40 [gap]=90 [profile_compiled]=120 [graphs]=150 [kernels]=75
                     [norm]=45 [cudnn]=90 [hostpy]=80 [contention]=90 [weights]=45 [rotary]=45 [qkv]=45 [cuts]=45 [marks]=110 [pyspy]=45 [compile_encoder]=90 [floor]=15 [queues]=90 [ring]=55 [encoder_graphs]=50 [encoder_graphs_full]=50 [encoder_graphs_exact]=65 [best]=45 [best_sizes]=150 [encoder_graphs_compiled]=75 [encoder_graphs_compiled_train]=110 [late_readback]=65 [encoder_time]=45 [loss]=40 [configured]=80 [swiglu]=120 [lora]=45 [roofline]=50 [pyspy_train]=60 [syncs_train]=45 [optimes_train]=120 [optimes]=60 [gil]=45 [prefix]=90 [preloaded]=40)   # seconds on one H100/H200: measured, or guessed for new parts
failed=(); skipped=(); fallback=
if $plan; then   # what a call would run by the estimates, as --budget decides it; nothing is run
  t=0
  IFS=, read -ra order <<<"$parts"
  for name in "${order[@]}"; do
    e=${estimate[$name]:-60}
    if [ "$budget" -gt 0 ] && [ "$e" -gt $(( budget - t )) ]; then echo "$name: about $e s, skipped ($(( budget - t )) s left)"
    else t=$(( t + e )); echo "$name: about $e s, ends at about $t s"; fi
  done
  echo "about $t s by the estimates$([ "$budget" -gt 0 ] && echo " (--budget $budget)")"
  exit 0
fi
part() {   # name: run part_<name> in a subshell; a failed part is logged and the next one runs
  has "$1" || return 0
  local t0; t0=$(date +%s)
  local left=$(( budget - (t0 - t_start) ))
  if [ "$budget" -gt 0 ] && [ "${estimate[$1]:-60}" -gt "$left" ]; then
    log "$1 skipped: about ${estimate[$1]:-60} s on an H100, ${left} s of --budget left"; skipped+=("$1"); return 0
  fi
  if [ -f "$work_dir/encoder_fallback" ] && [ -z "$fallback" ]; then   # build's encoder preflight failed
    fallback=1; common+=(--model.encoder.pos_enc relative)
  fi
  "$python" -m west.host_clock "$work_dir/machine_clock.json" 2>/dev/null || true
  if ( set -euo pipefail; "part_$1" ); then log "$1 ok ($(( $(date +%s) - t0 )) s)"
  else log "$1 FAILED (rc $?, $(( $(date +%s) - t0 )) s): see suite.log"; failed+=("$1"); fi
  # what the hypervisor (steal) and the cgroup (throttling) took from the machine during the part
  log "$1, the machine meanwhile: $("$python" -m west.host_clock --since "$work_dir/machine_clock.json" 2>&1)"
}
log() { echo "[gpu_suite $(date +%H:%M:%S)] $*" | tee -a "$out/suite.log"; }
replay_shape() {   # "ROWS SEGMENTS MAX_LEN" of the encoder's replay as west-train last printed it (or nothing)
  grep -o "blocks replay at [0-9,]* rows per pack in [0-9,]* segments of at most [0-9,]* frames" "$out/suite.log" \
    | tail -n 1 | tr -d ',' | awk '{print $4, $9, $14}' || true
}
t_start=$(date +%s)
mkdir -p "$work_dir"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

if ! "$python" -c "import kaldi_native_fbank, soundfile, soxr, kaldiio, editdistance" 2>/dev/null \
    && ls "$repo"/.whl/*.whl >/dev/null 2>&1; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$repo"/.whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH}
"$python" - <<'EOF' 2>&1 | tee -a "$out/suite.log"
import torch, transformers
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
print(f"[gpu_suite] torch {torch.__version__}, transformers {transformers.__version__}, GPU {gpu}")
if torch.cuda.is_available():
    free, total = torch.cuda.mem_get_info()
    p = torch.cuda.get_device_properties(0)
    print(f"[gpu_suite] {p.multi_processor_count} SMs, {total / 2**30:.1f} GiB ({free / 2**30:.1f} free), "
          f"capability {p.major}.{p.minor}, CPU cores {__import__('os').cpu_count()}")
from west.host_clock import MachineClock, MachineTimes, describe
clock = MachineClock()
print(f"[gpu_suite] since boot: {describe(clock.quota_cores, clock.read().since(MachineTimes(0, 0, 0)))}")
EOF

conf=$repo/recipes/aishell/conf/seed_gpu.yaml
data=$work_dir/data; exp=$work_dir/exp
llm=$exp/seed_llm
shape=qwen2-1.5b
pack=8192; batch=32; max_tokens=4096
if $tiny; then   # the CPU check of this script: same steps, toy sizes
  shape=bench-10m; pack=1024; batch=4; max_tokens=512; num_utts=12; num_train=60; steps=3; workers=1; prof_steps=1; prof_utts=6
  llm=$exp/seed_llm_tiny
  conf=$repo/recipes/aishell/conf/bench_llm_heavy.yaml
fi
# the parts' baseline keeps the encoder eager (seed_gpu.yaml's auto replays it on one GPU): a part that
# replays it says so and sets it
common=(--model.llm.path "$llm" --train.device "$device" --train.encoder_graphs false)
# the encoder as seed_gpu.yaml's train.encoder_graphs auto runs it on one GPU (tiny: the route the replay needs),
# at the rows of the largest planned pack (until the seventh run the suite set 12,288; the config's own 0 then
# meant 16,384): a pack of 8,192 LLM positions holds about 9,650 encoder rows of the built-in corpus
replayed=(--train.encoder_graphs true)
$tiny && replayed=(--train.encoder_graphs true --model.encoder.pos_enc wenet --model.encoder.attn_backend varlen)

part_build() {
  rm -f "$work_dir/encoder_fallback"
  log "build: corpus ($num_train train utterances), lists, CMVN, tokenizer, random $shape LLM"
  words=()
  [ -f "$repo/.whl/jieba_dict.txt" ] && words=(--synth_opts "--dict $repo/.whl/jieba_dict.txt")
  bash "$repo/recipes/aishell/run.sh" --work_dir "$work_dir" --python "$python" --stage 0 --stop_stage 4 \
    --synthetic true --num_train "$num_train" --num_dev 20 --num_test 20 --nj "$(nproc)" \
    --llm_pretrain_steps 0 "${words[@]}" >>"$out/suite.log" 2>&1
  [ -f "$llm/config.json" ] || "$python" "$repo/tools/make_seed_llm.py" "$llm" --tokenizer "$exp/tiny_llm" \
    --shape "$shape" --device "$device" >>"$out/suite.log" 2>&1
  # the config's Conformer on this device, one packed forward + backward on its own attention route:
  # if that fails (a route new since the last GPU run), later parts run pos_enc relative and say so
  if ! "$python" - "$conf" "$device" <<'EOF' 2>&1 | tee -a "$out/suite.log"; then
import sys, torch, yaml
from west.models.config import ConformerConfig
from west.models.conformer import ConformerEncoder
cfg = ConformerConfig.from_dict(yaml.safe_load(open(sys.argv[1]))["model"]["encoder"])
device = torch.device(sys.argv[2])
enc = ConformerEncoder(cfg).to(device).train()
lens = [100, 1400, 37, 640, 900]
feats = torch.randn(sum(lens), cfg.input_dim, device=device)
cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
with torch.autocast(device.type, dtype=torch.bfloat16):
    x, layout = enc.forward_flat(feats, cu_seqlens=cu)
x.float().square().mean().backward()
grads = [p.grad for p in enc.parameters() if p.grad is not None]
assert torch.isfinite(x).all() and grads and all(torch.isfinite(g).all() for g in grads)
print(f"[gpu_suite] encoder preflight: pos_enc {cfg.pos_enc}, packed attention {layout.attention}: ok")
EOF
    log "encoder preflight FAILED: the parts after build run --model.encoder.pos_enc relative"
    touch "$work_dir/encoder_fallback"
  fi
}
for parts_file in "$repo"/tools/gpu_suite/*_parts.sh; do   # the other parts, by what they run
  # shellcheck source=/dev/null
  source "$parts_file"
done

IFS=, read -ra order <<<"$parts"   # parts run in the order given
for name in "${order[@]}"; do
  declare -F "part_$name" >/dev/null || { log "unknown part $name"; failed+=("$name"); continue; }
  part "$name"
done
kernels=$(grep -ho "packed attention on .*\|torch varlen kernel on .*" "$out/suite.log" 2>/dev/null | sort -u || true)
[ -z "$kernels" ] || printf '\n### Attention kernels the runs chose (suite.log)\n\n%s\n' "$(sed 's/^/- /' <<<"$kernels")" >>"$out/suite.md"
{ [ -f "$out/benchmark.md" ] && cat "$out/benchmark.md"; } >>"$out/suite.md" 2>/dev/null || true
if [ "$(find "$out" -maxdepth 1 -type f | wc -l)" -gt 8 ]; then   # the device tool returns 8 files at most
  (cd "$out" && tar -cf json.tar ./*.json && rm -f ./*.json) && log "more than 8 files: the JSON files are in json.tar"
fi
log "done in $(( $(date +%s) - t_start )) s; tables: $out/suite.md${failed[*]:+; FAILED: ${failed[*]}}${skipped[*]:+; skipped: ${skipped[*]}}"
[ ${#failed[@]} -eq 0 ]
