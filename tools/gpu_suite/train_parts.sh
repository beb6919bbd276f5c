# tools/gpu_suite.sh's west-train parts: train_run (one short run with the real loader, its step summary
# into suite.md), west-train as configured, and the A/B runs behind the keys seed_gpu*.yaml set. Sourced by
# gpu_suite.sh, whose variables (python, repo, conf, common, data, exp, out, pack, steps, workers, tiny, ...) they read.
trainer=(-m west.bin.train)   # what train_run runs: west-train, or a lab tool wrapping it (part host_wait)
train_run() {   # name, extra args... (rows packed to $pack tokens)
  local name=$1 sizing=(--batch_type pack --pack_tokens "$pack"); shift
  rm -rf "$exp/$name"
  "$python" "${trainer[@]}" --config "$conf" "${common[@]}" --train_data "$data/train/data.list" \
    --data.cmvn "$data/train/global_cmvn.json" --output_dir "$exp/$name" "${sizing[@]}" \
    --max_steps "$steps" --train.save_every 0 --train.save_at_epoch_end false --train.save_at_end false --train.warmup_steps 5 \
    --train.log_every 5 --train.tensorboard false --train.progress_bar false --data.num_workers "$workers" \
    --data.pin_memory "$([ "$device" = cuda ] && echo true || echo false)" "$@" >>"$out/suite.log" 2>&1 || return 1
  "$python" "$repo/tools/step_summary.py" "$exp/$name/train_log.jsonl" --name "$name" --skip $(( steps > 10 ? 5 : 1 )) \
    | tee -a "$out/suite.md"
}
part_train() {   # west-train as seed_gpu.yaml configures it (the encoder replayed where train.encoder_graphs auto
  # replays it, the figures read a step late), the real loader
  log "train: west-train as configured, pack $pack, $steps steps, the real loader ($workers workers, pinned memory on CUDA)"
  train_run train_configured
}
part_train_again() {   # part train once more: the spread between two identical runs, against which an A/B part's
  # difference is read (a difference inside it is noise)
  log "train_again: part train's run again, for the run-to-run spread"
  train_run train_configured_again
}
part_encoder_graphs() {   # train.encoder_graphs (auto replays the Conformer's blocks on one GPU) against eager blocks
  log "encoder_graphs: west-train with train.encoder_graphs false (eager blocks) against part train"
  train_run train_encoder_eager --train.encoder_graphs false
}
part_late_readback() {   # train.late_readback (seed_gpu.yaml: true) against reading each step back before the update;
  # the same losses either way
  log "late_readback: west-train reading each step's figures back before the update, against part train"
  train_run train_readback --train.late_readback false
  [ ! -f "$exp/train_configured/train_log.jsonl" ] || "$python" "$repo/tools/compare_losses.py" \
    "$exp/train_readback/train_log.jsonl" "$exp/train_configured/train_log.jsonl" --json "$out/late_exact.json" \
    | tee -a "$out/suite.md"
}
part_ckpt() {   # model.llm.checkpoint_scope mlp (seed_gpu.yaml) against whole decoder layers replayed
  log "ckpt: west-train with model.llm.checkpoint_scope layer (whole decoder layers replayed) against part train"
  train_run train_scope_layer --model.llm.gradient_checkpointing true --model.llm.checkpoint_scope layer
}
part_norm() {   # model.llm.fused_norm (default true) against the stock RMSNorms
  log "norm: west-train with the LLM's stock RMSNorms (model.llm.fused_norm false) against part train"
  train_run train_stock_norm --model.llm.fused_norm false
}
part_compile() {   # train.compile against part train
  log "compile: west-train with train.compile true against part train"
  train_run train_compiled --train.compile true
}
part_encoder_graphs_exact() {   # replayed blocks must train as the eager ones: with dropout off (masks drawn in a
  # graph come from another stream) the two runs' losses step by step, apart only by rounding
  log "encoder_graphs_exact: 10 steps eager, then with train.encoder_graphs, model.encoder.dropout 0: losses step by step"
  local extra=(--model.encoder.dropout 0)
  $tiny && extra+=(--model.encoder.pos_enc wenet --model.encoder.attn_backend varlen)   # the eager run's route too
  steps=$(( steps < 10 ? steps : 10 ))
  train_run train_nodrop_eager "${extra[@]}" --train.encoder_graphs false
  train_run train_nodrop_graphs "${extra[@]}" "${replayed[@]}"
  "$python" "$repo/tools/compare_losses.py" "$exp/train_nodrop_eager/train_log.jsonl" \
    "$exp/train_nodrop_graphs/train_log.jsonl" --json "$out/graphs_exact.json" | tee -a "$out/suite.md"
}
part_lora() {   # seed_gpu_lora.yaml: rank-16 adapters on every projection of the 1.5B LLM, whole layers checkpointed
  log "lora: west-train with seed_gpu_lora.yaml (LoRA adapters train, the LLM's whole layers checkpointed),"\
    "the encoder replayed as its train.encoder_graphs auto runs it"
  local extra=()
  if $tiny; then extra=(--model.lora "{r: 4}"); else conf=$repo/recipes/aishell/conf/seed_gpu_lora.yaml; fi
  steps=$(( steps < 20 ? steps : 20 ))
  train_run train_lora "${replayed[@]}" "${extra[@]}"
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
part_host_wait() {   # why west-train's step is longer than the benchmark's on the same configuration: the host's
  # synchronisations by source line over a run (CUDA only), then the host's time per operator in the projector,
  # splice and loss phases with the real loader, with the loop alone (the loader's first batches from memory),
  # and with the loader but Python's lock changing hands ten times as often
  log "host_wait: west-train as configured under train_syncs.py, then train_op_times.py with the loader, without it,"\
    "and with a 0.5 ms switch interval"
  local n=$(( steps < 20 ? steps : 20 ))
  steps=$n
  if [ "$device" = cuda ]; then
    trainer=("$repo/tools/train_syncs.py" --steps "$n" --md "$exp/syncs.md" --out "$out/syncs_train.json" --)
    train_run train_syncs && { echo; cat "$exp/syncs.md"; } >>"$out/suite.md"
  else
    log "host_wait: train_syncs.py needs CUDA; left out on $device"
  fi
  trainer=("$repo/tools/train_op_times.py" --md "$exp/op_times.md" --out "$out/op_times_loader.json" --)
  train_run train_op_times && { echo; echo "#### with the loader"; cat "$exp/op_times.md"; } >>"$out/suite.md"
  trainer=("$repo/tools/train_op_times.py" --preload "$n" --md "$exp/op_times.md" \
    --out "$out/op_times_preloaded.json" --)
  train_run train_op_times_preloaded && { echo; echo "#### the loop alone"; cat "$exp/op_times.md"; } >>"$out/suite.md"
  # Python's lock handed over every 0.5 ms instead of 5: if a thread beside the loop holds it, the waits shrink
  trainer=("$repo/tools/train_op_times.py" --switch_interval_ms 0.5 --md "$exp/op_times.md" \
    --out "$out/op_times_switch.json" --)
  train_run train_op_times_switch && { echo; echo "#### with the loader, switch interval 0.5 ms"; cat "$exp/op_times.md"; } \
    >>"$out/suite.md"
}
