#!/usr/bin/env bash
# LibriSpeech recipe for west: corpus -> lists -> CMVN -> LLM -> train (with dev evaluation) ->
# decode -> average the best checkpoints -> WER -> curves.
#
# Usage: bash recipes/librispeech/run.sh [--option value ...]     (from any directory)
#
# With no options on an offline machine it synthesizes a small English corpus in LibriSpeech's
# layout, trains the tiny CPU config (conf/tiny_cpu.yaml) watching the dev loss and WER, and
# prints the WER of the untrained, the trained and the averaged model after Whisper's English
# normalization, and the path of a PNG of the training curves. Outputs go to
# WORK_DIR/{corpus,data,exp}. Stages 4-9 are the AIShell recipe's (tools/recipe_stages.sh).
#
# Stages (each runs when stage <= N <= stop_stage):
#   0  corpus: --data_root DIR (a LibriSpeech/ folder, or the folder holding it), else download
#      TRAIN_SETS, DEV_SET and TEST_SETS from openslr resource 12 when the machine is online,
#      else (--synthetic true, the default offline) synthesize one with
#      tools/synthesize_librispeech.py (eSpeak NG English voices, FLAC + .trans.txt in
#      LibriSpeech's layout: train-clean-100, dev-clean, test-clean). Prints which corpus it used.
#   1  lists: tools/prepare_librispeech.py -> data/SET/{wav.scp,text,utt2dur,data.list,skipped.txt}
#      per subset (dev-clean -> data/dev_clean); transcripts lower-cased (--case); a chapter
#      without .trans.txt, a FLAC without a transcript line, a line without a FLAC, an unreadable
#      FLAC are counted, named and left out.
#   2  shards (only with --shards true): tools/make_shard_list.py per train subset; stage 5
#      then trains on the shards (streamed epochs).
#   3  CMVN (with --cmvn true): tools/compute_cmvn.py on --cmvn_utts utterances of the first train
#      subset; --cmvn false for a config whose features normalise themselves (data.features whisper).
#   4  LLM: --llm_path DIR if given (any Hugging Face causal LM dir, e.g. Qwen2-1.5B-Instruct),
#      else a tiny byte-level BPE tokenizer (--llm_vocab_size: English words become subword
#      pieces) + random Qwen2 built from the train transcripts and pretrained on them (text
#      only, --llm_pretrain_steps): the stand-in for a pretrained LLM -> exp/tiny_llm.
#   5  train: west-train --config CONFIG --cv_data data/DEV/data.list -> exp/EXP_NAME; the dev
#      loss and the greedy WER (and CER) of --eval_decode_utts dev utterances after
#      --normalizer every --eval_every steps; keeps the --keep_best checkpoints by --best_metric.
#   6  decode DECODE_SETS with west-decode, with the trained model (the newest checkpoint) and
#      with the UNTRAINED model (the step-0 initialisation, same seed) -> exp/EXP_NAME/decode_*/.
#   7  average: tools/average_checkpoints.py averages the --average_num best checkpoints by
#      --best_metric -> exp/EXP_NAME/avg_N; decodes DECODE_SETS with it.
#   8  score: tools/compute_cer.py --mode wer --normalizer NORMALIZER for every decode (the
#      result files keep the raw texts); prints untrained / trained / averaged WER and the
#      normalizer -> exp/EXP_NAME/wer_summary.json.
#   9  curves: tools/plot_curves.py -> exp/EXP_NAME/curves.png (train and dev loss, dev CER
#      and WER over steps); its path is printed again at the end.
#
# Options [default]:
#   --stage N / --stop_stage N    first / last stage to run [0 / 9]
#   --work_dir DIR                where corpus/, data/ and exp/ go [recipes/librispeech]
#   --python PATH                 interpreter [REPO/.venv/bin/python if present, else python3]
#   --data_root DIR               use this LibriSpeech/ (stage 0 then does nothing) []
#   --synthetic auto|true|false   synthesize the corpus; auto = true when offline and no
#                                 --data_root (online check: 3 s HEAD request) [auto]
#   --librispeech_url URL         download source, SUBSET.tar.gz under it [https://www.openslr.org/resources/12]
#   --train_sets "..."            train subsets, e.g. "train-clean-100 train-clean-360 train-other-500" [train-clean-100]
#   --dev_set NAME                the dev subset evaluated during training [dev-clean]
#   --test_sets "..."             test subsets [test-clean]
#   --case lower|keep             transcript case in the lists [lower]
#   --num_train N / --num_dev N / --num_test N   synthetic utterances per subset [3000 / 100 / 100]
#   --num_speakers N              synthetic speakers [40]
#   --vocab_size N                synthetic corpus: the first N words of tools/synthesize_librispeech.py's list [60]
#   --synth_seed N                synthetic corpus seed [0]
#   --nj N                        worker processes for synthesis [2]
#   --synth_opts "..."            more tools/synthesize_librispeech.py options, e.g. "--mean_duration 3" []
#   --shards true|false           stage 2 and train on tar shards [false]
#   --num_utts_per_shard N        [1000]
#   --cmvn true|false             stage 3 and global CMVN of the fbank features [true]
#   --cmvn_utts N                 utterances for CMVN statistics, 0 = all [500]
#   --llm_path DIR                existing LLM dir (tokenizer + weights); empty = build a tiny one []
#   --llm_vocab_size N            tiny LLM tokenizer vocabulary [600]
#   --llm_pretrain_steps N        text-only pretraining steps of the tiny LLM, 0 = keep it random [3000]
#   --config FILE                 west-train config, relative to recipes/librispeech [conf/tiny_cpu.yaml]
#   --exp_name NAME               run dir exp/NAME [tiny_cpu]
#   --batch_type static|dynamic|pack   training batches; empty = the config's []
#   --batch_size N / --max_tokens_in_batch N / --pack_tokens N   size for that batch type []
#   --max_steps N                 optimizer steps (1800: about 7 epochs of the default corpus in
#                                 packs of 1024 tokens); empty = the config's max_epochs [1800]
#   --seed N                      training seed (model init, data order) [42]
#   --train_threads N             torch threads of west-train (OMP_NUM_THREADS), 0 = torch's default [1]
#   --num_workers N               data loader worker processes of west-train [1]
#   --eval_every N                steps between dev evaluations, 0 = at epoch ends only [100]
#   --eval_decode_utts N          dev utterances greedily decoded at each evaluation for the dev
#                                 WER (up to --max_new_tokens tokens), 0 = dev loss only [100]
#   --keep_best N                 also keep the N best checkpoints by --best_metric [3]
#   --best_metric cv_loss|cv_cer|cv_wer   ranks checkpoints for --keep_best and stage 7 [cv_wer]
#   --normalizer NAME             text normalizer of the dev WER, west-decode and stage 8: english
#                                 (Whisper's English normalization), none [english]
#   --train_opts "..."            more west-train options, e.g. "--train.lr 2e-3" []
#   --decode_sets "..."           data/ sets decoded in stages 6-8; empty = DEV_SET and TEST_SETS []
#   --decode_batch_size N         [32]
#   --max_new_tokens N            [100]
#   --beam_size N                 [1]
#   --average_num N               checkpoints averaged in stage 7 [3]
#   --average_mode best|last      best: lowest --best_metric; last: the newest [best]
#   -h, --help                    this text

set -euo pipefail

recipe_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$recipe_dir/../.." && pwd)

stage=0
stop_stage=9
work_dir=$recipe_dir
python=
data_root=
synthetic=auto
librispeech_url=https://www.openslr.org/resources/12
train_sets=train-clean-100
dev_set=dev-clean
test_sets=test-clean
case=lower
num_train=3000
num_dev=100
num_test=100
num_speakers=40
vocab_size=60
synth_seed=0
nj=2
synth_opts=
shards=false
num_utts_per_shard=1000
cmvn=true
cmvn_utts=500
llm_path=
llm_vocab_size=600
llm_pretrain_steps=3000
config=conf/tiny_cpu.yaml
exp_name=tiny_cpu
batch_type=
batch_size=
max_tokens_in_batch=
pack_tokens=
max_steps=1800
seed=42
train_threads=1
num_workers=1
eval_every=100
eval_decode_utts=100
keep_best=3
best_metric=cv_wer
normalizer=english
train_opts=
decode_sets=
decode_batch_size=32
max_new_tokens=100
beam_size=1
average_num=3
average_mode=best

. "$repo/tools/parse_options.sh" || exit 1
if [ $# -gt 0 ]; then echo "run.sh: unexpected argument '$1' (see --help)" >&2; exit 1; fi

. "$repo/tools/recipe_stages.sh"   # the stages and helpers shared with recipes/aishell
recipe_paths
[ -z "$data_root" ] || data_root=$(abspath "$data_root")
dir_of() { echo "${1//-/_}"; }   # dev-clean -> dev_clean, the data/ folder of a subset
data=$work_dir/data
exp=$work_dir/exp
run_dir=$exp/$exp_name
llm=${llm_path:-$exp/tiny_llm}
first_train=$(dir_of "${train_sets%% *}")
case "$cmvn" in
  true) cmvn=$data/$first_train/global_cmvn.json ;;
  false) cmvn= ;;
  *) echo "run.sh: --cmvn must be true or false" >&2; exit 1 ;;
esac
[ -n "$decode_sets" ] || decode_sets=$(for x in $dev_set $test_sets; do dir_of "$x"; done | xargs)
pick_corpus "$data_root" LibriSpeech "$librispeech_url/$dev_set.tar.gz"

if runs 0; then
  if [ -n "$data_root" ]; then
    [ -d "$data_root" ] || { echo "run.sh: --data_root $data_root does not exist" >&2; exit 1; }
    log "stage 0: corpus: the LibriSpeech folder $data_root (--data_root)"
  elif [ "$synthetic" = true ]; then
    stage_synthesize synthesize_librispeech.py LibriSpeech "English (eSpeak NG)"
  else
    mkdir -p "$download_root"
    for x in $train_sets $dev_set $test_sets; do
      if [ ! -f "$download_root/LibriSpeech/.$x.done" ]; then
        log "stage 0: downloading $librispeech_url/$x.tar.gz -> $download_root"
        curl -fL -C - -o "$download_root/$x.tar.gz" "$librispeech_url/$x.tar.gz"
        tar -xzf "$download_root/$x.tar.gz" -C "$download_root"
        touch "$download_root/LibriSpeech/.$x.done"
      fi
    done
    log "stage 0: corpus: LibriSpeech ($train_sets $dev_set $test_sets) in $download_root/LibriSpeech"
  fi
fi

if runs 1; then
  log "stage 1: lists from $corpus -> $data"
  # shellcheck disable=SC2086  # the set variables are lists of subsets
  "$python" "$repo/tools/prepare_librispeech.py" --data_root "$corpus" --out_dir "$data" \
    --subsets $train_sets $dev_set $test_sets --case "$case"
fi

train_list=$(for x in $train_sets; do echo "$data/$(dir_of "$x")/data.list"; done | paste -sd, -)
train_text=$(for x in $train_sets; do echo "$data/$(dir_of "$x")/text"; done | paste -sd, -)
if [ "$shards" = true ]; then
  train_list=$(for x in $train_sets; do echo "$data/$(dir_of "$x")/shards/shards.list"; done | paste -sd, -)
fi
if runs 2 && [ "$shards" = true ]; then
  for x in $train_sets; do
    log "stage 2: tar shards -> $data/$(dir_of "$x")/shards"
    "$python" "$repo/tools/make_shard_list.py" "$data/$(dir_of "$x")/data.list" "$data/$(dir_of "$x")/shards" \
      --num_utts_per_shard "$num_utts_per_shard"
  done
fi

if runs 3 && [ -n "$cmvn" ]; then
  log "stage 3: CMVN over $cmvn_utts $first_train utterances -> $cmvn"
  "$python" "$repo/tools/compute_cmvn.py" "$data/$first_train/data.list" "$cmvn" --num_utts "$cmvn_utts"
fi

# (if, not &&: bash ignores set -e inside a function called on the left of &&)
if runs 4; then stage_llm "$train_text"; fi
if runs 5; then stage_train "$train_list" "$data/$(dir_of "$dev_set")/data.list"; fi
if runs 6; then stage_decode 6; fi
if runs 7; then stage_average 7; fi
if runs 8; then stage_score wer; fi
curves=
if runs 9; then stage_curves; fi
[ -n "$curves" ] && log "training curves (train and dev loss, dev CER and WER): $curves"
log "done (stages $stage..$stop_stage; corpus: $corpus)"
