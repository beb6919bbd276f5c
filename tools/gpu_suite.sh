#!/usr/bin/env bash
# Everything issue 23 measures on a GPU, in one call: builds the seed's shapes with random weights
# and the built-in corpus, trains a few steps with the real loader, profiles where the GPU waits
# for the host, runs the batch-mode benchmark with the seed's memory-budget method, counts host
# syncs, trains with train.compile and checks the attention kernels. Tables, JSON and logs go to
# OUT (at most 8 files, for the device tool).
#
#   bash tools/gpu_suite.sh OUT [--parts build,encoder_graphs_exact,gap,best,encoder_graphs_compiled,train,contention,compile,pyspy,queues,rotary,hostpy,
#        compile_encoder,cudnn,kernels,profile_compiled,norm,graphs,encoder_graphs,marks,floor,ring,weights,profile,syncs,attention,
#        ckpt,headroom,bench] [--num_utts 700]
#        (parts run in the order given; a failed part is logged and the next one runs)
#   bash tools/gpu_suite.sh OUT --parts build,big,encoder_graphs_full   # a second call: Whisper-large-v3 + Qwen2-7B
#        shapes with LoRA, pack against Whisper padded to 30 s; the encoder replayed without the LLM's checkpointing
#        [--memory_budget 24GiB] [--python python3] [--work_dir /tmp/west_gpu] [--device cuda]
#        [--budget SECONDS]   # skip a part whose H100 estimate would end past SECONDS (for a call's limit)
#
# On a machine without the data stack (the lent GPU machines), first run, where pip works:
#   bash tools/gpu_wheels.sh            # -> .whl/ (wheels + a word list), carried with the call
# and the suite installs them into /tmp/site. Tested on the CPU with tiny sizes
# (tests/test_tools_gpu_suite.py runs `--device cpu --tiny`); docs/benchmarks.md says what ran where.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
[ $# -ge 1 ] && [ "${1#--}" = "$1" ] || { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
out=$(mkdir -p "$1" && cd "$1" && pwd); shift
parts=build,encoder_graphs_exact,gap,best,encoder_graphs_compiled,train,contention,compile,pyspy,queues,rotary,hostpy,compile_encoder,cudnn,kernels,profile_compiled,norm,graphs,encoder_graphs,marks,floor,ring,weights,profile,syncs,attention,ckpt,headroom,bench   # open questions first
num_utts=700
num_train=800
memory_budget=24GiB
python=python3
work_dir=/tmp/west_gpu
device=cuda
tiny=false
budget=0
steps=40
workers=4
prof_steps=3; prof_utts=300   # profiled steps per mode and the utterances they come from (profile, profile_compiled)
launcher=()                    # what profile_run runs its tool under (part pyspy: the sampling profiler)
while [ $# -gt 0 ]; do
  case $1 in
    --parts|--num_utts|--memory_budget|--python|--work_dir|--device|--steps|--num_train|--budget) declare "${1#--}=$2"; shift 2 ;;
    --tiny) tiny=true; shift ;;
    *) echo "gpu_suite.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
has() { [[ ",$parts," == *",$1,"* ]]; }
declare -A estimate=([build]=60 [train]=40 [bench]=430 [profile]=65 [compile]=120 [ckpt]=50 [syncs]=50
                     [attention]=90 [headroom]=130 [big]=300 [gap]=75 [profile_compiled]=120 [graphs]=150 [kernels]=75
                     [norm]=45 [cudnn]=90 [hostpy]=80 [contention]=90 [weights]=45 [rotary]=45 [marks]=110 [pyspy]=70 [compile_encoder]=90 [floor]=20 [queues]=70 [ring]=55 [encoder_graphs]=50 [encoder_graphs_full]=50 [encoder_graphs_exact]=70 [best]=90 [encoder_graphs_compiled]=110)   # seconds on one H100/H200: measured, or guessed for new parts
failed=(); skipped=(); fallback=
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
  if ( set -euo pipefail; "part_$1" ); then log "$1 ok ($(( $(date +%s) - t0 )) s)"
  else log "$1 FAILED (rc $?, $(( $(date +%s) - t0 )) s): see suite.log"; failed+=("$1"); fi
}
log() { echo "[gpu_suite $(date +%H:%M:%S)] $*" | tee -a "$out/suite.log"; }
t_start=$(date +%s)
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
common=(--model.llm.path "$llm" --train.device "$device")

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

part_attention() {
  log "attention: packed LLM kernels and the Conformer's (flex vs segment SDPA) against float64"
  dtype=bfloat16; [ "$device" = cpu ] && dtype=float32
  sizes=(); esizes=()
  $tiny && sizes=(--check_tokens 512 --time_tokens 1024 --repeats 3) && esizes=(--check_rows 400 --time_rows 1000 --repeats 3)
  "$python" "$repo/tools/check_attention_cuda.py" --device "$device" --dtype "$dtype" --out "$out/attention.json" "${sizes[@]}" \
    2>&1 | tee -a "$out/suite.log" | tail -8
  "$python" "$repo/tools/check_encoder_attention.py" --device "$device" --dtype "$dtype" "${esizes[@]}" \
    --out "$out/encoder_attention.json" 2>&1 | tee -a "$out/suite.log" | tail -9
}

part_bench() {
  log "bench: west-benchmark, each mode at its largest size under $memory_budget, $num_utts utterances"
  budget=(--memory_budget "$memory_budget" --repeats 2)
  $tiny && budget=(--memory_budget 2GiB --repeats 1)
  "$python" -m west.bin.benchmark --config "$conf" "${common[@]}" --data "$data/train/data.list" \
    --data.cmvn "$data/train/global_cmvn.json" --num_utts "$num_utts" --out_dir "$exp/bench" \
    --batch_size "$batch" --max_tokens_in_batch "$max_tokens" --pack_tokens "$pack" --profile never \
    "${budget[@]}" >>"$out/suite.log" 2>&1
  cp "$exp/bench/benchmark.json" "$out/benchmark.json"
  cp "$exp/bench/benchmark.md" "$out/benchmark.md"
  tail -n 40 "$out/benchmark.md"
}

train_run() {   # name, extra args... (rows packed to $pack tokens, unless $batching gives other batching flags;
                #   run under ${launcher[@]} when set)
  local name=$1 sizing=(--batch_type pack --pack_tokens "$pack"); shift
  [ -z "${batching:-}" ] || read -ra sizing <<<"$batching"
  rm -rf "$exp/$name"
  ${launcher[@]+"${launcher[@]}"} "$python" -m west.bin.train --config "$conf" "${common[@]}" --train_data "$data/train/data.list" \
    --data.cmvn "$data/train/global_cmvn.json" --output_dir "$exp/$name" "${sizing[@]}" \
    --max_steps "$steps" --train.save_every 0 --train.save_at_epoch_end false --train.warmup_steps 5 \
    --train.log_every 5 --train.tensorboard false --train.progress_bar false --data.num_workers "$workers" \
    --data.pin_memory "$([ "$device" = cuda ] && echo true || echo false)" "$@" >>"$out/suite.log" 2>&1 || return 1
  "$python" "$repo/tools/step_summary.py" "$exp/$name/train_log.jsonl" --name "$name" --skip $(( steps > 10 ? 5 : 1 )) \
    | tee -a "$out/suite.md"
}

part_train() {
  log "train: west-train, pack $pack, $steps steps, the real loader ($workers workers, pinned memory on CUDA)"
  train_run train_eager
}
part_ckpt() {   # the seed config's checkpoint_scope mlp (part train) against whole layers replayed, same call
  log "ckpt: the same with model.llm.checkpoint_scope layer (whole decoder layers replayed)"
  train_run train_scope_layer --model.llm.gradient_checkpointing true --model.llm.checkpoint_scope layer
}
part_syncs() {
  [ "$device" = cuda ] || { log "syncs: skipped (torch's sync debug mode needs CUDA)"; return 0; }
  log "syncs: host synchronisations per step, by source line (tools/count_syncs.py)"
  "$python" "$repo/tools/count_syncs.py" --config "$conf" "${common[@]}" --data "$data/train/data.list" \
    --data.cmvn "$data/train/global_cmvn.json" --num_utts 200 --steps 5 --pack_tokens "$pack" \
    --batch_size "$batch" --max_tokens_in_batch "$max_tokens" --out "$out/syncs.json" 2>&1 | tee -a "$out/suite.log" | tail -7
}
profile_run() {   # json name, modes, extra args... (run under ${launcher[@]} when set: a sampling profiler)
  local name=$1 modes=$2; shift 2
  ${launcher[@]+"${launcher[@]}"} "$python" "$repo/tools/profile_step.py" --config "$conf" "${common[@]}" --data "$data/train/data.list" \
    --data.cmvn "$data/train/global_cmvn.json" --num_utts "$(( num_utts < prof_utts ? num_utts : prof_utts ))" --steps "$prof_steps" \
    --modes "$modes" --pack_tokens "$pack" --batch_size "$batch" --max_tokens_in_batch "$max_tokens" \
    --out "$out/$name.json" "$@" 2>&1 | tee -a "$out/suite.log" | sed -n -e '/^py-spy> /d' -e '/^### /,$p' | tee -a "$out/suite.md"
}
part_kernels() {
  [ "$device" = cuda ] || { log "kernels: skipped (a kernels-only trace needs CUDA)"; return 0; }
  log "kernels: kernels-only traces (no CPU operators recorded): GPU busy, idle gaps host late vs queued, by length"
  profile_run kernels pack,pack_encoder_padded,static --kernels_only
  profile_run kernels_graphs pack --kernels_only --train.cuda_graphs true   # the decoder replayed
}
part_marks() {   # which phases of the step the host paces, with nothing slowing it (a profiler did, 2.4x)
  log "marks: unprofiled steps marked at phase boundaries (host and GPU clocks), per mode, then with both operator cuts; west-train marked"
  profile_run marks pack,pack_encoder_padded,static --phase_marks --steps 6
  profile_run marks_cuts pack --phase_marks --train.precision bf16 --train.bf16_weights true --model.llm.fused_rotary true
  train_run train_marks --train.phase_marks true   # west-train's phases: which of them its 1.27x is in
}
part_queues() {   # a stream holds about 1,000 pending launches: where the GPU is the slower side (the LLM's
  # large products) the host stops there, and cannot bank that time for the phases it paces (the encoder's
  # small kernels). CUDA_SCALE_LAUNCH_QUEUES=4x deepens the queue (a driver setting, read at CUDA's start;
  # one report of hangs on Jetson, hence the timeouts)
  log "queues: pack with CUDA_SCALE_LAUNCH_QUEUES=4x (a 4x deeper launch queue): marked benchmark steps, then west-train"
  export CUDA_SCALE_LAUNCH_QUEUES=4x
  launcher=(timeout 150)
  profile_run marks_queues pack --phase_marks --steps 6
  train_run train_queues
}
part_pyspy() {   # where the launching thread's time goes in C++ and the driver too (cProfile sees Python only)
  local spy warm=2 rate=100 n=$(( prof_steps * 10 ))
  spy=$(command -v py-spy || true)
  [ -n "$spy" ] || [ ! -x /tmp/site/bin/py-spy ] || spy=/tmp/site/bin/py-spy
  [ -n "$spy" ] || { log "pyspy: skipped (no py-spy: tools/gpu_wheels.sh puts its wheel into .whl/)"; return 0; }
  log "pyspy: native stack samples of pack steps, the backward on the launching thread (py-spy, tools/stack_summary.py)"
  rm -f "$work_dir/pyspy_stacks.txt"
  # bounded: native unwinding through CUDA's libraries is untried here (a stuck py-spy ends; its tool runs on)
  launcher=(timeout 240 "$spy" record --native --idle --rate "$rate" --format raw -o "$work_dir/pyspy_stacks.txt" --)
  profile_run pyspy_marks pack --phase_marks --single_thread_backward --steps "$n" --warmup_steps "$warm"
  launcher=()
  [ -s "$work_dir/pyspy_stacks.txt" ] || { log "pyspy: no samples (py-spy may not be allowed to trace here: suite.log)"; return 1; }
  "$python" "$repo/tools/stack_summary.py" "$work_dir/pyspy_stacks.txt" --rate "$rate" --steps "$(( n + warm ))" \
    --out "$out/pyspy.json" | tee -a "$out/suite.md"
}
part_floor() {   # ~37 µs of host time per launch over the H200's step: this machine's floor, or more?
  log "floor: host time per dispatched operator apart from any model (launch, allocation, autograd, autocast)"
  local sizes=(); $tiny && sizes=(--ops 200 --repeats 1)
  "$python" "$repo/tools/launch_floor.py" --device "$device" "${sizes[@]}" --out "$out/floor.json" | tee -a "$out/suite.md"
}
part_encoder_graphs() {   # the encoder's 12 trainable blocks: thousands of small kernels, each shorter on the GPU
  # than its launch on the host; replayed from CUDA graphs, two launches (rows padded to one shape)
  log "encoder_graphs: west-train with train.encoder_graphs true (the Conformer's blocks replayed), marked"
  # rows: a pack of 8,192 LLM positions holds about 9,650 encoder rows of the built-in corpus (1.18 per
  # position, counted on the CPU): 12,288 leaves room; a pack over it runs eagerly and is counted
  local extra=(--train.encoder_graph_rows 12288)
  $tiny && extra=(--model.encoder.pos_enc wenet --model.encoder.attn_backend varlen)   # CPU: the kernel's reference
  if ! train_run train_encoder_graphs --train.encoder_graphs true --train.phase_marks true "${extra[@]}"; then
    log "encoder_graphs: train_encoder_graphs failed (see suite.log); once more with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False"
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False train_run train_encoder_graphs_fixed_segments \
      --train.encoder_graphs true --train.phase_marks true "${extra[@]}"
  fi
  { grep -h "(train.encoder_graphs)" "$out/suite.log" || true; } | tail -n 1 \
    | sed 's/^.*; \([0-9]* encoder batches\)/- \1/' | tee -a "$out/suite.md"
}
part_encoder_graphs_exact() {   # replayed blocks must train as the eager ones: with dropout off (masks drawn in a
  # graph come from another stream) the two runs' losses step by step, apart only by rounding
  log "encoder_graphs_exact: 10 steps eager, then with train.encoder_graphs, model.encoder.dropout 0: losses step by step"
  local extra=(--model.encoder.dropout 0) graph=(--train.encoder_graph_rows 12288)
  $tiny && { extra+=(--model.encoder.pos_enc wenet --model.encoder.attn_backend varlen); graph=(); }
  steps=$(( steps < 10 ? steps : 10 ))
  train_run train_nodrop_eager "${extra[@]}"
  train_run train_nodrop_graphs "${extra[@]}" --train.encoder_graphs true ${graph[@]+"${graph[@]}"}
  "$python" "$repo/tools/compare_losses.py" "$exp/train_nodrop_eager/train_log.jsonl" \
    "$exp/train_nodrop_graphs/train_log.jsonl" --json "$out/graphs_exact.json" | tee -a "$out/suite.md"
}
part_encoder_graphs_full() {   # if the encoder's graphs make the step GPU-bound, the LLM's MLP replay (a third
  # of its forward again) is what stands between the step and the MFU target: the same without it
  log "encoder_graphs_full: west-train with the encoder's blocks replayed and no LLM checkpointing (model.llm.gradient_checkpointing false)"
  local extra=(--train.encoder_graph_rows 12288)
  $tiny && extra=(--model.encoder.pos_enc wenet --model.encoder.attn_backend varlen)
  train_run train_encoder_graphs_no_ckpt --train.encoder_graphs true --model.llm.gradient_checkpointing false \
    "${extra[@]}"
}
part_encoder_graphs_compiled() {   # replayed, the encoder's blocks still cost the GPU 23.5 ms forward for about
  # 1 ms of products (fifth run): hundreds of small elementwise kernels. Compiled before the capture, the
  # graph replays inductor's fused ones. Without the LLM's checkpointing: against the fastest step so far
  # (encoder_graphs_full, 0.227 s on an H200) and part best's benchmark in the same call
  log "encoder_graphs_compiled: west-train with the encoder's blocks compiled (train.compile_scope encoder), then replayed, no LLM checkpointing, marked"
  local extra=(--train.encoder_graph_rows 12288 --model.llm.gradient_checkpointing false --train.phase_marks true)
  $tiny && extra=(--model.encoder.pos_enc wenet --model.encoder.attn_backend varlen --train.phase_marks true)
  steps=$(( steps < 30 ? steps : 30 ))   # the compilation takes the first steps; medians from step 6
  train_run train_encoder_graphs_compiled --train.encoder_graphs true --train.compile true \
    --train.compile_scope encoder "${extra[@]}"
  { grep -h "(train.encoder_graphs)" "$out/suite.log" || true; } | tail -n 1 \
    | sed 's/^.*; \([0-9]* encoder batches\)/- compiled: \1/' | tee -a "$out/suite.md"
}
part_ring() {   # one idle gap of 11-23 ms per pack step, each ended by an index copy pinned on its own (H200)
  log "ring: train.pinned_ring_mib (index copies staged in one page-locked ring): copies intact with the GPU behind,"\
" host µs per small copy three ways and per launch; west-train with the ring, marked"
  if [ "$device" = cuda ]; then
    "$python" "$repo/tools/check_pinned_ring.py" --out "$out/ring.json" 2>&1 | tee -a "$out/suite.log" | tail -n 10 \
      | tee -a "$out/suite.md"
  else log "ring: check_pinned_ring.py skipped (needs CUDA; on the CPU the ring is off and the runs below train without it)"
  fi
  train_run train_pinned_ring --train.pinned_ring_mib 8 --train.phase_marks true   # against part marks' train_marks
  { grep -h "(train.pinned_ring_mib)" "$out/suite.log" || true; } | tail -n 1 | sed 's/^.*; pinned ring/- pinned ring/' \
    | tee -a "$out/suite.md"   # its copies and waits (none on the CPU: the ring is CUDA's)
}
part_hostpy() {   # the graphs cut launches by 45 % and the host's time per step not at all (H200): where is it?
  log "hostpy: the pack step's Python on the launching thread (cProfile, the backward on that thread too), eager and with train.cuda_graphs (marked first)"
  profile_run hostpy pack --host_python --single_thread_backward
  profile_run hostpy_graphs pack --host_python --single_thread_backward --phase_marks --train.cuda_graphs true
}
part_profile() {
  log "profile: where the GPU waits for the host, per phase of the step (tools/profile_step.py)"
  profile_run profile pack,pack_encoder_padded,static
}
part_profile_compiled() {   # train.compile cut GPU work per step by a quarter and host time hardly at all (H100)
  log "profile_compiled: the pack step's phases with train.compile true: where the compiled step's host time goes"
  profile_run profile_compiled pack --train.compile true --warmup_steps 4
}
part_gap() {   # west-train's step is 1.32x the benchmark's (H200, fifth run), its projector and splice host-paced
  # at 16-21 ms where the benchmark's runner takes about 1: is it what runs beside the launching thread?
  log "gap: west-train without the pin-memory thread, then with the loader in the main thread (nothing beside it), marked"
  steps=$(( steps < 20 ? steps : 20 ))   # phases 16-21 ms against about 1: 15 steps of medians tell them apart
  train_run train_no_pin_thread --data.pin_memory false --train.phase_marks true
  train_run train_main_thread_loader --data.num_workers 0 --data.pin_memory false --train.phase_marks true
}
part_contention() {   # west-train queued its step 1.27x slower than the benchmark (H200), which has no loader
  log "contention: west-train with 2 loader workers instead of $workers, then with OMP_NUM_THREADS=1 (torch's CPU threads)"
  train_run train_two_workers --data.num_workers 2
  export OMP_NUM_THREADS=1
  train_run train_one_thread
}
part_cudnn() {   # train.cudnn_attention (off by default): padded batches' SDPA through cuDNN, a graph per new shape
  log "cudnn: west-train on static batches of $batch, SDPA without cuDNN attention (the default), then with it"
  batching="--batch_type static --batch_size $batch"   # 20 steps each: with cuDNN on, a new shape may cost ~1 s
  train_run train_static --train.max_steps "$(( steps < 20 ? steps : 20 ))"
  train_run train_static_cudnn --train.max_steps "$(( steps < 20 ? steps : 20 ))" --train.cudnn_attention true
}
part_norm() {   # model.llm.fused_norm (on in part train): the LLM's 57 RMSNorms as the stock 8+14 operators
  log "norm: west-train with the LLM's stock RMSNorms (model.llm.fused_norm false) against part train's fused ones"
  train_run train_stock_norm --model.llm.fused_norm false
}
part_weights() {   # train.bf16_weights: autocast's weight casts (~620 operators per step) gone
  log "weights: west-train with train.bf16_weights true (bf16 working copies) against part train's autocast casts"
  train_run train_bf16_weights --train.precision bf16 --train.bf16_weights true
}
part_rotary() {   # model.llm.fused_rotary: q and k's rotary embedding as one autograd node (~12 launches fewer per layer)
  log "rotary: west-train with model.llm.fused_rotary true against part train's stock rotary embedding"
  train_run train_fused_rotary --model.llm.fused_rotary true
}
part_headroom() {   # item 6's two open comparisons: the benchmark's step at west-train's size, and MFU
  # without the LLM's checkpoint replay (31 % of the FLOPs under 24 GiB) at the largest pack the card holds
  log "headroom: west-benchmark pack at $pack (west-train's size); pack, LLM checkpointing off, largest under the card"
  local gran=4096 card=card reps=2; $tiny && { gran=256; card=2GiB; reps=1; }
  "$python" -m west.bin.benchmark --config "$conf" "${common[@]}" --data "$data/train/data.list" \
    --data.cmvn "$data/train/global_cmvn.json" --num_utts "$num_utts" --out_dir "$exp/bench_fixed" \
    --modes pack --pack_tokens "$pack" --repeats "$reps" --profile never --no-count_ops >>"$out/suite.log" 2>&1
  "$python" - "$exp/bench_fixed/benchmark.json" "$exp/$([ -d "$exp/train_eager" ] && echo train_eager)" <<'EOF2' | tee -a "$out/suite.md"
import json, sys
from pathlib import Path
r = json.load(open(sys.argv[1]))["modes"]["pack"]
step = r["time_s"] / len(r["batches"])
h = r.get("host_per_step_s", {})
split = lambda launch, wait: f"host queueing {launch:.3f} s, blocked in the read-back {wait:.3f} s"
print(f"- benchmark, {r['configuration']}: {step:.3f} s per step ({len(r['batches'])} batches, median of the "
      f"timed passes; {split(h.get('launch_s', float('nan')), h.get('sync_wait_s', float('nan')))})")
log = Path(sys.argv[2]) / "train_log.jsonl"
if log.is_file():
    recs = [json.loads(line) for line in log.open() if '"step_time_s"' in line]
    recs = recs[5:] if len(recs) > 10 else recs   # as the train part's summary: warm-up left out
    med = lambda key: sorted(x.get(key, float("nan")) for x in recs)[len(recs) // 2]
    print(f"- west-train at the same size: {med('step_time_s'):.3f} s per step (median of {len(recs)}; "
          f"{split(med('launch_s'), med('sync_wait_s'))}): {med('step_time_s') / step:.2f}x the benchmark's")
EOF2
  "$python" -m west.bin.benchmark --config "$conf" "${common[@]}" --data "$data/train/data.list" \
    --data.cmvn "$data/train/global_cmvn.json" --num_utts "$num_utts" --out_dir "$exp/bench_headroom" \
    --modes pack --pack_tokens "$pack" --repeats "$reps" --profile never --memory_budget "$card" --no-count_ops \
    --search_granularity "$gran" --model.llm.gradient_checkpointing false >>"$out/suite.log" 2>&1
  cp "$exp/bench_headroom/benchmark.md" "$out/benchmark_headroom.md"
  head -n 4 "$out/benchmark_headroom.md" | tee -a "$out/suite.md"
}
part_best() {   # item 6's MFU and GPU-busy targets at the fastest west-train configuration so far (fifth run,
  # H200: 0.227 s per step): the encoder's blocks replayed, the LLM's checkpointing off, pack 8192, no cap
  log "best: west-benchmark pack $pack with train.encoder_graphs and model.llm.gradient_checkpointing false"
  local reps=2 extra=(--train.encoder_graph_rows 12288)
  $tiny && { reps=1; extra=(--model.encoder.pos_enc wenet --model.encoder.attn_backend varlen); }
  "$python" -m west.bin.benchmark --config "$conf" "${common[@]}" --data "$data/train/data.list" \
    --data.cmvn "$data/train/global_cmvn.json" --num_utts "$num_utts" --out_dir "$exp/bench_best" \
    --modes pack --pack_tokens "$pack" --repeats "$reps" --profile never --no-count_ops \
    --train.encoder_graphs true --model.llm.gradient_checkpointing false "${extra[@]}" >>"$out/suite.log" 2>&1
  cp "$exp/bench_best/benchmark.md" "$out/benchmark_best.md"
  head -n 3 "$out/benchmark_best.md" | tee -a "$out/suite.md"
}
part_graphs() {   # the host launched ~7,600 kernels per step (H200 profile); the decoder's become two graph replays
  log "graphs: west-train and west-benchmark (pack $pack) with train.cuda_graphs true (the frozen LLM decoder"\
" captured once, rows padded to $pack), the benchmark also without"
  local alloc=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}   # west's default (west.ranks)
  if ! train_run train_graphs --train.cuda_graphs true; then   # some torch builds capture badly with it
    alloc=expandable_segments:False
    log "graphs: train_graphs failed (see suite.log); once more with PYTORCH_CUDA_ALLOC_CONF=$alloc"
    PYTORCH_CUDA_ALLOC_CONF=$alloc train_run train_graphs_fixed_segments --train.cuda_graphs true
  fi
  grep -h "(train.cuda_graphs)" "$out/suite.log" | tail -n 1 | sed 's/^/- /' | tee -a "$out/suite.md"
  local reps=2 variants="false true"; $tiny && { reps=1; variants=true; }   # tiny: the headroom part runs "false"
  for graphs in $variants; do
    PYTORCH_CUDA_ALLOC_CONF=$alloc "$python" -m west.bin.benchmark --config "$conf" "${common[@]}" --data "$data/train/data.list" \
      --data.cmvn "$data/train/global_cmvn.json" --num_utts "$num_utts" --out_dir "$exp/bench_graphs_$graphs" \
      --modes pack --pack_tokens "$pack" --repeats "$reps" --profile never --no-count_ops \
      --train.cuda_graphs "$graphs" >>"$out/suite.log" 2>&1
    "$python" - "$exp/bench_graphs_$graphs/benchmark.json" "$graphs" <<'EOF2' | tee -a "$out/suite.md"
import json, sys
r = json.load(open(sys.argv[1]))["modes"]["pack"]
h, n = r["host_per_step_s"], len(r["batches"])
mfu = f"{100 * r['mfu']:.1f} % MFU, " if "mfu" in r else ""
print(f"- benchmark, {r['configuration']}, train.cuda_graphs {sys.argv[2]}: {r['time_s'] / n:.3f} s per step, {mfu}"
      f"busy {r['util_pct']:.0f} %, host queueing {h['launch_s']:.3f} s, blocked in the read-back "
      f"{h['sync_wait_s']:.3f} s{'; ' + r['llm_graph'] if r.get('llm_graph') else ''}")
EOF2
  done
}
part_compile() {
  log "compile: the same with train.compile true"
  train_run train_compiled --train.compile true
}
part_compile_encoder() {   # the encoder's small kernels (host-paced?) compiled, the LLM's large ones left eager
  log "compile_encoder: the train part with the Conformer blocks compiled alone (train.compile_scope encoder)"
  train_run train_compile_encoder --train.compile true --train.compile_scope encoder
}
part_big() {   # issue 23: fits 40 GiB at pack 8192; pack vs Whisper padded to 30 s under 80 GB
  big=$repo/recipes/aishell/conf/whisper_7b_lora.yaml
  wdir=$exp/whisper_large_v3; qdir=$exp/qwen2_7b
  $tiny && { wdir=$exp/whisper_tiny; qdir=$llm; }
  log "big: random Whisper-large-v3 and Qwen2-7B shapes"
  [ -f "$wdir/config.json" ] || "$python" "$repo/tools/make_random_whisper.py" "$wdir" \
    --shape "$($tiny && echo tiny || echo large-v3)" --device "$device" >>"$out/suite.log" 2>&1
  [ -f "$qdir/config.json" ] || "$python" "$repo/tools/make_seed_llm.py" "$qdir" --tokenizer "$exp/tiny_llm" \
    --shape qwen2-7b --device "$device" >>"$out/suite.log" 2>&1
  conf=$big common=(--model.encoder.path "$wdir" --model.llm.path "$qdir" --train.device "$device")
  steps=$(( steps < 12 ? steps : 12 ))
  train_run big_pack --data.cmvn null
  # sizes found under 80 GiB on one H200 (2026-11-27: pack 16,384 tokens 40.1 GiB, Whisper padded batch 128
  # 72.5 GiB, 137 the largest); searching them again took over 4 minutes of a call
  local big_pack=16384 big_batch=128; $tiny && { big_pack=$pack; big_batch=$batch; }
  log "big: west-benchmark pack $big_pack tokens vs whisper_padded_30s batch $big_batch (sizes that fit 80 GiB)"
  "$python" -m west.bin.benchmark --config "$big" "${common[@]}" --data "$data/train/data.list" --data.cmvn null \
    --num_utts "$(( num_utts < 200 ? num_utts : 200 ))" --out_dir "$exp/bench_big" --repeats 1 --profile never \
    --modes pack,whisper_padded_30s --pack_tokens "$big_pack" --batch_size "$big_batch" --no-count_ops \
    >>"$out/suite.log" 2>&1
  cp "$exp/bench_big/benchmark.md" "$out/benchmark_big.md"
  tail -n 20 "$out/benchmark_big.md"
}

IFS=, read -ra order <<<"$parts"   # parts run in the order given
for name in "${order[@]}"; do
  declare -F "part_$name" >/dev/null || { log "unknown part $name"; failed+=("$name"); continue; }
  part "$name"
done
{ [ -f "$out/benchmark.md" ] && cat "$out/benchmark.md"; } >>"$out/suite.md" 2>/dev/null || true
if [ "$(find "$out" -maxdepth 1 -type f | wc -l)" -gt 8 ]; then   # the device tool returns 8 files at most
  (cd "$out" && tar -cf json.tar ./*.json && rm -f ./*.json) && log "more than 8 files: the JSON files are in json.tar"
fi
log "done in $(( $(date +%s) - t_start )) s; tables: $out/suite.md${failed[*]:+; FAILED: ${failed[*]}}${skipped[*]:+; skipped: ${skipped[*]}}"
[ ${#failed[@]} -eq 0 ]
