# tools/gpu_suite.sh's west-benchmark parts: the seed's table under a memory budget, the attention kernels'
# check, the benchmark at west-train's configuration and at the fastest one, and the Whisper-large-v3 +
# Qwen2-7B pair. Sourced by gpu_suite.sh, whose variables they read.
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
bench_vs_train() {   # benchmark.json, a west-train run's dir (absent: the benchmark's line only): the pack
  # step of each, and west-train's as a multiple of the benchmark's (target: within 10 %)
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
part_best() {   # the MFU and GPU-busy targets at the fastest configuration: the encoder's blocks replayed,
  # the LLM's checkpointing off, pack 8192, no memory cap
  log "best: west-benchmark pack $pack with train.encoder_graphs and model.llm.gradient_checkpointing false"
  best_run best
}
part_configured() {   # like for like: west-train's step against the benchmark's on the same configuration
  # (seed_gpu.yaml on one GPU: the encoder replayed, the LLM's MLPs checkpointed, figures read a step late)
  log "configured: west-benchmark pack $pack as west-train runs it on one GPU, against part train's train_configured"
  local reps=2; $tiny && reps=1
  if [ ! -f "$exp/train_configured/train_log.jsonl" ]; then   # part train has not run in this call
    log "configured: west-train as configured first (part train)"
    part_train || log "configured: west-train FAILED"
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
  bench_vs_train "$exp/bench_configured/benchmark.json" "$exp/train_configured"
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
  log "big: west-benchmark pack vs whisper_padded_30s (sizes that fit 80 GiB)"
  if pair_benchmark "$big" "$exp/bench_big"; then
    cp "$exp/bench_big/benchmark.md" "$out/benchmark_big.md"
    tail -n 20 "$out/benchmark_big.md"
  fi
}
pair_benchmark() {   # config, out dir, extra args...: a 7B pair's west-benchmark, pack 16,384 tokens against
  # its 30 s-window tower padded at batch 128 (tiny: the suite's toy sizes)
  local big_pack=16384 big_batch=128 config=$1 dir=$2; shift 2
  $tiny && { big_pack=$pack; big_batch=$batch; }
  "$python" -m west.bin.benchmark --config "$config" "${common[@]}" "$@" --data "$data/train/data.list" \
    --data.cmvn null --num_utts "$(( num_utts < 200 ? num_utts : 200 ))" --out_dir "$dir" --repeats 2 \
    --profile never --modes pack,whisper_padded_30s --pack_tokens "$big_pack" --batch_size "$big_batch" \
    --no-count_ops >>"$out/suite.log" 2>&1
}
released_part() {   # model.type, its LoRA recipe config, west-benchmark modes: a released speech LLM's
  # published shape with random bf16 weights (tiny: a toy one), LoRA on the LLM, its audio tower trained,
  # timed in the modes given (pack 16,384 tokens, static batch 64, dynamic 16,384 tokens; tiny: the toy sizes)
  local type=$1 config=$repo/recipes/aishell/conf/$2 modes=$3 size=release dir=$exp/${1}_release
  $tiny && { size=tiny; dir=$exp/${1}_tiny; }
  log "$type: random $type ($size), west-benchmark $modes"
  [ -f "$dir/config.json" ] || "$python" "$repo/tools/make_random_released.py" "$type" "$dir" --shape "$size" \
    --device "$device" >>"$out/suite.log" 2>&1
  local common=(--train.device "$device")   # the directory is the model: no model.llm.path
  if [ "$modes" = pack,whisper_padded_30s ]; then
    pair_benchmark "$config" "$exp/bench_$type" --model.path "$dir"
  else
    local p=16384 b=64 m=16384
    $tiny && { p=$pack; b=$batch; m=$max_tokens; }
    "$python" -m west.bin.benchmark --config "$config" "${common[@]}" --model.path "$dir" \
      --data "$data/train/data.list" --data.cmvn null --num_utts "$(( num_utts < 200 ? num_utts : 200 ))" \
      --out_dir "$exp/bench_$type" --repeats 2 --profile never --modes "$modes" --pack_tokens "$p" \
      --batch_size "$b" --max_tokens_in_batch "$m" --no-count_ops >>"$out/suite.log" 2>&1
  fi
  # one file for every released model's table: a call returns at most 8 files
  { printf '\n## %s (%s shape)\n\n' "$type" "$size"; cat "$exp/bench_$type/benchmark.md"; } >>"$out/benchmark_released.md"
  tail -n 20 "$exp/bench_$type/benchmark.md"
}
part_qwen2_audio() {   # Qwen2-Audio-7B: its Whisper-style tower packed against padded to its 30 s window
  released_part qwen2_audio qwen2_audio_lora.yaml pack,whisper_padded_30s
}
part_qwen3_asr() {   # Qwen3-ASR-1.7B (no 30 s window: its tower reads 1 s chunks): pack against the padded batches
  released_part qwen3_asr qwen3_asr_lora.yaml static,dynamic,pack
}
part_qwen2_5_omni() {   # Qwen2.5-Omni-7B's thinker (its tower reads 2 s chunks): pack against the padded batches
  released_part qwen2_5_omni qwen2_5_omni_lora.yaml static,dynamic,pack
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
