# tools/gpu_suite.sh's profiling and checking parts: kernel checks, profiled or marked steps
# (tools/profile_step.py through profile_run), host syncs, py-spy samples, the host's floor per operator.
# Sourced by gpu_suite.sh, whose variables they read.
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
part_profile() {
  log "profile: where the GPU waits for the host, per phase of the step (tools/profile_step.py)"
  profile_run profile pack,pack_encoder_padded,static
}
part_profile_compiled() {   # train.compile cut GPU work per step by a quarter and host time hardly at all (H100)
  log "profile_compiled: the pack step's phases with train.compile true: where the compiled step's host time goes"
  profile_run profile_compiled pack --train.compile true --warmup_steps 4
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
part_optimes() {   # the benchmark's side of part optimes_train: its runner's projector and splice took 1.2 and 0.9 ms in
  # pack and 16.5 and 12 ms in pack_encoder_padded, same shapes, same process (fifth run, H200): marked, then by operator
  log "optimes: the benchmark's runner, pack and pack_encoder_padded, the encoder replayed: marked, then the host's"\
    "time in a few phases by operator and line (tools/profile_step.py --op_times)"
  profile_run op_times pack,pack_encoder_padded "${replayed[@]}" --phase_marks --op_times --steps 8
}
part_queues() {   # a stream holds about 1,000 pending launches: where the GPU is the slower side (the LLM's
  # large products) the host stops there, and cannot bank that time for the phases it paces (the encoder's
  # small kernels). CUDA_SCALE_LAUNCH_QUEUES=4x deepens the queue (a driver setting, read at CUDA's start;
  # one report of hangs on Jetson, hence the timeouts)
  # Baselines in the same call: the runner's marked steps without the variable, and part gap's train_pin_thread
  log "queues: marked benchmark steps, then with CUDA_SCALE_LAUNCH_QUEUES=4x (a 4x deeper launch queue), then west-train with it, marked"
  profile_run marks_queues_off pack --phase_marks --steps 6
  export CUDA_SCALE_LAUNCH_QUEUES=4x
  launcher=(timeout 150)
  profile_run marks_queues pack --phase_marks --steps 6
  steps=$(( steps < 20 ? steps : 20 ))   # as part gap's runs
  train_run train_queues "${replayed[@]}" --train.phase_marks true   # as part gap's train_pin_thread
}
pyspy_bin() {   # py-spy's path, or nothing (tools/gpu_wheels.sh puts its wheel into .whl/, installed into /tmp/site)
  local spy; spy=$(command -v py-spy || true)
  [ -n "$spy" ] || [ ! -x /tmp/site/bin/py-spy ] || spy=/tmp/site/bin/py-spy
  echo "$spy"
}
part_pyspy() {   # where the launching thread's time goes in C++ and the driver too (cProfile sees Python only)
  local spy warm=2 rate=20 n=$(( prof_steps * 10 ))   # sixth run (H100): at 100 a second, native unwinding fell 63 s behind in 240 s
  spy=$(pyspy_bin)
  [ -n "$spy" ] || { log "pyspy: skipped (no py-spy: tools/gpu_wheels.sh puts its wheel into .whl/)"; return 0; }
  log "pyspy: native stack samples of pack steps, the backward on the launching thread (py-spy, tools/stack_summary.py)"
  rm -f "$work_dir/pyspy_stacks.txt"
  # bounded; SIGINT, not timeout's TERM, so that py-spy still writes the samples it has (TERM loses them all)
  launcher=(timeout -s INT 150 "$spy" record --native --idle --threads --rate "$rate" --format raw -o "$work_dir/pyspy_stacks.txt" --)
  profile_run pyspy_marks pack --phase_marks --single_thread_backward --steps "$n" --warmup_steps "$warm"
  launcher=()
  [ -s "$work_dir/pyspy_stacks.txt" ] || { log "pyspy: no samples (py-spy may not be allowed to trace here: suite.log)"; return 1; }
  "$python" "$repo/tools/stack_summary.py" "$work_dir/pyspy_stacks.txt" --rate "$rate" --steps "$(( n + warm ))" \
    --out "$out/pyspy.json" | tee -a "$out/suite.md"
}
part_hostpy() {   # the graphs cut launches by 45 % and the host's time per step not at all (H200): where is it?
  log "hostpy: the pack step's Python on the launching thread (cProfile, the backward on that thread too), eager and with train.cuda_graphs (marked first)"
  profile_run hostpy pack --host_python --single_thread_backward
  profile_run hostpy_graphs pack --host_python --single_thread_backward --phase_marks --train.cuda_graphs true
}
part_encoder_time() {   # replayed, the encoder's blocks spanned 23.5 + 28 ms of the GPU per pack for ~1 ms of
  # products each way (H200), and compiling them lengthened the step (H100): kernels, or gaps between them?
  log "encoder_time: the Conformer's blocks alone at the static shape, eager, replayed, compiled and both: kernels, idle, traffic"
  # at west-train's shape where a run of this call printed it (else the tool plans one from its pack, at the built-in
  # corpus's 11,264 rows), and in the slots and bound the replay had before they were planned (seventh run)
  local shape sizes=(--compiled --baseline 256:1024)   # the CPU test leaves inductor out (tests/test_bench_encoder_time.py has it)
  $tiny && sizes=(--rows 512 --fill 400 --repeats 2 --baseline 64:256)
  read -r -a shape <<< "$(replay_shape)"
  [ "${#shape[@]}" -eq 3 ] && sizes+=(--rows "${shape[0]}" --segments "${shape[1]}" --max_len "${shape[2]}")
  "$python" "$repo/tools/encoder_gpu_time.py" --config "$conf" --device "$device" "${sizes[@]}" \
    --out "$out/encoder_time.json" 2>&1 | tee -a "$out/suite.log" | sed -n '/^### /,$p' | tee -a "$out/suite.md"
}
part_roofline() {   # part best's configuration reached 30.5 % MFU with the GPU busy 82 % (H100): inside its kernels,
  # which kinds run furthest from what their bytes and FLOPs need? Arithmetic on the CPU put that floor at ~92 ms
  # a step, 54 % MFU at most (docs/benchmarks.md, "The step's floor")
  log "roofline: part best's step, its kernels by category (a kernels-only trace) against its operators' floor"
  local kernels=()
  if [ "$device" = cuda ]; then
    profile_run roofline_kernels pack --kernels_only "${replayed[@]}" --model.llm.gradient_checkpointing false
    kernels=(--kernels "$out/roofline_kernels.json")
  fi
  "$python" "$repo/tools/step_roofline.py" --config "$conf" "${common[@]}" --llm "$llm" --data "$data/train/data.list" \
    --num_utts "$(( num_utts < prof_utts ? num_utts : prof_utts ))" --data.cmvn "$data/train/global_cmvn.json" \
    --data.batch_type pack --data.pack_tokens "$pack" "${replayed[@]}" \
    --model.llm.gradient_checkpointing false --out_dir "$exp/roofline" "${kernels[@]}" 2>>"$out/suite.log" \
    | tee -a "$out/suite.log" | sed -n '/^| per step/,/^\[step_roofline\]/p' | tee -a "$out/suite.md"
  cp "$exp/roofline/roofline.json" "$out/roofline.json"
}
part_floor() {   # ~37 µs of host time per launch over the H200's step: this machine's floor, or more?
  log "floor: host time per dispatched operator apart from any model (launch, allocation, autograd, autocast)"
  local sizes=(); $tiny && sizes=(--ops 200 --repeats 1)
  "$python" "$repo/tools/launch_floor.py" --device "$device" "${sizes[@]}" --out "$out/floor.json" | tee -a "$out/suite.md"
}
