#!/usr/bin/env bash
# AIShell-1 recipe for west: corpus -> lists -> CMVN -> LLM -> train (with dev evaluation) -> decode
# -> average the best checkpoints -> CER -> curves -> benchmark.
#
# Usage: bash recipes/aishell/run.sh [--option value ...]     (from any directory)
#
# With no options on an offline machine it synthesizes a small AIShell-shaped corpus,
# trains the tiny CPU config (conf/tiny_cpu.yaml) watching the dev loss and CER, prints the CER of
# the untrained, the trained and the averaged model, the path of a PNG of the training curves and
# the batch-mode benchmark table. Outputs go to WORK_DIR/{corpus,data,exp}.
#
# Stages (each runs when stage <= N <= stop_stage):
#   0  corpus: --aishell_dir DIR (an existing data_aishell/, or the folder holding it), else
#      download AIShell-1 (openslr resource 33, data_aishell.tgz, ~15 GB) when the machine is
#      online, else (--synthetic true, the default offline) synthesize one with
#      tools/synthesize_corpus.py (eSpeak NG Mandarin in AIShell-1's layout; docs/corpus.md).
#   1  lists: tools/prepare_aishell.py -> data/{train,dev,test}/{wav.scp,text,utt2dur,data.list}
#      (data.list = jsonl with durations, written by tools/make_data_list.py).
#   2  shards (only with --shards true): tools/make_shard_list.py -> data/train/shards/shards.list;
#      stage 5 then trains on the shards (streamed epochs).
#   3  CMVN: tools/compute_cmvn.py on --cmvn_utts train utterances -> data/train/global_cmvn.json.
#   4  LLM: --llm_path DIR if given (any Hugging Face causal LM dir, e.g. Qwen2-1.5B), else a tiny
#      tokenizer (one token per Han character) + random Qwen2 built from the train transcripts,
#      then pretrained on those transcripts (text only, --llm_pretrain_steps) to copy a token
#      stream shaped like the config's projector output into its answer: the stand-in for a
#      pretrained LLM -> exp/tiny_llm.
#   5  train: west-train --config CONFIG --cv_data data/dev/data.list -> exp/EXP_NAME
#      (checkpoints, train_log.jsonl); the dev loss (and the greedy CER of --eval_decode_utts dev
#      utterances) every --eval_every steps and at epoch ends; keeps the --keep_best checkpoints
#      by --best_metric besides the newest; prints how the train and dev loss fell. Batch
#      options below are passed through when given.
#   6  decode DECODE_SETS with west-decode, with the trained model (the newest checkpoint) and
#      with the UNTRAINED model (the step-0 initialisation, same seed) -> exp/EXP_NAME/decode_*/.
#   7  average: tools/average_checkpoints.py averages the --average_num best checkpoints by
#      --best_metric (--average_mode last: the newest ones) -> exp/EXP_NAME/avg_N; decodes
#      DECODE_SETS with it -> exp/EXP_NAME/decode_averaged_*/.
#   8  score: tools/compute_cer.py --normalizer NORMALIZER for every decode; prints untrained /
#      trained / averaged CER -> exp/EXP_NAME/cer_summary.json.
#   9  curves: tools/plot_curves.py -> exp/EXP_NAME/curves.png (train and dev loss, dev CER over
#      steps); its path is printed again at the end.
#   10 benchmark: python -m west.bin.benchmark trains the same init on the same --bench_utts
#      utterances in static (32) / dynamic (4096) / pack (8192) / pack-encoder-padded modes;
#      prints the seed table, once per --bench_configs: tiny (the recipe's model, where the
#      encoder dominates) -> exp/benchmark/, llm_heavy (conf/bench_llm_heavy.yaml: the tiny
#      encoder + a frozen ~10M random Qwen2 from tools/make_seed_llm.py, where the LLM
#      dominates, as in the seed experiment) -> exp/benchmark_llm_heavy/.
#
# Options [default]:
#   --stage N / --stop_stage N    first / last stage to run [0 / 10]
#   --work_dir DIR                where corpus/, data/ and exp/ go [recipes/aishell]
#   --python PATH                 interpreter [REPO/.venv/bin/python if present, else python3]
#   --aishell_dir DIR             use this AIShell-1 data_aishell/ (stage 0 then does nothing) []
#   --synthetic auto|true|false   synthesize the corpus; auto = true when offline and no
#                                 --aishell_dir (online check: 3 s HEAD request) [auto]
#   --aishell_url URL             download source [https://www.openslr.org/resources/33/data_aishell.tgz]
#   --num_train N / --num_dev N / --num_test N   synthetic utterances per split [1500 / 100 / 100]
#   --num_speakers N              synthetic speakers [40]
#   --vocab_size N                synthetic corpus: most frequent jieba words used (60: 98 distinct
#                                 characters, each heard ~240 times in 1500 utterances) [60]
#   --synth_seed N                synthetic corpus seed [0]
#   --nj N                        worker processes for synthesis [2]
#   --synth_opts "..."            more tools/synthesize_corpus.py options, e.g. "--mean_duration 3" []
#   --shards true|false           stage 2 and train on tar shards [false]
#   --num_utts_per_shard N        [1000]
#   --cmvn_utts N                 utterances for CMVN statistics, 0 = all [500]
#   --llm_path DIR                existing LLM dir (tokenizer + weights); empty = build a tiny one []
#   --llm_vocab_size N            tiny LLM tokenizer vocabulary [1000]
#   --llm_pretrain_steps N        text-only pretraining steps of the tiny LLM, 0 = keep it random [3000]
#   --config FILE                 west-train config, relative to recipes/aishell [conf/tiny_cpu.yaml]
#   --exp_name NAME               run dir exp/NAME [tiny_cpu]
#   --batch_type static|dynamic|pack   training batches; empty = the config's []
#   --batch_size N / --max_tokens_in_batch N / --pack_tokens N   size for that batch type []
#   --max_steps N                 optimizer steps (700 = 5 epochs of the default corpus in packs of
#                                 1024 tokens); empty = the config's max_epochs [700]
#   --seed N                      training seed (model init, data order) [42]
#   --train_threads N             torch threads of west-train (OMP_NUM_THREADS), 0 = torch's default;
#                                 1 + one loader worker keeps both cores busy and is not slowed down
#                                 by other processes the way two threads are [1]
#   --num_workers N               data loader worker processes of west-train [1]
#   --eval_every N                steps between dev evaluations, 0 = at epoch ends only [100]
#   --eval_decode_utts N          dev utterances greedily decoded at each evaluation for the dev
#                                 CER (up to --max_new_tokens tokens), 0 = dev loss only [100]
#   --keep_best N                 also keep the N best checkpoints by --best_metric [3]
#   --best_metric cv_loss|cv_cer  ranks checkpoints for --keep_best and stage 7 (cv_cer needs
#                                 --eval_decode_utts > 0) [cv_cer]
#   --normalizer NAME             text normalizer of the dev CER, west-decode and stage 8: none,
#                                 mandarin (full-width to half-width, punctuation removed),
#                                 mandarin_t2s (also traditional to simplified; needs OpenCC,
#                                 tools/setup_env.sh mandarin) [mandarin]
#   --train_opts "..."            more west-train options, e.g. "--train.lr 2e-3" []
#   --decode_sets "..."           [dev test]
#   --decode_batch_size N         [32]
#   --max_new_tokens N            [40]
#   --beam_size N                 [1]
#   --average_num N               checkpoints averaged in stage 7 [3]
#   --average_mode best|last      best: lowest --best_metric; last: the newest [best]
#   --bench_utts N                benchmark: utterances per mode [200]
#   --bench_repeats N             timed passes per mode, median reported (of 2: their mean) [2]
#   --bench_modes LIST            static,dynamic,pack,pack_encoder_padded[,pack_nf] [the four]
#   --bench_threads N             torch threads for the benchmark, 0 = torch's default [1]
#   --bench_configs LIST          tiny,llm_heavy (see stage 10) [tiny,llm_heavy]
#   --bench_opts "..."            more benchmark options [--no-count_ops]; --count_ops adds the dispatched
#                                 operators per step (about 4 more minutes on a 2-core VM)
#   -h, --help                    this text

set -euo pipefail

recipe_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$recipe_dir/../.." && pwd)

stage=0
stop_stage=10
work_dir=$recipe_dir
python=
aishell_dir=
synthetic=auto
aishell_url=https://www.openslr.org/resources/33/data_aishell.tgz
num_train=1500
num_dev=100
num_test=100
num_speakers=40
vocab_size=60
synth_seed=0
nj=2
synth_opts=
shards=false
num_utts_per_shard=1000
cmvn_utts=500
llm_path=
llm_vocab_size=1000
llm_pretrain_steps=3000
config=conf/tiny_cpu.yaml
exp_name=tiny_cpu
batch_type=
batch_size=
max_tokens_in_batch=
pack_tokens=
max_steps=700
seed=42
train_threads=1
num_workers=1
eval_every=100
eval_decode_utts=100
keep_best=3
best_metric=cv_cer
normalizer=mandarin
train_opts=
decode_sets="dev test"
decode_batch_size=32
max_new_tokens=40
beam_size=1
average_num=3
average_mode=best
bench_utts=200
bench_repeats=2
bench_modes=static,dynamic,pack,pack_encoder_padded
bench_threads=1
bench_configs=tiny,llm_heavy
bench_opts=--no-count_ops

. "$repo/tools/parse_options.sh" || exit 1
if [ $# -gt 0 ]; then echo "run.sh: unexpected argument '$1' (see --help)" >&2; exit 1; fi

. "$repo/tools/recipe_stages.sh"   # the stages and helpers shared with recipes/librispeech
recipe_paths
[ -z "$aishell_dir" ] || aishell_dir=$(abspath "$aishell_dir")
data=$work_dir/data
exp=$work_dir/exp
run_dir=$exp/$exp_name
llm=${llm_path:-$exp/tiny_llm}
cmvn=$data/train/global_cmvn.json
pick_corpus "$aishell_dir" data_aishell "$aishell_url"

if runs 0; then
  if [ -n "$aishell_dir" ]; then
    [ -d "$aishell_dir" ] || { echo "run.sh: --aishell_dir $aishell_dir does not exist" >&2; exit 1; }
    log "stage 0: using the corpus in $aishell_dir"
  elif [ "$synthetic" = true ]; then
    stage_synthesize synthesize_corpus.py data_aishell "Mandarin (eSpeak NG)"
  else
    mkdir -p "$download_root"
    if [ ! -d "$download_root/data_aishell/transcript" ]; then
      log "stage 0: downloading $aishell_url (~15 GB) -> $download_root"
      curl -fL -C - -o "$download_root/data_aishell.tgz" "$aishell_url"
      tar -xzf "$download_root/data_aishell.tgz" -C "$download_root"
    fi
    log "stage 0: AIShell-1 in $download_root/data_aishell (speaker archives are extracted in stage 1)"
  fi
fi

if runs 1; then
  log "stage 1: lists from $corpus -> $data"
  "$python" "$repo/tools/prepare_aishell.py" --aishell_dir "$corpus" --out_dir "$data" --jsonl --untar
fi

train_list=$data/train/data.list
if [ "$shards" = true ]; then train_list=$data/train/shards/shards.list; fi
if runs 2 && [ "$shards" = true ]; then
  log "stage 2: tar shards -> $data/train/shards"
  "$python" "$repo/tools/make_shard_list.py" "$data/train/data.list" "$data/train/shards" \
    --num_utts_per_shard "$num_utts_per_shard"
fi

if runs 3; then
  log "stage 3: CMVN over $cmvn_utts train utterances -> $cmvn"
  "$python" "$repo/tools/compute_cmvn.py" "$data/train/data.list" "$cmvn" --num_utts "$cmvn_utts"
fi

# (if, not &&: bash ignores set -e inside a function called on the left of &&)
if runs 4; then stage_llm "$data/train/text"; fi
if runs 5; then stage_train "$train_list" "$data/dev/data.list"; fi
if runs 6; then stage_decode 6; fi
if runs 7; then stage_average 7; fi
if runs 8; then stage_score cer; fi
curves=
if runs 9; then stage_curves; fi

if runs 10; then
  for bench in ${bench_configs//,/ }; do
    case $bench in
      tiny) bench_conf=$config; bench_llm=$llm; bench_out=$exp/benchmark ;;
      llm_heavy)
        bench_conf=$recipe_dir/conf/bench_llm_heavy.yaml; bench_llm=$exp/bench_llm; bench_out=$exp/benchmark_llm_heavy
        [ -f "$bench_llm/config.json" ] || "$python" "$repo/tools/make_seed_llm.py" "$bench_llm" \
          --tokenizer "$llm" --shape bench-10m --dtype float32 ;;
      *) echo "run.sh: --bench_configs: unknown configuration '$bench' (tiny, llm_heavy)" >&2; exit 1 ;;
    esac
    log "stage 10: benchmark ($bench) on $bench_utts utterances ($bench_modes) -> $bench_out"
    # shellcheck disable=SC2086
    "$python" -m west.bin.benchmark --config "$bench_conf" --model.llm.path "$bench_llm" --data.cmvn "$cmvn" \
      --data "$data/train/data.list" --num_utts "$bench_utts" --out_dir "$bench_out" \
      --repeats "$bench_repeats" --modes "$bench_modes" --threads "$bench_threads" $bench_opts
  done
fi
[ -n "$curves" ] && log "training curves (train and dev loss, dev CER): $curves"
log "done (stages $stage..$stop_stage)"
