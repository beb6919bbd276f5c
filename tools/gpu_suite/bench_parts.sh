# tools/gpu_suite.sh's west-benchmark parts: the seed's table under a memory budget, the benchmark's step
# at fixed sizes (headroom, best, graphs) and the Whisper-large-v3 + Qwen2-7B pair (big). Sourced by
# gpu_suite.sh, whose variables they read.
part_bench() {
  log "bench: west-benchmark, each mode at its largest size under $memory_budget, $num_utts utterances"
  budget=(--memory_budget "$memory_budget" --repeats 2)
  $tiny && budget=(--memory_budget 2GiB --repeats 1)
  "$python" -m west.bin.benchmark --config "$conf" "${common[@]}" --data "$data/train/data.list" \
    --data.cmvn "$data/train/global_cmvn.json" --num_utts "$num_utts" --out_dir "$exp/bench" \
    --batch_size "$batch" --max_tokens_in_batch "$max_tokens" --pack_tokens "$pack" --profile never \
    --no-count_ops "${budget[@]}" >>"$out/suite.log" 2>&1
  cp "$exp/bench/benchmark.json" "$out/benchmark.json"
  cp "$exp/bench/benchmark.md" "$out/benchmark.md"
  tail -n 40 "$out/benchmark.md"
}
part_headroom() {   # item 6's two open comparisons: the benchmark's step at west-train's size, and MFU
  # without the LLM's checkpoint replay (31 % of the FLOPs under 24 GiB) at the largest pack the card holds
  log "headroom: west-benchmark pack at $pack (west-train's size); pack, LLM checkpointing off, largest under the card"
  local gran=4096 card=card reps=2; $tiny && { gran=256; card=2GiB; reps=1; }
  "$python" -m west.bin.benchmark --config "$conf" "${common[@]}" --data "$data/train/data.list" \
    --data.cmvn "$data/train/global_cmvn.json" --num_utts "$num_utts" --out_dir "$exp/bench_fixed" \
    --modes pack --pack_tokens "$pack" --repeats "$reps" --profile never --no-count_ops >>"$out/suite.log" 2>&1
  bench_vs_train "$exp/bench_fixed/benchmark.json" "$exp/train_eager"
  "$python" -m west.bin.benchmark --config "$conf" "${common[@]}" --data "$data/train/data.list" \
    --data.cmvn "$data/train/global_cmvn.json" --num_utts "$num_utts" --out_dir "$exp/bench_headroom" \
    --modes pack --pack_tokens "$pack" --repeats "$reps" --profile never --memory_budget "$card" --no-count_ops \
    --search_granularity "$gran" --model.llm.gradient_checkpointing false >>"$out/suite.log" 2>&1
  cp "$exp/bench_headroom/benchmark.md" "$out/benchmark_headroom.md"
  head -n 4 "$out/benchmark_headroom.md" | tee -a "$out/suite.md"
}
bench_vs_train() {   # benchmark.json, a west-train run's dir (absent: the benchmark's line only): the pack
  # step of each, and west-train's as a multiple of the benchmark's (issue 23: within 10 %)
  "$python" - "$1" "$2" <<'EOF2' | tee -a "$out/suite.md"
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
}
best_run() {   # name, extra args...: west-benchmark pack $pack, the encoder's blocks replayed, the LLM's
  # checkpointing off, no cap, 2 timed passes; its table into OUT/benchmark_<name>.md
  local name=$1 reps=2; shift
  $tiny && reps=1
  "$python" -m west.bin.benchmark --config "$conf" "${common[@]}" --data "$data/train/data.list" \
    --data.cmvn "$data/train/global_cmvn.json" --num_utts "$num_utts" --out_dir "$exp/bench_$name" \
    --modes pack --pack_tokens "$pack" --repeats "$reps" --profile never --no-count_ops \
    "${replayed[@]}" --model.llm.gradient_checkpointing false "$@" >>"$out/suite.log" 2>&1
  cp "$exp/bench_$name/benchmark.md" "$out/benchmark_$name.md"
  head -n 3 "$out/benchmark_$name.md" | tee -a "$out/suite.md"
}
part_best() {   # item 6's MFU and GPU-busy targets at the fastest west-train configuration so far (fifth run,
  # H200: 0.227 s per step): the encoder's blocks replayed, the LLM's checkpointing off, pack 8192, no cap
  log "best: west-benchmark pack $pack with train.encoder_graphs and model.llm.gradient_checkpointing false"
  best_run best
}
part_best_sizes() {   # part best's configuration at 2x and 3x the pack (the seed's method: the largest size the card
  # holds). The step's host work hardly grows with the pack (the same operators), its kernels grow with the tokens:
  # if the host is what idles the GPU, GPU busy rises towards 100 % and MFU towards the kernels' own ceiling (about
  # 43 %, seventh run's roofline); if GPU busy stays where part best has it, host work grows with the pack (third
  # run, eager: about 70 % busy from 8,192 to 24,576) and its "host ms per step" line says in which part of the step
  local k name
  for k in 2 3; do
    name=best_${k}x
    log "best_sizes: part best's benchmark at pack $(( pack * k )) on $(( num_utts * k )) utterances"
    printf '\n#### %s: part best at pack %s\n\n' "$name" $(( pack * k )) >>"$out/suite.md"
    if num_utts=$(( num_utts * k )) best_run "$name" --pack_tokens $(( pack * k )); then
      sed -n '4,$p' "$out/benchmark_$name.md" >>"$out/suite.md"
    else
      log "best_sizes: pack $(( pack * k )) failed (out of memory on this card?): see suite.log"
    fi
    rm -f "$out/benchmark_$name.md"   # its table is in suite.md: the device tool returns 8 files at most
  done
}
part_swiglu() {   # model.llm.fused_swiglu (never on a GPU yet): the MLPs' elementwise work as one compiled kernel each
  # way, 1.2 GB less traffic per layer per step by arithmetic, gate and up kept without silu(gate) (no checkpointing)
  log "swiglu: the MLP alone (tools/bench_swiglu.py), then part best's benchmark and west-train as configured (part"\
    "late_readback's train_readback), each with model.llm.fused_swiglu true"
  local sizes=(); $tiny && sizes=(--rows 256 --hidden 64 --intermediate 256 --repeats 2)
  "$python" "$repo/tools/bench_swiglu.py" --device "$device" "${sizes[@]}" --out "$out/swiglu.json" 2>&1 \
    | tee -a "$out/suite.log" | sed -n '/^### /,$p' | tee -a "$out/suite.md"
  # seventh run: the host queued 178 ms per step with it against 105 without, using 3x the CPU; dynamo's recompiles?
  local before; before=$(grep -c "Recompiling function" "$out/suite.log" || true)
  TORCH_LOGS=recompiles best_run best_swiglu --model.llm.fused_swiglu true
  echo "- dynamo recompilations in best_swiglu's benchmark (TORCH_LOGS=recompiles):" \
    "$(( $(grep -c "Recompiling function" "$out/suite.log" || true) - before ))" | tee -a "$out/suite.md"
  [ -f "$exp/bench_best/benchmark.md" ] && sed -n 3p "$exp/bench_best/benchmark.md" | sed 's/^/(part best, without:) /' \
    | tee -a "$out/suite.md"
  steps=$(( steps < 20 ? steps : 20 ))
  train_run train_fused_swiglu "${replayed[@]}" --model.llm.fused_swiglu true
}
part_encoder_graphs_compiled() {   # replayed, the encoder's blocks still cost the GPU 28.9 ms of kernels per forward
  # + backward (seventh run): thousands of small kernels. Compiled before the capture, the graphs replay inductor's
  # fused ones (the depthwise convolution now one custom operator: its shifted products' backward took 20.7 ms):
  # part best's benchmark again with the blocks compiled, same call
  log "encoder_graphs_compiled: part best's benchmark with the encoder's blocks compiled (train.compile_scope encoder), then replayed"
  best_run compiled --train.compile true --train.compile_scope encoder
  { grep -h "graphs compiled over each mode" "$out/benchmark_compiled.md" || true; } | tee -a "$out/suite.md"
  [ -f "$exp/bench_best/benchmark.md" ] && sed -n 3p "$exp/bench_best/benchmark.md" | sed 's/^/(part best, without:) /' \
    | tee -a "$out/suite.md"
  return 0
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
big_models() {   # random Whisper-large-v3 and Qwen2-7B shapes (tiny: Whisper-tiny and the seed LLM) into wdir, qdir
  big=$repo/recipes/aishell/conf/whisper_7b_lora.yaml
  wdir=$exp/whisper_large_v3; qdir=$exp/qwen2_7b
  $tiny && { wdir=$exp/whisper_tiny; qdir=$llm; }
  log "big: random Whisper-large-v3 and Qwen2-7B shapes"
  [ -f "$wdir/config.json" ] || "$python" "$repo/tools/make_random_whisper.py" "$wdir" \
    --shape "$($tiny && echo tiny || echo large-v3)" --device "$device" >>"$out/suite.log" 2>&1
  [ -f "$qdir/config.json" ] || "$python" "$repo/tools/make_seed_llm.py" "$qdir" --tokenizer "$exp/tiny_llm" \
    --shape qwen2-7b --device "$device" >>"$out/suite.log" 2>&1
  conf=$big common=(--model.encoder.path "$wdir" --model.llm.path "$qdir" --train.device "$device")
}
big_bench() {   # pack against Whisper padded to 30 s at sizes found under 80 GiB on one H200 (2026-11-27: pack
  # 16,384 tokens 40.1 GiB, Whisper padded batch 128 72.5 GiB); searching them again takes over 4 minutes
  local big_pack=16384 big_batch=128; $tiny && { big_pack=$pack; big_batch=$batch; }
  log "big: west-benchmark pack $big_pack tokens vs whisper_padded_30s batch $big_batch (sizes that fit 80 GiB)"
  "$python" -m west.bin.benchmark --config "$big" "${common[@]}" --data "$data/train/data.list" --data.cmvn null \
    --num_utts "$(( num_utts < 200 ? num_utts : 200 ))" --out_dir "$exp/bench_big" --repeats 2 --profile never \
    --modes pack,whisper_padded_30s --pack_tokens "$big_pack" --batch_size "$big_batch" --no-count_ops \
    >>"$out/suite.log" 2>&1
  cp "$exp/bench_big/benchmark.md" "$out/benchmark_big.md"
  tail -n 20 "$out/benchmark_big.md"
}
part_big() {   # fits 40 GiB at pack 8192 (west-train), then the timed pack vs Whisper padded to 30 s
  big_models
  steps=$(( steps < 12 ? steps : 12 ))
  train_run big_pack --data.cmvn null
  big_bench
}
part_big_bench() {   # part big's timed comparison alone (its west-train run measured 31.4 GiB twice)
  big_models
  big_bench
}
part_loss() {   # the loss phases took the H100 8.0 + 12.5 ms of each pack (sixth run's marks) for ~2 ms of products
  log "loss: the LLM's cross-entropy alone at the seed's shapes: chunked (gradients in its forward) against plain,"\
    "Liger-Kernel and cut-cross-entropy (.whl/loss/, installed for this part only)"
  local site=/tmp/site_loss sizes=(--rows 1500,3000)
  $tiny && sizes=(--rows 64 --hidden 32 --vocab 1000 --repeats 1)
  if ls "$repo"/.whl/loss/*.whl >/dev/null 2>&1; then   # kept out of the other parts: auto would pick them up
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
      "$repo"/.whl/loss/*.whl >>"$out/suite.log" 2>&1 || log "loss: the libraries' wheels did not install"
  fi
  PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} "$python" "$repo/tools/bench_loss.py" --device "$device" "${sizes[@]}" \
    --out "$out/loss.json" 2>&1 | tee -a "$out/suite.log" | sed -n '/^### /,$p' | tee -a "$out/suite.md"
}
part_configured() {   # issue 23's "west-train within 10 % of the benchmark" for seed_gpu.yaml as it now runs on
  # one GPU (the encoder replayed, the LLM's MLPs checkpointed, late read-back): 1.42x in the seventh run, whose
  # benchmark still read each step back
  log "configured: west-benchmark pack $pack as west-train runs it on one GPU (encoder replayed, LLM checkpointing"\
    "as configured, each step's figures read a step late), against late_readback's train_late_readback"
  local reps=2; $tiny && reps=1
  if [ ! -f "$exp/train_late_readback/train_log.jsonl" ]; then   # part late_readback's run, when it has not run yet
    log "configured: west-train as configured first (part late_readback's train_late_readback run)"
    local steps=$(( steps < 20 ? steps : 20 ))
    train_run train_late_readback "${replayed[@]}" --train.late_readback true || log "configured: west-train FAILED"
  fi
  # the replay at west-train's shape (its plan's fullest packs), not at the fullest of the benchmark's fewer packs
  local sizes same=()
  read -r -a sizes <<< "$(replay_shape)"
  if [ "${#sizes[@]}" -eq 3 ]; then
    same=(--train.encoder_graph_rows "${sizes[0]}" --train.encoder_graph_segments "${sizes[1]}"
          --train.encoder_graph_max_len "${sizes[2]}")
    log "configured: the encoder replayed at west-train's ${sizes[0]} rows in ${sizes[1]} segments of at most ${sizes[2]}"
  fi
  "$python" -m west.bin.benchmark --config "$conf" "${common[@]}" --data "$data/train/data.list" \
    --data.cmvn "$data/train/global_cmvn.json" --num_utts "$num_utts" --out_dir "$exp/bench_configured" \
    --modes pack --pack_tokens "$pack" --repeats "$reps" --profile never --no-count_ops \
    "${replayed[@]}" ${same[@]+"${same[@]}"} >>"$out/suite.log" 2>&1
  bench_vs_train "$exp/bench_configured/benchmark.json" "$exp/train_late_readback"
}
