# tools/gpu_suite.sh's west-train parts: train_run (one short run with the real loader, its step summary
# into suite.md) and the parts that compare runs of it with one setting changed. Sourced by gpu_suite.sh,
# whose variables (python, repo, conf, common, data, exp, out, pack, steps, workers, tiny, ...) they read.
train_entry=(-m west.bin.train)   # what train_run's python runs (part syncs_train: west-train under a counter)
train_run() {   # name, extra args... (rows packed to $pack tokens, unless $batching gives other batching flags;
                #   run under ${launcher[@]} when set)
  local name=$1 sizing=(--batch_type pack --pack_tokens "$pack"); shift
  [ -z "${batching:-}" ] || read -ra sizing <<<"$batching"
  rm -rf "$exp/$name"
  ${launcher[@]+"${launcher[@]}"} "$python" "${train_entry[@]}" --config "$conf" "${common[@]}" --train_data "$data/train/data.list" \
    --data.cmvn "$data/train/global_cmvn.json" --output_dir "$exp/$name" "${sizing[@]}" \
    --max_steps "$steps" --train.save_every 0 --train.save_at_epoch_end false --train.save_at_end false --train.warmup_steps 5 \
    --train.log_every 5 --train.tensorboard false --train.progress_bar false --data.num_workers "$workers" \
    --data.pin_memory "$([ "$device" = cuda ] && echo true || echo false)" "$@" >>"$out/suite.log" 2>&1 || return 1
  "$python" "$repo/tools/step_summary.py" "$exp/$name/train_log.jsonl" --name "$name" --skip $(( steps > 10 ? 5 : 1 )) \
    | tee -a "$out/suite.md"
}
part_train() {
  log "train: west-train, pack $pack, $steps steps, the real loader ($workers workers, pinned memory on CUDA)"
  train_run train_eager
}
part_train_again() {   # part train once more, last: the spread between two identical runs, against which
  # an A/B part's difference is read (a difference inside it is noise)
  log "train_again: part train's run again, for the run-to-run spread"
  train_run train_eager_again
}
part_ckpt() {   # the seed config's checkpoint_scope mlp (part train) against whole layers replayed, same call
  log "ckpt: the same with model.llm.checkpoint_scope layer (whole decoder layers replayed)"
  train_run train_scope_layer --model.llm.gradient_checkpointing true --model.llm.checkpoint_scope layer
}
part_late_readback() {   # the step's read-back waited ~35 ms for the GPU to finish the backward, then the GPU
  # idled while the host launched the next step's first phases (H200, fifth run): read the figures a step late.
  # With the encoder eager it bought nothing (H100, sixth run): the host, a step ahead, fills the launch queue
  # with the encoder's ~1,000 small kernels and waits there instead. Replayed, they are two launches
  log "late_readback: west-train with the encoder replayed, reading each step's figures back before the update, then one step late"
  steps=$(( steps < 20 ? steps : 20 ))
  train_run train_readback "${replayed[@]}" --train.late_readback false
  train_run train_late_readback "${replayed[@]}" --train.late_readback true
  "$python" "$repo/tools/compare_losses.py" "$exp/train_readback/train_log.jsonl" \
    "$exp/train_late_readback/train_log.jsonl" --json "$out/late_exact.json" | tee -a "$out/suite.md"
}
part_gap() {   # west-train's step is 1.32x the benchmark's (H200, fifth run). With the encoder replayed there, the
  # host spent 31 ms in the projector and 19 in the splice (GPU 22 and 19), which take the benchmark's runner about 1
  # and took 6 and 1 with no pin thread (H100, sixth run, encoder eager, no baseline beside it): is it the pin thread?
  log "gap: west-train as configured (the encoder replayed), marked: with the pin-memory thread, without it (each"\
    "copy pinned by the step), and without it through a 64 MiB page-locked ring (train.pinned_ring_mib)"
  steps=$(( steps < 20 ? steps : 20 ))   # phases 16-31 ms against about 1: 15 steps of medians tell them apart
  train_run train_pin_thread "${replayed[@]}" --train.phase_marks true
  train_run train_no_pin_thread "${replayed[@]}" --data.pin_memory false --train.phase_marks true
  train_run train_ring_no_pin_thread "${replayed[@]}" --data.pin_memory false --train.pinned_ring_mib 64 \
    --train.phase_marks true
}
part_pyspy_train() {   # west-train's projector, splice and loss phases took the host 30, 16 and 17 ms per step against the
  # benchmark's 1, 1 and 3, with the pin thread, without it and through the ring alike (seventh run, H200): py-spy on
  # west-train itself, the step as configured, says in what (a wait in the driver, for Python's lock, or work)
  local spy rate=20 raw=$work_dir/pyspy_train.txt
  spy=$(pyspy_bin)
  [ -n "$spy" ] || { log "pyspy_train: skipped (no py-spy: tools/gpu_wheels.sh puts its wheel into .whl/)"; return 0; }
  log "pyspy_train: native stack samples of west-train as configured (py-spy, tools/stack_summary.py --focus)"
  steps=$(( steps < 20 ? steps : 20 ))
  rm -f "$raw"
  # bounded; SIGINT, on which py-spy writes the samples it has (part pyspy)
  launcher=(timeout -s INT 150 "$spy" record --native --idle --threads --rate "$rate" --format raw -o "$raw" --)
  train_run train_pyspy "${replayed[@]}"   # unmarked: marks read at each step's end would undo the late read-back
  launcher=()
  [ -s "$raw" ] || { log "pyspy_train: no samples (py-spy may not be allowed to trace here: suite.log)"; return 1; }
  "$python" "$repo/tools/stack_summary.py" "$raw" --rate "$rate" --steps "$steps" --focus Projector.forward \
    --focus SpeechLLM._embed --focus SpeechLLM._label_loss --out "$out/pyspy_train.json" | tee -a "$out/suite.md"
}
part_syncs_train() {   # in west-train the host waited for the GPU inside the projector, loss and splice backward
  # phases (seventh run, H200), where the benchmark's runner syncs once per step: which lines sync in west-train?
  [ "$device" = cuda ] || { log "syncs_train: skipped (torch's sync debug mode needs CUDA)"; return 0; }
  log "syncs_train: west-train as configured under torch's sync debug mode, its syncs by line (tools/train_syncs.py)"
  steps=$(( steps < 20 ? steps : 20 ))
  wrapped_run "$repo/tools/train_syncs.py" --steps "$steps" --out "$out/syncs_train.json" -- train_syncs "${replayed[@]}"
}
wrapped_run() {   # tool, its args, --, run name, train_run's args: west-train run by a tool that wraps it (its own
  # args end in --, then west-train's) and writes a markdown table to $work_dir/NAME.md, appended to suite.md
  local tool=() name
  while [ "$1" != -- ]; do tool+=("$1"); shift; done
  name=$2; shift 2
  rm -f "$work_dir/$name.md"
  train_entry=("${tool[@]}" --md "$work_dir/$name.md" --)
  train_run "$name" "$@" || { train_entry=(-m west.bin.train); return 1; }
  train_entry=(-m west.bin.train)
  tee -a "$out/suite.md" < "$work_dir/$name.md"
}
op_timed_run() {   # [--tool_option value ...] name, extra args...: train_run under tools/train_op_times.py (given
  # those options), its tables into suite.md
  local opts=() name
  while [ "${1#--}" != "$1" ]; do opts+=("$1" "$2"); shift 2; done
  name=$1; shift
  wrapped_run "$repo/tools/train_op_times.py" --skip 5 ${opts[@]+"${opts[@]}"} --out "$out/op_times_$name.json" -- \
    "$name" "$@"
}
part_optimes_train() {   # west-train's projector and splice phases took the host 30 and 16 ms per step with the GPU idle
  # (seventh run, H200), the benchmark's runner about 1 each (and 16.5 and 12 in its pack_encoder_padded mode, fifth
  # run): which operator or which line of Python holds them? (an operator that blocks shows as one long call). Then the
  # same with the caching allocator's fixed-size segments instead of west's expandable ones (growing an expandable
  # segment maps memory on the host, in the call that allocates), and without the NVML sampler thread (west-train's
  # runs always had it; the benchmark's marked steps, 1 ms in these phases, never did; NVML's queries take driver locks)
  log "optimes_train: west-train as configured, the host's time in its encoder rows, projector, splice and loss"\
    "phases by operator and line (tools/train_op_times.py); then with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False;"\
    "then with train.nvml false"
  steps=$(( steps < 20 ? steps : 20 ))
  op_timed_run train_op_times "${replayed[@]}"
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False op_timed_run train_op_times_fixed_segments "${replayed[@]}"
  op_timed_run train_op_times_no_nvml "${replayed[@]}" --train.nvml false
}
part_preloaded() {   # the two sides of west-train's 1.27x over the benchmark's step (seventh run): its loader beside the
  # launching thread (worker processes, the pin-memory thread), or its loop. The same run as part optimes_train's first,
  # on the loader's first batches from memory with the loader ended (west.bench.preloaded): near the benchmark's
  # phases, it is the loader (part contention then says which of its parts); as slow as optimes_train's, the loop
  steps=$(( steps < 20 ? steps : 20 ))
  log "preloaded: west-train as configured, op-timed as in part optimes_train, on its loader's first $steps batches"\
    "from memory, the loader ended"
  op_timed_run --preload "$steps" train_op_times_preloaded "${replayed[@]}"
}
part_gil() {   # if part optimes_train shows the launching thread blocked in a watched phase while another Python
  # thread ran (the interpreter hands its lock over every 5 ms when both want it): the same with a 0.5 ms interval.
  # Without that pattern in optimes_train's first run it is skipped (on the CPU, --tiny, it runs anyway)
  local first=$out/op_times_train_op_times.json why=
  if [ -f "$first" ]; then
    why=$("$python" - "$first" <<'EOF'
import json
import sys

from west.bench.op_times import python_lock_suspects

print("; ".join(python_lock_suspects(json.load(open(sys.argv[1], encoding="utf-8")))))
EOF
)
    if [ -z "$why" ] && ! $tiny; then
      log "gil: skipped (part optimes_train: no watched phase blocked while a Python thread ran)"; return 0
    fi
  fi
  log "gil: west-train as configured, op-timed as in part optimes_train, with Python's switch interval at 0.5 ms${why:+ ($why)}"
  steps=$(( steps < 20 ? steps : 20 ))
  op_timed_run --switch_interval_ms 0.5 train_op_times_gil "${replayed[@]}"
}
part_lora() {   # seed_gpu_lora.yaml (rank-16 adapters on every projection of the 1.5B LLM, whole layers
  # checkpointed; WEST's best AIShell-1 results train this way) has never run on a GPU
  log "lora: west-train with seed_gpu_lora.yaml (LoRA adapters train, the LLM's whole layers checkpointed),"\
    "the encoder replayed as its train.encoder_graphs auto runs it"
  local extra=()
  if $tiny; then extra=(--model.lora "{r: 4}"); else conf=$repo/recipes/aishell/conf/seed_gpu_lora.yaml; fi
  steps=$(( steps < 20 ? steps : 20 ))
  train_run train_lora "${replayed[@]}" "${extra[@]}"
}
part_contention() {   # west-train's step was 1.42x the benchmark's (seventh run, H200; the benchmark has no loader), its
  # projector, splice and loss host-paced at 30, 16 and 17 ms with or without the pin thread: the loader's processes?
  log "contention: west-train as configured, marked, with 2 loader workers instead of $workers, then with"\
    "OMP_NUM_THREADS=1 (torch's CPU threads)"
  train_run train_two_workers "${replayed[@]}" --data.num_workers 2 --train.phase_marks true
  OMP_NUM_THREADS=1 train_run train_one_thread "${replayed[@]}" --train.phase_marks true
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
part_prefix() {   # data.shared_prefix: the prompt's tokens before the speech once per pack row, not once per sample
  log "prefix: the kernels' bottom-right causal mask over a shared prefix's key rows; west-train as configured, the whole prompt in every sample, then its shared prefix once per row (data.shared_prefix)"
  { echo; echo '### A shared prompt prefix: the kernels against flash-attn semantics in float64'; echo '```'
    "$python" "$repo/tools/check_attention_cuda.py" --device "$device" --shared_prefix_only \
      $([ "$device" = cuda ] || echo --dtype float32) --check_tokens "$($tiny && echo 300 || echo 2048)" \
      --out "$out/attention_prefix.json" 2>>"$out/suite.log" | tail -n 6; echo '```'; } >>"$out/suite.md"
  train_run train_prompt_whole --data.shared_prefix false
  train_run train_prompt_shared --data.shared_prefix true
}
part_rotary() {   # model.llm.fused_rotary: q and k's rotary embedding as one autograd node (~12 launches fewer per layer)
  log "rotary: west-train with model.llm.fused_rotary true against part train's stock rotary embedding"
  train_run train_fused_rotary --model.llm.fused_rotary true
}
part_qkv() {   # model.llm.fused_qkv: each attention's q, k and v projections as one stacked product (5 launches fewer per layer)
  log "qkv: west-train with model.llm.fused_qkv true against part train's three projections per attention"
  train_run train_fused_qkv --model.llm.fused_qkv true
}
part_cuts() {   # the LLM's launch cuts measured only on the CPU so far, together, on west-train as configured:
  # fused_rotary (12 launches fewer per layer) and fused_qkv (5); parts rotary and qkv take them one at a time
  log "cuts: west-train as configured with model.llm.fused_rotary and fused_qkv (416 dispatched operators fewer per step at the seed's depth)"\
    "against part configured's train_late_readback"
  local steps=$(( steps < 20 ? steps : 20 ))
  train_run train_llm_cuts "${replayed[@]}" --train.late_readback true --model.llm.fused_rotary true \
    --model.llm.fused_qkv true || return 1
  [ ! -f "$exp/train_late_readback/train_log.jsonl" ] || "$python" "$repo/tools/compare_losses.py" \
    "$exp/train_late_readback/train_log.jsonl" "$exp/train_llm_cuts/train_log.jsonl" --json "$out/cuts_exact.json" \
    | tee -a "$out/suite.md"
}
part_compile() {
  log "compile: the same with train.compile true"
  train_run train_compiled --train.compile true
}
part_compile_encoder() {   # the encoder's small kernels (host-paced?) compiled, the LLM's large ones left eager
  log "compile_encoder: the train part with the Conformer blocks compiled alone (train.compile_scope encoder)"
  train_run train_compile_encoder --train.compile true --train.compile_scope encoder
}
part_encoder_graphs() {   # the encoder's 12 trainable blocks: thousands of small kernels, each shorter on the GPU
  # than its launch on the host; replayed from CUDA graphs, two launches (rows padded to one shape)
  log "encoder_graphs: west-train with train.encoder_graphs true (the Conformer's blocks replayed), marked"
  if ! train_run train_encoder_graphs "${replayed[@]}" --train.phase_marks true; then
    log "encoder_graphs: train_encoder_graphs failed (see suite.log); once more with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False"
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False train_run train_encoder_graphs_fixed_segments \
      "${replayed[@]}" --train.phase_marks true
  fi
  { grep -h "(train.encoder_graphs)" "$out/suite.log" || true; } | tail -n 1 \
    | sed 's/^.*; \([0-9]* encoder batches\)/- \1/' | tee -a "$out/suite.md"
}
part_encoder_graphs_exact() {   # replayed blocks must train as the eager ones: with dropout off (masks drawn in a
  # graph come from another stream) the two runs' losses step by step, apart only by rounding
  log "encoder_graphs_exact: 10 steps eager, then with train.encoder_graphs, model.encoder.dropout 0: losses step by step"
  local extra=(--model.encoder.dropout 0)
  $tiny && extra+=(--model.encoder.pos_enc wenet --model.encoder.attn_backend varlen)   # the eager run's route too
  steps=$(( steps < 10 ? steps : 10 ))
  train_run train_nodrop_eager "${extra[@]}"
  train_run train_nodrop_graphs "${extra[@]}" "${replayed[@]}"
  "$python" "$repo/tools/compare_losses.py" "$exp/train_nodrop_eager/train_log.jsonl" \
    "$exp/train_nodrop_graphs/train_log.jsonl" --json "$out/graphs_exact.json" | tee -a "$out/suite.md"
}
part_encoder_graphs_full() {   # if the encoder's graphs make the step GPU-bound, the LLM's MLP replay (a third
  # of its forward again) is what stands between the step and the MFU target: the same without it
  log "encoder_graphs_full: west-train with the encoder's blocks replayed and no LLM checkpointing (model.llm.gradient_checkpointing false)"
  train_run train_encoder_graphs_no_ckpt "${replayed[@]}" --model.llm.gradient_checkpointing false
}
part_encoder_graphs_compiled_train() {   # part encoder_graphs_compiled's configuration in west-train, with the
  # loader: against the fastest west-train step so far (encoder_graphs_full, 0.227 s on an H200)
  log "encoder_graphs_compiled_train: west-train with the encoder's blocks compiled (train.compile_scope encoder), then replayed, no LLM checkpointing, marked"
  steps=$(( steps < 30 ? steps : 30 ))   # the compilation takes the first steps; medians from step 6
  train_run train_encoder_graphs_compiled "${replayed[@]}" --train.compile true --train.compile_scope encoder \
    --model.llm.gradient_checkpointing false --train.phase_marks true
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
