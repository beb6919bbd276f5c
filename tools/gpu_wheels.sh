#!/usr/bin/env bash
# What tools/gpu_suite.sh needs on a lent GPU machine that its image lacks (no network there):
# x86-64 wheels for Python 3.12 of west's data stack and the top of jieba's word list (the corpus
# synthesizer's vocabulary source; jieba itself ships no wheel). Written to REPO/.whl/, which git ignores through .git/info/exclude
# and the device tool carries (`carry: [".whl"]`).
#
#   bash tools/gpu_wheels.sh [--python-version 3.12]
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
pyver=3.12
[ "${1:-}" = "--python-version" ] && pyver=$2
dest=$repo/.whl
mkdir -p "$dest" "$repo/.git/info"
grep -qx "/.whl/" "$repo/.git/info/exclude" 2>/dev/null || echo "/.whl/" >>"$repo/.git/info/exclude"
platforms=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 \
         manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux1_x86_64; do platforms+=(--platform "$p"); done
# soundfile needs cffi (and pycparser); the image has numpy and typing-extensions.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
  "${platforms[@]}" -d "$dest" espeakng-loader soxr soundfile cffi pycparser kaldi-native-fbank kaldiio \
  editdistance 2> >(grep -v "is ignored: it is neither" >&2)

dict=$("${PYTHON:-$repo/.venv/bin/python}" -c 'import importlib.resources as r; print(r.files("jieba").joinpath("dict.txt"))')
sort -k2,2nr "$dict" | awk "NR <= 20000" >"$dest/jieba_dict.txt"   # awk reads on: no SIGPIPE
ls -la "$dest"
du -sh "$dest"
