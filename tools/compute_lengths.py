#!/usr/bin/env python3
"""Add exact lengths to a data list, so the loader can plan every epoch.

* jsonl list: writes OUT_LIST, a copy in which every audio (the utterance's
  ``wav`` or each audio part of a conversation) carries ``num_frames`` (fbank
  frames after resampling to --sample_rate, what the loader computes) and
  ``duration`` (seconds), read from the audio header (no decoding). Lines whose
  audio cannot be read are kept unchanged and reported (the loader will ask for
  their length); --drop_bad leaves them out instead.
* tar shard list (WeNet's: one .tar per line): writes the index LIST.idx beside
  it (member offsets, transcripts and lengths: west.data.shards); OUT_LIST is
  not used.
* Kaldi data dir: writes DIR/utt2num_frames from the feature matrices.
* Lhotse Shar directory: writes DIR.west.idx beside it, where each cut's audio (or features) lies in its
  recording (or features) tar (west.data.shar); the lengths are the cuts' durations.
* Hugging Face dataset (a save_to_disk directory, a parquet file, a directory or a
  list of parquet files) without a duration column: writes the lengths index
  beside it, DIR.west.idx or FILE.idx (west.data.hf_index), from each row's audio
  header; --audio_column / --text_column / --messages_column as data.*_column.
* Lhotse cuts (and recordings + supervisions): nothing to write, a cut carries
  its duration.

    python tools/compute_lengths.py data/train/data.list data/train/data.len.list
    python tools/compute_lengths.py data/train/shards.list
    python tools/compute_lengths.py data/train_shar
    python tools/compute_lengths.py data/hf/train
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from west.data.config import DataConfig
from west.data.lengths import measure_audio
from west.data.lists import detect_data_type, index_path, parse_json_record, read_lines
from west.data.shards import write_index
from west.data.stats import SkipSample


def _audio_dicts(obj: dict) -> list[dict]:
    """The JSON dicts that carry each audio, in the order records list them."""
    if "messages" not in obj:
        return [obj]
    out = []
    for msg in obj["messages"]:
        content = msg["content"]
        for item in content if isinstance(content, list) else [content]:
            if isinstance(item, dict) and item.get("type") == "audio":
                out.append(item)
    return out


def add_lengths(in_list: str, out_list: str, conf: DataConfig, drop_bad: bool = False) -> tuple[int, list[str]]:
    """jsonl list with lengths; returns (lines written, problems)."""
    base = os.path.dirname(os.path.abspath(in_list))
    problems, written = [], 0
    with open(out_list, "wb") as out:
        for lineno, raw in read_lines(in_list):
            src = f"{in_list}:{lineno}"
            try:
                rec = parse_json_record(raw, src, base)
                obj = json.loads(raw.decode("utf-8"))
                for spec, target in zip(rec.audio, _audio_dicts(obj)):
                    target["num_frames"], target["duration"] = measure_audio(spec, conf)
                line = json.dumps(obj, ensure_ascii=False).encode("utf-8")
            except SkipSample as e:
                problems.append(f"{src}: [{e.category}] {e.message}")
                if drop_bad:
                    continue
                line = raw                       # kept byte for byte
            out.write(line + b"\n")
            written += 1
    return written, problems


def kaldi_lengths(path: str) -> tuple[int, list[str]]:
    """utt2num_frames beside feats.scp, from the matrices' shapes."""
    import kaldiio

    scp = os.path.join(path, "feats.scp") if os.path.isdir(path) else path
    problems, rows = [], []
    for lineno, raw in read_lines(scp):
        key, _, ark = raw.decode("utf-8", errors="replace").strip().partition(" ")
        try:
            rows.append(f"{key} {kaldiio.load_mat(ark.strip()).shape[0]}\n")
        except Exception as e:   # noqa: BLE001 - reported, the loader counts the line
            problems.append(f"{scp}:{lineno}: cannot read {ark}: {e}")
    with open(os.path.join(os.path.dirname(scp), "utt2num_frames"), "w", encoding="utf-8") as f:
        f.writelines(rows)
    return len(rows), problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("in_list", help="jsonl list, tar shard list, Kaldi data dir, Lhotse Shar dir or Hugging Face dataset")
    p.add_argument("out_list", nargs="?", help="jsonl lists only: the list to write")
    p.add_argument("--sample_rate", type=int, default=16000)
    p.add_argument("--frame_length_ms", type=float, default=25.0)
    p.add_argument("--frame_shift_ms", type=float, default=10.0)
    p.add_argument("--drop_bad", action="store_true", help="jsonl: leave unreadable lines out")
    p.add_argument("--audio_column", default="audio", help="Hugging Face datasets: data.audio_column")
    p.add_argument("--text_column", default=None, help="Hugging Face datasets: data.text_column")
    p.add_argument("--messages_column", default="messages", help="Hugging Face datasets: data.messages_column")
    a = p.parse_args(argv)
    conf = DataConfig(sample_rate=a.sample_rate, frame_length_ms=a.frame_length_ms, frame_shift_ms=a.frame_shift_ms,
                      audio_column=a.audio_column, text_column=a.text_column, messages_column=a.messages_column)
    kind = detect_data_type(a.in_list)
    if kind == "shard":
        n, problems = write_index(a.in_list, lambda spec: measure_audio(spec, conf))
        target = index_path(a.in_list)
    elif kind == "shar":
        from west.data.shar import write_shar_index  # optional extra: lhotse

        n, problems = write_shar_index(a.in_list)
        target = index_path(a.in_list)
    elif kind == "hf":
        from west.data.hf_lists import write_hf_index  # optional extra: datasets

        n, problems = write_hf_index(a.in_list, conf, lambda spec: measure_audio(spec, conf))
        target = index_path(a.in_list)
    elif kind == "lhotse":
        print(f"{a.in_list}: Lhotse cuts carry their durations; nothing to write", file=sys.stderr)
        return 0
    elif kind == "kaldi":
        n, problems = kaldi_lengths(a.in_list)
        target = "utt2num_frames"
    else:
        if not a.out_list:
            p.error("a jsonl list needs OUT_LIST")
        n, problems = add_lengths(a.in_list, a.out_list, conf, a.drop_bad)
        target = a.out_list
    stale = os.path.join(a.in_list, "west.idx")   # where west kept a directory's index before it moved beside it
    if kind in ("shar", "hf") and os.path.isfile(stale):
        problems.insert(0, f"{stale} is an index an earlier west wrote inside the directory, now unused: delete it "
                           "(lhotse's own CutSet.from_shar reads every file there as a field)")
    for msg in problems[:20]:
        print(f"warning: {msg}", file=sys.stderr)
    print(f"wrote {n} entries to {target}; {len(problems)} problem(s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
