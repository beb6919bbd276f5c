#!/usr/bin/env python3
"""Synthesize a small AIShell-1-shaped Mandarin corpus with eSpeak NG, fully offline.

Why: the recipe must run end to end on a fresh offline CPU machine. This writes
``OUT/data_aishell/`` with the same layout as AIShell-1 (wav/{train,dev,test}/SXXXX/
BAC009SXXXXWYYYY.wav, 16 kHz 16-bit mono, and transcript/aishell_transcript_v0.8.txt with
space-separated words), so the recipe's stages run on it unchanged.

Text: random sequences of the ``--vocab_size`` most frequent multi-character Chinese words
of jieba's dict.txt; the number of words follows a lognormal target duration (mean
``--mean_duration``). Speakers: eSpeak NG voice variants with their own speaking rate,
pitch, pitch range, gain and noise floor; dev/test speakers are disjoint from train ones,
as in AIShell.

Determinism: the whole plan (speakers, words, silences, seeds) is drawn from ``--seed`` in
the parent. libespeak-ng keeps state across utterances that espeak_Terminate does not reset
(lengths drift by a few ms) and some voices draw from libc rand(), so each speaker is
rendered in a fresh worker process (``maxtasksperchild=1``) and rand() is seeded per
utterance: the output is byte-identical for a seed whatever ``--num_workers`` is.
"""
from __future__ import annotations

import argparse
import ctypes
import importlib.resources
import json
import math
import multiprocessing as mp
import re
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

SPLITS = ("train", "dev", "test")
PREFIX = "BAC009"  # AIShell-1's recording-session prefix of every utterance id
FIRST_SPEAKER = 2  # AIShell-1's speaker ids start at S0002
TRANSCRIPT = "transcript/aishell_transcript_v0.8.txt"
MARKER = "synthesis.json"  # marks a folder this tool made; "complete" once it finished
NOT_CORPUS_OPTIONS = ("out", "num_workers", "force", "check")  # they do not change the corpus
SAMPLE_RATE = 16000
VOICE = "cmn"
VARIANTS = ("", "f1", "f2", "f3", "f4", "f5", "m1", "m2", "m3", "m4", "m5", "m6", "m7")
# eSpeak's speaking time ~ OFFSET + chars * SEC_PER_CHAR at rate 175, scaled by
# (175 / rate) ** RATE_EXPONENT: fitted on 225 random sentences over 5 voices and rates
# 140/175/220 (residual ~7 %). Only used to choose how many words reach a target duration.
SPEECH_OFFSET_S = 0.15
SEC_PER_CHAR_175 = 0.249
RATE_EXPONENT = 1.1
LOGNORMAL_SIGMA = 0.35  # AIShell-like spread (sd ~1.6 s at mean 4.5 s); not fitted to AIShell
HAN_WORD = re.compile(r"^[\u4e00-\u9fff]{2,}$")

# speak_lib.h constants
AUDIO_OUTPUT_SYNCHRONOUS = 2
POS_CHARACTER = 1
CHARS_UTF8 = 1
PARAM_RATE, PARAM_PITCH, PARAM_RANGE = 1, 3, 4
SYNTH_CALLBACK = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p
)


@dataclass(frozen=True)
class Speaker:
    sid: str  # "S0002"
    split: str
    variant: str  # eSpeak voice variant ("" = default voice)
    rate: int  # words per minute (eSpeak default 175)
    pitch: int  # 0..100 (default 50)
    pitch_range: int  # 0..100 (default 50)
    gain: float  # peak scale of the speech
    noise_dbfs: float  # white-noise floor, dB re full scale


@dataclass(frozen=True)
class Utterance:
    uid: str
    words: tuple[str, ...]
    lead_s: float  # silence before the speech
    trail_s: float  # silence after the speech
    seed: int  # libc rand() seed and noise seed


class Espeak:
    """The process's eSpeak NG engine (libespeak-ng is a singleton with global state)."""

    def __init__(self) -> None:
        import espeakng_loader  # lazy: only workers and tests need the library

        lib = ctypes.CDLL(espeakng_loader.get_library_path())
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.espeak_Synth.argtypes = [
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int,
            ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p,
        ]
        data_path = espeakng_loader.get_data_path().encode()
        rate = lib.espeak_Initialize(AUDIO_OUTPUT_SYNCHRONOUS, 0, data_path, 0)
        if rate <= 0:
            raise RuntimeError(f"espeak_Initialize failed ({rate}) with data at {data_path!r}")
        self.sample_rate = int(rate)
        self._lib = lib
        self._libc = ctypes.CDLL(None)
        self._chunks: list[np.ndarray] = []
        self._callback = SYNTH_CALLBACK(self._on_audio)  # keep a reference: C holds it
        lib.espeak_SetSynthCallback(self._callback)

    def _on_audio(self, wav, n, _events) -> int:
        if n > 0 and wav:
            self._chunks.append(np.ctypeslib.as_array(wav, shape=(n,)).copy())
        return 0  # 0 = continue synthesis

    def set_voice(self, variant: str, rate: int, pitch: int, pitch_range: int) -> None:
        name = VOICE + (f"+{variant}" if variant else "")
        if self._lib.espeak_SetVoiceByName(name.encode()) != 0:
            raise RuntimeError(f"eSpeak NG has no voice {name!r}")
        for param, value in ((PARAM_RATE, rate), (PARAM_PITCH, pitch), (PARAM_RANGE, pitch_range)):
            if self._lib.espeak_SetParameter(param, int(value), 0) != 0:
                raise RuntimeError(f"espeak_SetParameter({param}, {value}) failed")

    def synth(self, text: str, seed: int = 0) -> np.ndarray:
        """int16 samples at ``self.sample_rate`` for UTF-8 ``text``."""
        self._libc.srand(ctypes.c_uint(seed))  # breathy variants draw from rand()
        if hasattr(self._lib, "espeak_ng_SetRandSeed"):
            self._lib.espeak_ng_SetRandSeed(ctypes.c_long(seed))
        self._chunks = []
        data = text.encode("utf-8") + b"\0"
        err = self._lib.espeak_Synth(data, len(data), 0, POS_CHARACTER, 0, CHARS_UTF8, None, None)
        if err != 0:
            raise RuntimeError(f"espeak_Synth failed ({err}) on {text!r}")
        return np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.int16)


def load_vocab(size: int, dict_path: str | None = None) -> list[str]:
    """The ``size`` most frequent multi-character all-Han words of a jieba-format dict."""
    if dict_path is None:
        source = importlib.resources.files("jieba").joinpath("dict.txt")
    else:
        source = Path(dict_path)
    entries = []
    with source.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            parts = line.split()
            if not parts:
                continue
            if len(parts) < 2 or not parts[1].isdigit():
                raise ValueError(f"{source}:{lineno}: expected 'word freq [tag]', got {line!r}")
            if HAN_WORD.match(parts[0]):
                entries.append((-int(parts[1]), parts[0]))
    entries.sort()
    if len(entries) < size:
        raise ValueError(f"{source} has only {len(entries)} multi-character words, asked {size}")
    return [word for _, word in entries[:size]]


def speech_seconds(n_chars: int, rate: int) -> float:
    """Estimated eSpeak speaking time of ``n_chars`` Han characters at ``rate``."""
    if n_chars == 0:
        return 0.0
    return (SPEECH_OFFSET_S + n_chars * SEC_PER_CHAR_175) * (175.0 / rate) ** RATE_EXPONENT


def speakers_per_split(counts: dict[str, int], num_speakers: int) -> dict[str, int]:
    """Disjoint speakers per split, roughly proportional to utterances.

    dev/test get at least 2 speakers when there are >= 10 in all (1 otherwise), so their
    scores do not hinge on one voice.
    """
    total = sum(counts.values())
    floor = 2 if num_speakers >= 10 else 1
    out = {}
    for split in ("dev", "test"):
        share = round(num_speakers * counts[split] / total) if total else 0
        out[split] = min(counts[split], max(share, floor))
    out["train"] = num_speakers - out["dev"] - out["test"]
    if out["train"] < (1 if counts["train"] else 0):
        raise ValueError(f"--num_speakers {num_speakers} leaves no train speaker "
                         f"(dev {out['dev']}, test {out['test']})")
    out["train"] = min(out["train"], counts["train"])
    return out


def draw_speaker(rng: np.random.Generator, sid: str, split: str) -> Speaker:
    """A voice: eSpeak variant, speaking rate, pitch and level of one speaker."""
    return Speaker(
        sid=sid, split=split, variant=VARIANTS[int(rng.integers(len(VARIANTS)))],
        rate=int(rng.integers(140, 221)), pitch=int(rng.integers(25, 76)),
        pitch_range=int(rng.integers(20, 81)), gain=round(float(rng.uniform(0.3, 0.9)), 3),
        noise_dbfs=round(float(rng.uniform(-70.0, -50.0)), 1),
    )


def draw_utterance(rng: np.random.Generator, uid: str, rate: int, vocab: list[str],
                   mean_duration: float) -> Utterance:
    """Words whose estimated speaking time (plus silences) is closest to a lognormal target."""
    mu = math.log(mean_duration) - LOGNORMAL_SIGMA**2 / 2  # so that E[target] = mean_duration
    lo, hi = 0.35 * mean_duration, 3.0 * mean_duration  # 1.6..13.5 s at 4.5 s
    target = float(np.clip(rng.lognormal(mu, LOGNORMAL_SIGMA), lo, hi))
    lead, trail = (round(float(x), 3) for x in rng.uniform(0.1, 0.5, size=2))
    speech = max(target - lead - trail, 0.5)
    words: list[str] = []
    chars = 0
    while True:  # add words while that brings the estimate closer to the target
        word = vocab[int(rng.integers(len(vocab)))]
        now = abs(speech_seconds(chars, rate) - speech)
        after = abs(speech_seconds(chars + len(word), rate) - speech)
        if words and after >= now:
            break
        words.append(word)
        chars += len(word)
    return Utterance(uid=uid, words=tuple(words), lead_s=lead, trail_s=trail,
                     seed=int(rng.integers(2**31)))


def plan_corpus(counts: dict[str, int], num_speakers: int, vocab: list[str], seed: int,
                mean_duration: float = 4.5) -> list[tuple[Speaker, list[Utterance]]]:
    """Every random choice of the corpus, drawn in a fixed order from ``seed``."""
    rng = np.random.default_rng(seed)
    n_spk = speakers_per_split(counts, num_speakers)
    plan, next_id = [], FIRST_SPEAKER
    for split in SPLITS:
        for k in range(n_spk[split]):
            spk = draw_speaker(rng, f"S{next_id:04d}", split)
            next_id += 1
            n_utt = counts[split] // n_spk[split] + (k < counts[split] % n_spk[split])
            utts = [draw_utterance(rng, f"{PREFIX}{spk.sid}W{w + 1:04d}", spk.rate, vocab,
                                   mean_duration) for w in range(n_utt)]
            plan.append((spk, utts))
    return plan


def render(engine: Espeak, spk: Speaker, utt: Utterance) -> np.ndarray:
    """int16 16 kHz waveform of one utterance (speech + silences + the speaker's noise floor)."""
    import soxr

    raw = engine.synth("".join(utt.words), utt.seed)
    if raw.size == 0:
        raise RuntimeError(f"eSpeak NG produced no audio for {utt.uid} ({''.join(utt.words)!r})")
    speech = soxr.resample(raw.astype(np.float32) / 32768.0, engine.sample_rate, SAMPLE_RATE)
    speech *= spk.gain / max(float(np.abs(speech).max()), 1e-6)
    lead, trail = round(utt.lead_s * SAMPLE_RATE), round(utt.trail_s * SAMPLE_RATE)
    wav = np.concatenate([np.zeros(lead, np.float32), speech, np.zeros(trail, np.float32)])
    noise = np.random.default_rng(utt.seed).standard_normal(wav.size)
    wav += (10.0 ** (spk.noise_dbfs / 20.0)) * noise.astype(np.float32)
    return np.clip(np.round(wav * 32767.0), -32768, 32767).astype(np.int16)


def render_speaker(job: tuple[str, Speaker, list[Utterance]]) -> list[tuple[str, float]]:
    """Worker: render one speaker's utterances in order; returns (uid, seconds) per file."""
    import soundfile as sf

    root, spk, utts = job
    engine = Espeak()
    engine.set_voice(spk.variant, spk.rate, spk.pitch, spk.pitch_range)
    spk_dir = Path(root) / "wav" / spk.split / spk.sid
    spk_dir.mkdir(parents=True, exist_ok=True)
    out = []
    for utt in utts:
        wav = render(engine, spk, utt)
        sf.write(spk_dir / f"{utt.uid}.wav", wav, SAMPLE_RATE, subtype="PCM_16")
        out.append((utt.uid, wav.size / SAMPLE_RATE))
    return out


def prepare_root(root: Path, force: bool) -> None:
    """Refuse to mix with an existing directory; --force only deletes one we made."""
    if root.exists() and any(root.iterdir()):
        if not force:
            raise SystemExit(f"{root} exists and is not empty; use --force to replace it")
        if not (root / MARKER).is_file():
            raise SystemExit(f"{root} has no {MARKER}: not a synthesized corpus, not deleting it")
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)


def synthesize(args: argparse.Namespace) -> dict:
    """Plan, render in worker processes, write the transcript; returns summary statistics."""
    from tqdm import tqdm

    counts = {"train": args.num_train, "dev": args.num_dev, "test": args.num_test}
    vocab = load_vocab(args.vocab_size, args.dict)
    plan = plan_corpus(counts, args.num_speakers, vocab, args.seed, args.mean_duration)
    root = Path(args.out) / "data_aishell"
    prepare_root(root, args.force)
    # written first so that --force may clean up after an interrupted run
    (root / MARKER).write_text(json.dumps({"complete": False, "args": vars(args)}))
    jobs = sorted(((str(root), spk, utts) for spk, utts in plan if utts),
                  key=lambda job: -len(job[2]))
    durations: dict[str, float] = {}
    start = time.perf_counter()
    # A fresh process per speaker: see the module docstring (eSpeak state, determinism).
    with mp.Pool(max(1, args.num_workers), maxtasksperchild=1) as pool, \
            tqdm(total=sum(counts.values()), unit="utt", desc="synthesize") as bar:
        for result in pool.imap_unordered(render_speaker, jobs):
            durations.update(result)
            bar.update(len(result))
    wall = time.perf_counter() - start

    lines = sorted(f"{u.uid} {' '.join(u.words)}" for _, utts in plan for u in utts)
    (root / TRANSCRIPT).parent.mkdir(parents=True, exist_ok=True)
    (root / TRANSCRIPT).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    secs = np.array(list(durations.values())) if durations else np.zeros(1)
    stats = {
        "utterances": {s: counts[s] for s in SPLITS},
        "speakers": {s: sum(1 for spk, u in plan if spk.split == s and u) for s in SPLITS},
        "hours": round(float(secs.sum()) / 3600, 3),
        "mean_s": round(float(secs.mean()), 2), "min_s": round(float(secs.min()), 2),
        "max_s": round(float(secs.max()), 2),
        "vocab_words": len(vocab), "vocab_chars": len(set("".join(vocab))),
        "wall_s": round(wall, 1), "workers": args.num_workers,
        "audio_s_per_wall_s": round(float(secs.sum()) / max(wall, 1e-9), 1),
    }
    meta = {"complete": True, "args": vars(args), "stats": stats, "speakers": [asdict(s) for s, _ in plan]}
    (root / MARKER).write_text(json.dumps(meta, ensure_ascii=False, indent=1), encoding="utf-8")
    return stats


def already_synthesized(args: argparse.Namespace) -> bool:
    """OUT/data_aishell holds a complete corpus made with these options (so the recipe
    can reuse it); raises OSError / ValueError when there is no readable marker."""
    done = json.loads((Path(args.out) / "data_aishell" / MARKER).read_text(encoding="utf-8"))
    return bool(done.get("complete")) and all(done["args"].get(k) == v for k, v in vars(args).items()
                                              if k not in NOT_CORPUS_OPTIONS)


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="writes OUT/data_aishell/")
    p.add_argument("--num_train", type=int, default=1500, help="train utterances")
    p.add_argument("--num_dev", type=int, default=100, help="dev utterances")
    p.add_argument("--num_test", type=int, default=100, help="test utterances")
    p.add_argument("--num_speakers", type=int, default=40,
                   help="speakers in all; train/dev/test get disjoint ones")
    p.add_argument("--seed", type=int, default=0, help="same seed, same bytes")
    p.add_argument("--vocab_size", type=int, default=300, help="most frequent words used")
    p.add_argument("--mean_duration", type=float, default=4.5,
                   help="mean utterance seconds (lognormal target)")
    p.add_argument("--dict", default=None,
                   help="jieba-format 'word freq [tag]' file; unset = jieba's dict.txt")
    p.add_argument("--num_workers", type=int, default=2, help="worker processes")
    p.add_argument("--force", action="store_true", help="replace an earlier synthesized corpus")
    p.add_argument("--check", action="store_true",
                   help="synthesize nothing: print True when OUT already holds a complete corpus made "
                        "with these options, else False (fails when OUT has none)")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = get_parser().parse_args(argv)
    if args.check:
        same = already_synthesized(args)
        print(same)
        return {"same": same}
    for name in ("num_train", "num_dev", "num_test"):
        if getattr(args, name) < 0:
            raise SystemExit(f"--{name} must be >= 0")
    if args.num_train + args.num_dev + args.num_test == 0:
        raise SystemExit("nothing to synthesize: all of --num_train/--num_dev/--num_test are 0")
    if args.vocab_size < 1 or args.mean_duration <= 0 or args.num_speakers < 1:
        raise SystemExit("--vocab_size, --mean_duration and --num_speakers must be positive")
    try:
        stats = synthesize(args)
    except ValueError as e:
        raise SystemExit(str(e)) from e
    u = stats["utterances"]
    print(f"[synthesize_corpus] {sum(u.values())} utterances (train {u['train']} / dev {u['dev']}"
          f" / test {u['test']}), {stats['hours']:.2f} h, mean {stats['mean_s']:.2f} s "
          f"(min {stats['min_s']:.2f}, max {stats['max_s']:.2f}), vocab {stats['vocab_words']} "
          f"words, {stats['wall_s']:.1f} s wall = {stats['audio_s_per_wall_s']:.0f}x real time "
          f"-> {Path(args.out) / 'data_aishell'}")
    return stats


if __name__ == "__main__":
    main()
