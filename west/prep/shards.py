"""Write tar shards (WeNet layout: KEY.<audio ext> + KEY.txt) with their index.

Audio bytes are copied as they are (wav, flac, ...); a segment (start/end) is
cut and stored as 16-bit wav. Conversation (``messages``) lines cannot be
sharded and are reported. The shard list is written with its index
(``west.data.shards``), so the loader can plan epochs from it at once.
"""
from __future__ import annotations

import io
import os
import tarfile
import time

import soundfile as sf

from west.data.config import DataConfig
from west.data.features import resolve_path
from west.data.lengths import measure_audio
from west.data.lists import RawList
from west.data.records import AudioSpec
from west.data.shards import write_index
from west.data.stats import DataStats


def _audio_member(spec: AudioSpec) -> tuple[bytes, str]:
    path = resolve_path(spec.path, spec.base)
    if spec.start is None and spec.end is None:
        with open(path, "rb") as f:
            return f.read(), os.path.splitext(path)[1].lstrip(".").lower() or "wav"
    with sf.SoundFile(path) as f:
        sr = f.samplerate
        start = int(round((spec.start or 0.0) * sr))
        stop = int(round(spec.end * sr)) if spec.end is not None else f.frames
        f.seek(start)
        data = f.read(max(stop - start, 0), dtype="int16")
    buf = io.BytesIO()
    sf.write(buf, data, sr, format="WAV", subtype="PCM_16")
    return buf.getvalue(), "wav"


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = int(time.time())
    tar.addfile(info, io.BytesIO(data))


def make_shards(data_list: str, out_dir: str, num_utts_per_shard: int = 1000, prefix: str = "shards",
                shard_list: str | None = None, conf: DataConfig | None = None) -> tuple[str, int, list[str]]:
    """Write shards; returns (shard list path, utterances written, problems)."""
    os.makedirs(out_dir, exist_ok=True)
    stats = DataStats(max_warnings=0)
    src = RawList(data_list, stats)
    problems = [f"{c}: {n} line(s) unreadable" for c, n in stats.as_dict().items()]
    shard_list = shard_list or os.path.join(out_dir, f"{prefix}.list")
    shards, tar, written, in_shard = [], None, 0, 0
    for i in range(len(src)):
        rec = src.record(i)
        if rec.messages is not None:
            problems.append(f"{rec.src}: conversation lines cannot be sharded")
            continue
        try:
            audio, ext = _audio_member(rec.audio[0])
        except Exception as e:  # missing/corrupt audio: report, keep going
            problems.append(f"{rec.src}: {type(e).__name__}: {e}")
            continue
        if tar is None or in_shard >= num_utts_per_shard:
            if tar is not None:
                tar.close()
            path = os.path.abspath(os.path.join(out_dir, f"{prefix}_{len(shards):06d}.tar"))
            tar, in_shard = tarfile.open(path, "w"), 0
            shards.append(path)
        _add(tar, f"{rec.key}.txt", (rec.txt or "").encode("utf-8"))
        _add(tar, f"{rec.key}.{ext}", audio)
        in_shard += 1
        written += 1
    if tar is not None:
        tar.close()
    with open(shard_list, "w", encoding="utf-8") as f:
        f.writelines(s + "\n" for s in shards)
    conf = conf or DataConfig()   # lengths in the loader's frames (sample rate, frame length and shift)
    problems += write_index(shard_list, lambda spec: measure_audio(spec, conf))[1]
    return shard_list, written, problems
