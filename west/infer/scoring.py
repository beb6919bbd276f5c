"""Character / word error rate between reference and hypothesis transcripts.

CER for text written without spaces (Chinese): every non-space character is a
token and spaces are ignored. WER for space-separated text: whitespace-split
words. ``auto`` picks CER when the references contain CJK characters. Edit
distance comes from ``editdistance`` (C++, Levenshtein over token lists).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import editdistance

_CJK = re.compile("[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uac00-\ud7af]")
TEXT_FIELDS = ("text", "txt", "hyp", "transcript")


@dataclass
class ErrorRate:
    mode: str                 # "cer" | "wer"
    errors: int               # substitutions + deletions + insertions
    ref_tokens: int
    utts: int
    missing: list = field(default_factory=list)  # refs without a hypothesis (scored as all deleted)
    extra: list = field(default_factory=list)    # hypotheses without a reference (ignored)
    per_utt: dict = field(default_factory=dict)  # key -> (errors, ref_tokens)

    @property
    def rate(self) -> float:
        return self.errors / self.ref_tokens if self.ref_tokens else 0.0

    def summary(self) -> str:
        return (f"{self.mode.upper()} {100 * self.rate:.2f} % [ {self.errors} / {self.ref_tokens}, "
                f"{self.utts} utts, {len(self.missing)} missing hyps, {len(self.extra)} extra hyps ]")


def tokenize(text: str, mode: str) -> list[str]:
    if mode == "cer":
        return [c for c in text if not c.isspace()]
    if mode == "wer":
        return text.split()
    raise ValueError(f"mode must be cer or wer, got {mode!r}")


def detect_mode(texts: Mapping[str, str] | list[str]) -> str:
    values = texts.values() if isinstance(texts, Mapping) else texts
    return "cer" if any(_CJK.search(t) for t in values) else "wer"


def read_transcripts(path: str | Path) -> dict[str, str]:
    """Kaldi-style ``key text...`` lines, or jsonl with ``key`` and one of TEXT_FIELDS.
    A key with no text is an empty transcript. Errors name file and line."""
    path = Path(path)
    out: dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if line.lstrip().startswith("{"):
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: invalid JSON: {e}") from None
                key = rec.get("key")
                text = next((rec[k] for k in TEXT_FIELDS if k in rec), None)
                if key is None or text is None:
                    raise ValueError(f"{path}:{lineno}: needs 'key' and one of {TEXT_FIELDS}")
            else:
                parts = line.strip().split(maxsplit=1)
                key, text = parts[0], parts[1] if len(parts) > 1 else ""
            if key in out:
                raise ValueError(f"{path}:{lineno}: duplicate key {key!r}")
            out[str(key)] = str(text)
    return out


def error_rate(refs: Mapping[str, str], hyps: Mapping[str, str], mode: str = "auto") -> ErrorRate:
    """Corpus-level error rate: Σ edit distances / Σ reference tokens."""
    if mode == "auto":
        mode = detect_mode(refs)
    res = ErrorRate(mode, 0, 0, 0)
    for key, ref in refs.items():
        r = tokenize(ref, mode)
        if key not in hyps:
            res.missing.append(key)
        h = tokenize(hyps.get(key, ""), mode)
        e = editdistance.eval(r, h)
        res.errors += e
        res.ref_tokens += len(r)
        res.utts += 1
        res.per_utt[key] = (e, len(r))
    res.extra = [k for k in hyps if k not in refs]
    return res


def score_files(ref_path: str | Path, hyp_path: str | Path, mode: str = "auto") -> ErrorRate:
    return error_rate(read_transcripts(ref_path), read_transcripts(hyp_path), mode)
