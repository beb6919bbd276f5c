"""Is a WAV file cut short? libsndfile decodes a truncated WAV without an error: it reads the
samples that are there and says nothing, so a file cut off mid-copy trained silently as a
shorter utterance whose transcript no longer matches. The RIFF header says how many bytes of
samples the ``data`` chunk holds; fewer bytes in the file means it was truncated.
"""
from __future__ import annotations

import io
import os
import struct
from typing import BinaryIO, Optional, Union


def _size(f: BinaryIO) -> int:
    here = f.tell()
    f.seek(0, os.SEEK_END)
    end = f.tell()
    f.seek(here)
    return end


def wav_shortfall(src: Union[str, os.PathLike, io.BytesIO]) -> Optional[str]:
    """Why ``src`` is a truncated WAV (its data chunk announces more bytes than follow it), or
    None: whole, not a RIFF/WAVE file or no data chunk found (left to the decoder)."""
    f = open(src, "rb") if not isinstance(src, io.BytesIO) else src
    try:
        start = f.tell()
        size = _size(f) - start
        head = f.read(12)
        if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
            return None
        pos = 12
        while pos + 8 <= size:
            f.seek(start + pos)
            chunk, length = struct.unpack("<4sI", f.read(8))
            if chunk == b"data":
                have = size - pos - 8
                if length != 0xFFFFFFFF and length > have:  # 0xFFFFFFFF: a streamed file, size unknown
                    return f"WAV data chunk announces {length} bytes, the file holds {have} (truncated?)"
                return None
            pos += 8 + length + (length & 1)
        return None  # no data chunk found: a damaged header, the decoder's to report (corrupt_audio)
    finally:
        if isinstance(src, io.BytesIO):
            src.seek(0)
        else:
            f.close()
