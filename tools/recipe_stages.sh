# The stages every west recipe shares (LLM, train, decode, average, score, curves), as shell
# functions. Source it from a recipe's run.sh after its options are parsed; do not run it.
#
# The functions read the recipe's variables (Kaldi style), so each run.sh keeps its options,
# its corpus stages and its data layout, and calls these for the rest:
#   repo python config stage stop_stage           the checkout, the interpreter, the west-train config
#   data run_dir llm llm_path cmvn                data/ (data/SET/{data.list,text}), the run dir, the LLM dir,
#                                                 the CMVN JSON ("" = none: features that normalise themselves)
#   llm_vocab_size llm_pretrain_steps             the tiny LLM (stage_llm, without --llm_path)
#   batch_type batch_size max_tokens_in_batch pack_tokens max_steps seed   passed to west-train when set
#   train_threads num_workers eval_every eval_decode_utts keep_best best_metric train_opts
#   normalizer                                    text normalizer of the dev scores and the table
#   decode_sets decode_batch_size max_new_tokens beam_size average_num average_mode
#
#   recipe_paths               after the options: absolute work_dir, llm_path and config, path.sh, python
#   pick_corpus GIVEN NAME URL sets corpus (GIVEN, else WORK_DIR/corpus/{synth,download}/NAME) and
#                              synthetic (auto: a corpus already there, else whether URL answers)
#   stage_synthesize TOOL NAME WHAT   stage 0's synthesis with TOOL, skipped when the same options made it
#   runs N                     true when stage N is in stage..stop_stage
#   log MESSAGE                "[run.sh HH:MM:SS] MESSAGE"
#   online URL                 the URL answers within 3 s (a cheap reachability check)
#   stage_llm TEXT[,TEXT]      --llm_path, or a tiny tokenizer + Qwen2 pretrained on the transcripts
#   stage_train TRAIN_LIST[,..] DEV_LIST   west-train with dev evaluation, then the loss summary
#   stage_decode N             decode every set with the trained and the untrained (step-0) model
#   stage_average N            average the best checkpoints, decode every set with them
#   stage_score METRIC         tools/compute_cer.py per decode, then the untrained/trained/averaged table
#   stage_curves               tools/plot_curves.py; sets $curves to the PNG's path
# (N: the stage number the log lines name.)

log() { echo "[run.sh $(date +%H:%M:%S)] $*"; }
runs() { [ "$stage" -le "$1" ] && [ "$stop_stage" -ge "$1" ]; }

online() {  # a cheap reachability check of a download mirror (3 s)
  if command -v curl >/dev/null 2>&1; then
    curl -sfIL --max-time 3 -o /dev/null "$1"
  else
    "$python" -c "import sys, urllib.request as u; u.urlopen(u.Request(sys.argv[1], method='HEAD'), timeout=3)" \
      "$1" >/dev/null 2>&1
  fi
}

abspath() { case "$1" in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }

recipe_paths() {
  work_dir=$(abspath "$work_dir")
  [ -z "$llm_path" ] || llm_path=$(abspath "$llm_path")
  case "$config" in /*) ;; *) if [ -f "$recipe_dir/$config" ]; then config=$recipe_dir/$config; else config=$(abspath "$config"); fi ;; esac
  # shellcheck source=/dev/null
  . "$recipe_dir/path.sh"
  if [ -z "$python" ]; then
    if [ -x "$repo/.venv/bin/python" ]; then python=$repo/.venv/bin/python; else python=python3; fi
  fi
  mkdir -p "$work_dir"
}

pick_corpus() {  # pick_corpus GIVEN_DIR NAME URL (decided without the network when a corpus is already there)
  synth_root=$work_dir/corpus/synth
  download_root=$work_dir/corpus/download
  if [ -n "$1" ]; then corpus=$1; synthetic=false; return; fi
  if [ "$synthetic" = auto ]; then
    if [ -f "$synth_root/$2/synthesis.json" ]; then synthetic=true
    elif [ -d "$download_root/$2" ]; then synthetic=false
    elif online "$3"; then synthetic=false
    else log "offline (no answer from $3 within 3 s): using a synthesized corpus"; synthetic=true
    fi
  fi
  case "$synthetic" in
    true) corpus=$synth_root/$2 ;;
    false) corpus=$download_root/$2 ;;
    *) echo "run.sh: --synthetic must be auto, true or false" >&2; exit 1 ;;
  esac
}

stage_synthesize() {  # stage_synthesize TOOL NAME WHAT: TOOL (tools/synthesize_*.py) writes synth_root/NAME
  # shellcheck disable=SC2206  # synth_opts is a list of options
  local args=(--out "$synth_root" --num_train "$num_train" --num_dev "$num_dev" --num_test "$num_test"
              --num_speakers "$num_speakers" --vocab_size "$vocab_size" --seed "$synth_seed"
              --num_workers "$nj" $synth_opts) force=
  if [ "$("$python" "$repo/tools/$1" "${args[@]}" --check 2>/dev/null || true)" = True ]; then
    log "stage 0: corpus: synthesized $3 with these options, already in $synth_root/$2"
  else
    log "stage 0: corpus: synthesizing $3, $num_train/$num_dev/$num_test utterances -> $synth_root"
    [ -e "$synth_root/$2" ] && force=--force
    "$python" "$repo/tools/$1" "${args[@]}" $force
  fi
}

stage_llm() {
  if [ -n "$llm_path" ]; then
    [ -f "$llm_path/config.json" ] || { echo "run.sh: --llm_path $llm_path has no config.json" >&2; exit 1; }
    log "stage 4: using the LLM in $llm_path"
  else
    log "stage 4: tiny tokenizer (vocab $llm_vocab_size) + Qwen2 pretrained for $llm_pretrain_steps steps on the train transcripts -> $llm"
    "$python" "$repo/tools/make_tiny_llm.py" "$1" "$llm" "$llm_vocab_size" "$llm_pretrain_steps" --config "$config"
  fi
}

stage_train() {
  local opts=() name eval_opts threads
  for name in batch_type batch_size max_tokens_in_batch pack_tokens max_steps seed; do
    [ -n "${!name}" ] && opts+=("--$name" "${!name}")
  done
  eval_opts=(--cv_data "$2" --train.eval_every "$eval_every"
             --train.eval_decode_utts "$eval_decode_utts" --train.eval_max_new_tokens "$max_new_tokens"
             --train.keep_best "$keep_best" --train.best_metric "$best_metric" --train.eval_normalizer "$normalizer")
  threads=(); [ "$train_threads" -gt 0 ] && threads=(env OMP_NUM_THREADS="$train_threads")
  [ -n "$cmvn" ] && opts+=(--data.cmvn "$cmvn")
  log "stage 5: west-train -> $run_dir ${opts[*]} ${eval_opts[*]} $train_opts"
  # shellcheck disable=SC2086  # train_opts is a list of options
  "${threads[@]}" "$python" -m west.bin.train --config "$config" --model.llm.path "$llm" \
    --train_data "$1" --output_dir "$run_dir" --data.num_workers "$num_workers" \
    --train.progress_bar false "${opts[@]}" "${eval_opts[@]}" $train_opts
  "$python" "$repo/tools/loss_summary.py" "$run_dir/train_log.jsonl"
}

decode_all() {  # decode_all STAGE MODEL_DIR WHICH: every decode set -> RUN/decode_WHICH_SET/result.jsonl
  local x
  for x in $decode_sets; do
    log "stage $1: decoding $x with the $3 model"
    "$python" -m west.bin.decode --checkpoint "$2" --data "$data/$x/data.list" \
      --result "$run_dir/decode_$3_$x/result.jsonl" --batch_size "$decode_batch_size" \
      --max_new_tokens "$max_new_tokens" --beam_size "$beam_size" --normalizer "$normalizer" --quiet
  done
}

stage_decode() {
  local init=$run_dir/untrained_init
  if [ ! -f "$init/west_model.json" ]; then
    log "stage $1: exporting the untrained (step-0) model -> $init"
    "$python" "$repo/tools/export_untrained.py" "$run_dir/config.yaml" "$init"
  fi
  decode_all "$1" "$run_dir" trained
  decode_all "$1" "$init" untrained
}

stage_average() {
  local avg_dir=$run_dir/avg_$average_num
  log "stage $1: averaging the $average_num $average_mode checkpoints (by $best_metric) -> $avg_dir"
  "$python" "$repo/tools/average_checkpoints.py" "$run_dir" "$avg_dir" --num "$average_num" \
    --mode "$average_mode" --metric "$best_metric"
  decode_all "$1" "$avg_dir" averaged
}

stage_score() {  # stage_score cer|wer
  local x which d
  for x in $decode_sets; do
    for which in untrained trained averaged; do
      d=$run_dir/decode_${which}_$x
      [ -f "$d/result.jsonl" ] || continue   # averaged: only after stage 7
      "$python" "$repo/tools/compute_cer.py" "$data/$x/text" "$d/result.jsonl" --mode "$1" \
        --normalizer "$normalizer" --json "$d/$1.json" > "$d/$1.txt"
    done
  done
  # shellcheck disable=SC2086  # decode_sets is a list of set names
  "$python" "$repo/tools/error_rate_summary.py" "$run_dir" $decode_sets --metric "$1"
}

stage_curves() {
  log "stage 9: training curves -> $run_dir/curves.png"
  curves=$("$python" "$repo/tools/plot_curves.py" "$run_dir" --out "$run_dir/curves.png")
  echo "$curves"
}
