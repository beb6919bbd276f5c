"""Character / word error rate between reference and hypothesis transcripts, after a named
text normalizer: the one place where west scores (tools/compute_cer.py, dev evaluation,
west-decode).

CER for text written without spaces (Chinese): every non-space character is a
token and spaces are ignored. WER for space-separated text: whitespace-split
words. ``auto`` picks CER when the references contain CJK characters. Edit
distance comes from ``editdistance`` (C++, Levenshtein over token lists).

Normalizers (NORMALIZERS; both sides of every pair go through the same one, and the raw
texts stay in the result files):

- ``none``: the texts as they are;
- ``english``: Whisper's English normalization (lower case, brackets and fillers dropped,
  contractions expanded, spelled numbers and currencies as digits, British spellings as
  American, punctuation and diacritics removed), the convention published LibriSpeech WERs
  of LLM-based recognizers are scored with; from the ``whisper-normalizer`` package (extra
  ``english``), a standalone copy of openai-whisper's normalizers without its model code;
- ``mandarin``: full-width forms as half-width (ＡＢＣ１２３ -> ABC123, the ideographic space as a
  space) and every Unicode punctuation character removed (，。！？、“”《》 and ASCII ones);
- ``mandarin_t2s``: ``mandarin``, then traditional characters as simplified through OpenCC's
  ``t2s`` conversion (the ``opencc`` package, extra ``mandarin``).
"""
from __future__ import annotations

import functools
import json
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import editdistance

_CJK = re.compile("[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uac00-\ud7af]")
TEXT_FIELDS = ("text", "txt", "hyp", "transcript")
FULL_WIDTH = {c: c - 0xFEE0 for c in range(0xFF01, 0xFF5F)} | {0x3000: 0x20}  # ！..～ -> !..~, ideographic space


def _none(text: str) -> str:
    return text


@functools.cache
def _english() -> Callable[[str], str]:
    try:
        from whisper_normalizer.english import EnglishTextNormalizer  # optional: the english extra
    except ImportError:
        raise ValueError("normalizer 'english' needs the whisper-normalizer package: "
                         "pip install -e '.[english]' in west's checkout") from None
    return EnglishTextNormalizer()


def _english_text(text: str) -> str:
    return _english()(text)


def _mandarin(text: str) -> str:
    text = text.translate(FULL_WIDTH)
    text = "".join(c for c in text if not unicodedata.category(c).startswith("P"))
    return " ".join(text.split())


@functools.cache
def _t2s() -> Callable[[str], str]:
    try:
        import opencc  # optional: the mandarin extra
    except ImportError:
        raise ValueError("normalizer 'mandarin_t2s' needs OpenCC: pip install -e '.[mandarin]' in west's checkout "
                         "(or use 'mandarin', which keeps traditional characters)") from None
    return opencc.OpenCC("t2s").convert


def _mandarin_t2s(text: str) -> str:
    return _t2s()(_mandarin(text))


NORMALIZERS: dict[str, Callable[[str], str]] = {
    "none": _none, "english": _english_text, "mandarin": _mandarin, "mandarin_t2s": _mandarin_t2s}


def get_normalizer(name: str) -> Callable[[str], str]:
    """The normalizer called ``name``, ready to use: ValueError naming the choices for an unknown
    name, or naming the package to install when its library is missing (checked here, before
    any text is scored)."""
    if name not in NORMALIZERS:
        raise ValueError(f"unknown normalizer {name!r}: choose one of {', '.join(NORMALIZERS)}")
    if name == "english":
        _english()
    elif name == "mandarin_t2s":
        _t2s()
    return NORMALIZERS[name]


@dataclass
class ErrorRate:
    mode: str                 # "cer" | "wer"
    errors: int               # substitutions + deletions + insertions
    ref_tokens: int
    utts: int
    missing: list = field(default_factory=list)  # refs without a hypothesis (scored as all deleted)
    extra: list = field(default_factory=list)    # hypotheses without a reference (ignored)
    per_utt: dict = field(default_factory=dict)  # key -> (errors, ref_tokens)
    normalizer: str = "none"  # what both sides went through before tokenizing (NORMALIZERS)

    @property
    def rate(self) -> float:
        return self.errors / self.ref_tokens if self.ref_tokens else 0.0

    def summary(self) -> str:
        return (f"{self.mode.upper()} {100 * self.rate:.2f} % [ {self.errors} / {self.ref_tokens}, "
                f"{self.utts} utts, {len(self.missing)} missing hyps, {len(self.extra)} extra hyps ] "
                f"normalizer {self.normalizer}")


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


def error_rate(refs: Mapping[str, str], hyps: Mapping[str, str], mode: str = "auto",
               normalizer: str = "none") -> ErrorRate:
    """Corpus-level error rate after ``normalizer`` (NORMALIZERS) on both sides: Σ edit
    distances / Σ reference tokens. ``auto`` decides CER or WER from the normalized references."""
    norm = get_normalizer(normalizer)
    if normalizer != "none":
        refs = {k: norm(v) for k, v in refs.items()}
        hyps = {k: norm(v) for k, v in hyps.items()}
    if mode == "auto":
        mode = detect_mode(refs)
    res = ErrorRate(mode, 0, 0, 0, normalizer=normalizer)
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


def score_files(ref_path: str | Path, hyp_path: str | Path, mode: str = "auto",
                normalizer: str = "none") -> ErrorRate:
    return error_rate(read_transcripts(ref_path), read_transcripts(hyp_path), mode, normalizer)
