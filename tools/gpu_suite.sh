#!/usr/bin/env bash
# The GPU measurements behind west's GPU claims and its seed_gpu*.yaml choices, as one script: builds the
# seed's shapes with random weights and the built-in corpus, then runs the parts asked for. Tables, JSON and
# logs go to OUT (the JSON files are bundled into json.tar when OUT would hold more than 8 files).
#
#   bash tools/gpu_suite.sh OUT [--parts seed | all | a list of parts]   (parts run in the order given;
#        a failed part is logged and the next one runs)
#     seed (default): build,bench,attention,train   the seed's table under a memory budget, the attention
#        kernels against float64, west-train as seed_gpu.yaml configures it (about 10 minutes on one H200)
#     all: build and every part below that fits --budget, in the order of all_parts
#        [--num_utts 700] [--memory_budget 24GiB] [--python python3] [--work_dir /tmp/west_gpu] [--device cuda]
#        [--budget SECONDS]   # skip a part whose estimate would end past SECONDS (a time-limited machine)
#        [--plan]             # print what the call would run by the estimates and --budget; run nothing
#
# Parts: build, bench, attention, train, train_again (the run-to-run spread), configured (west-train against the
# benchmark on the same configuration), host_wait (where west-train's host waits: syncs and per-operator host time
# with and without the loader), encoder_graphs, encoder_graphs_exact, late_readback, ckpt, norm, compile
# (each the A/B run behind a key the configs set), lora, prefix, best (MFU at the fastest configuration), big
# (Whisper-large-v3 + Qwen2-7B LoRA: west-train at pack 8192, then big_bench), big_bench (pack against Whisper
# padded to 30 s, timed), qwen2_audio (Qwen2-Audio-7B's shape: its tower packed against padded to 30 s,
# timed), qwen3_asr and qwen2_5_omni (Qwen3-ASR-1.7B's and Qwen2.5-Omni-7B's shapes: pack against static
# and dynamic batches, timed). On a machine without west's data stack, first run `bash tools/gpu_wheels.sh`
# where pip works (wheels into .whl/, installed into /tmp/site). Tested on the CPU with toy sizes (--tiny --device cpu).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
[ $# -ge 1 ] && [ "${1#--}" = "$1" ] || { sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
out=$(mkdir -p "$1" && cd "$1" && pwd); shift
seed_parts=build,bench,attention,train
all_parts=build,bench,attention,train,configured,encoder_graphs,late_readback,ckpt,norm,best,big_bench,encoder_graphs_exact,lora,prefix,compile,train_again,host_wait,qwen2_audio,qwen3_asr,qwen2_5_omni
parts=seed
num_utts=700
num_train=3200   # ~40 packs of 8,192 per epoch: 20- and 40-step runs cross no epoch's start
memory_budget=24GiB
python=python3
work_dir=/tmp/west_gpu
device=cuda
tiny=false
plan=false
budget=0
steps=40
workers=6   # as seed_gpu.yaml: a pack costs a worker about 0.9 s on the H200 machines
while [ $# -gt 0 ]; do
  case $1 in
    --parts|--num_utts|--memory_budget|--python|--work_dir|--device|--steps|--num_train|--budget) declare "${1#--}=$2"; shift 2 ;;
    --tiny) tiny=true; shift ;;
    --plan) plan=true; shift ;;
    *) echo "gpu_suite.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
case $parts in seed) parts=$seed_parts ;; all) parts=$all_parts ;; esac
# seconds on one H200 (measured 2026-12-04, or on earlier runs of the same part; big, qwen3_asr and
# qwen2_5_omni and host_wait by estimate)
declare -A estimate=([build]=50 [bench]=200 [attention]=90 [train]=40 [train_again]=40 [configured]=80
                     [encoder_graphs]=45 [encoder_graphs_exact]=65 [late_readback]=65 [ckpt]=45 [norm]=45
                     [compile]=120 [lora]=45 [prefix]=90 [best]=45 [big]=300 [big_bench]=200
                     [host_wait]=190 [qwen2_audio]=240 [qwen3_asr]=150 [qwen2_5_omni]=300)
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
  local t0; t0=$(date +%s)
  local left=$(( budget - (t0 - t_start) ))
  if [ "$budget" -gt 0 ] && [ "${estimate[$1]:-60}" -gt "$left" ]; then
    log "$1 skipped: about ${estimate[$1]:-60} s by its estimate, ${left} s of --budget left"; skipped+=("$1"); return 0
  fi
  if [ -f "$work_dir/encoder_fallback" ] && [ -z "$fallback" ]; then   # build's encoder preflight failed
    fallback=1; common+=(--model.encoder.pos_enc relative)
  fi
  if ( set -euo pipefail; "part_$1" ); then log "$1 ok ($(( $(date +%s) - t0 )) s)"
  else log "$1 FAILED (rc $?, $(( $(date +%s) - t0 )) s): see suite.log"; failed+=("$1"); fi
}
log() { echo "[gpu_suite $(date +%H:%M:%S)] $*" | tee -a "$out/suite.log"; }
replay_shape() {   # "ROWS SEGMENTS MAX_LEN" of the encoder's replay as west-train last printed it (or nothing)
  grep -o "blocks replay at [0-9,]* rows per pack in [0-9,]* segments of at most [0-9,]* frames" "$out/suite.log" \
    | tail -n 1 | tr -d ',' | awk '{print $4, $9, $14}' || true
}
t_start=$(date +%s)
mkdir -p "$work_dir"
touch "$out/suite.md"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

if ! "$python" -c "import kaldi_native_fbank, soundfile, soxr, kaldiio, editdistance" 2>/dev/null \
    && ls "$repo"/.whl/*.whl >/dev/null 2>&1; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$repo"/.whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH}
"$python" - <<'EOF2' 2>&1 | tee -a "$out/suite.log"
import os, torch, transformers
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
print(f"[gpu_suite] torch {torch.__version__}, transformers {transformers.__version__}, GPU {gpu}, "
      f"{os.cpu_count()} CPU cores")
if torch.cuda.is_available():
    free, total = torch.cuda.mem_get_info()
    p = torch.cuda.get_device_properties(0)
    print(f"[gpu_suite] {p.multi_processor_count} SMs, {total / 2**30:.1f} GiB ({free / 2**30:.1f} free), "
          f"capability {p.major}.{p.minor}")
EOF2

conf=$repo/recipes/aishell/conf/seed_gpu.yaml
data=$work_dir/data; exp=$work_dir/exp
llm=$exp/seed_llm
shape=qwen2-1.5b
pack=8192; batch=32; max_tokens=4096
if $tiny; then   # the CPU check of this script: same steps, toy sizes
  shape=bench-10m; pack=1024; batch=4; max_tokens=512; num_utts=12; num_train=60; steps=3; workers=1
  llm=$exp/seed_llm_tiny
  conf=$repo/recipes/aishell/conf/bench_llm_heavy.yaml
fi
common=(--model.llm.path "$llm" --train.device "$device")
# the encoder's blocks replayed as seed_gpu.yaml's train.encoder_graphs auto runs them on one GPU (tiny: the
# attention route the replay needs, on the CPU eager with its rows padded to the replayed shape)
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
if [ "$(find "$out" -maxdepth 1 -type f | wc -l)" -gt 8 ]; then   # keep OUT to at most 8 files
  (cd "$out" && tar -cf json.tar ./*.json && rm -f ./*.json) && log "more than 8 files: the JSON files are in json.tar"
fi
log "done in $(( $(date +%s) - t_start )) s; tables: $out/suite.md${failed[*]:+; FAILED: ${failed[*]}}${skipped[*]:+; skipped: ${skipped[*]}}"
[ ${#failed[@]} -eq 0 ]
