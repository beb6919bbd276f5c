"""What the offline synthesized corpora share, whatever their language and layout.

tools/synthesize_corpus.py (Mandarin, AIShell-1's layout) and tools/synthesize_librispeech.py
(English, LibriSpeech's layout) differ in their words, voices and file names; both need the
same engine, speakers, duration targets, rendering and safety rules, which live here:

- ``Espeak``: the process's eSpeak NG engine (libespeak-ng from the pip package
  espeakng-loader, through ctypes), with a voice chosen per speaker;
- ``Speaker`` / ``Utterance`` / ``draw_speaker`` / ``draw_utterance`` / ``speakers_per_split``:
  every random choice of a corpus, drawn in a fixed order from one seed;
- ``render`` / ``render_files`` / ``render_all``: audio in fresh worker processes, one per
  speaker, so that a seed gives the same bytes whatever the number of workers (libespeak-ng
  keeps state across utterances that espeak_Terminate does not reset, and some voices draw
  from libc rand(), which is seeded per utterance);
- ``prepare_root`` / ``same_options``: a corpus folder carries MARKER (its options and, once
  finished, its statistics), so ``--force`` deletes only what a synthesizer wrote and a
  recipe can reuse a corpus made with the same options;
- ``add_corpus_options`` / ``run_cli``: the options and the command line both tools take.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import math
import multiprocessing as mp
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

SPLITS = ("train", "dev", "test")
MARKER = "synthesis.json"  # marks a folder a synthesizer made; "complete" once it finished
NOT_CORPUS_OPTIONS = ("out", "num_workers", "force", "check")  # they do not change the corpus
SAMPLE_RATE = 16000
LOGNORMAL_SIGMA = 0.35  # AIShell-like spread (sd ~1.6 s at mean 4.5 s); not fitted to a corpus

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
    sid: str  # "S0002" (AIShell) or "103" (LibriSpeech)
    split: str
    variant: str  # eSpeak voice variant ("" = the voice's default)
    rate: int  # words per minute (eSpeak default 175)
    pitch: int  # 0..100 (default 50)
    pitch_range: int  # 0..100 (default 50)
    gain: float  # peak scale of the speech
    noise_dbfs: float  # white-noise floor, dB re full scale
    voice: str = "cmn"  # eSpeak NG language voice: "cmn", "en-us", "en-gb-scotland", ...

    @property
    def voice_name(self) -> str:
        return self.voice + (f"+{self.variant}" if self.variant else "")


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

    def set_voice(self, name: str, rate: int, pitch: int, pitch_range: int) -> None:
        """``name``: an eSpeak NG voice with an optional variant, e.g. "cmn+f2" or "en-us"."""
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


def draw_speaker(rng: np.random.Generator, sid: str, split: str, variants: Sequence[str],
                 voice: str = "cmn") -> Speaker:
    """A speaker of ``voice``: eSpeak variant, speaking rate, pitch and level."""
    return Speaker(
        sid=sid, split=split, variant=variants[int(rng.integers(len(variants)))],
        rate=int(rng.integers(140, 221)), pitch=int(rng.integers(25, 76)),
        pitch_range=int(rng.integers(20, 81)), gain=round(float(rng.uniform(0.3, 0.9)), 3),
        noise_dbfs=round(float(rng.uniform(-70.0, -50.0)), 1), voice=voice,
    )


def draw_utterance(rng: np.random.Generator, uid: str, vocab: Sequence[str], mean_duration: float,
                   speech_seconds: Callable[[list[str]], float]) -> Utterance:
    """Words whose estimated speaking time (``speech_seconds(words)``, plus silences) is
    closest to a lognormal target of mean ``mean_duration``."""
    mu = math.log(mean_duration) - LOGNORMAL_SIGMA**2 / 2  # so that E[target] = mean_duration
    lo, hi = 0.35 * mean_duration, 3.0 * mean_duration  # 1.6..13.5 s at 4.5 s
    target = float(np.clip(rng.lognormal(mu, LOGNORMAL_SIGMA), lo, hi))
    lead, trail = (round(float(x), 3) for x in rng.uniform(0.1, 0.5, size=2))
    speech = max(target - lead - trail, 0.5)
    words: list[str] = []
    while True:  # add words while that brings the estimate closer to the target
        word = vocab[int(rng.integers(len(vocab)))]
        now = abs(speech_seconds(words) - speech)
        after = abs(speech_seconds(words + [word]) - speech)
        if words and after >= now:
            break
        words.append(word)
    return Utterance(uid=uid, words=tuple(words), lead_s=lead, trail_s=trail,
                     seed=int(rng.integers(2**31)))


def render(engine: Espeak, spk: Speaker, utt: Utterance, text: str) -> np.ndarray:
    """int16 16 kHz waveform of ``text`` (speech + the utterance's silences + the speaker's
    noise floor); the engine must already speak with ``spk``'s voice."""
    import soxr

    raw = engine.synth(text, utt.seed)
    if raw.size == 0:
        raise RuntimeError(f"eSpeak NG produced no audio for {utt.uid} ({text!r})")
    speech = soxr.resample(raw.astype(np.float32) / 32768.0, engine.sample_rate, SAMPLE_RATE)
    speech *= spk.gain / max(float(np.abs(speech).max()), 1e-6)
    lead, trail = round(utt.lead_s * SAMPLE_RATE), round(utt.trail_s * SAMPLE_RATE)
    wav = np.concatenate([np.zeros(lead, np.float32), speech, np.zeros(trail, np.float32)])
    noise = np.random.default_rng(utt.seed).standard_normal(wav.size)
    wav += (10.0 ** (spk.noise_dbfs / 20.0)) * noise.astype(np.float32)
    return np.clip(np.round(wav * 32767.0), -32768, 32767).astype(np.int16)


def render_files(spk: Speaker, items: Sequence[tuple[Utterance, str, Path]]) -> list[tuple[str, float]]:
    """Render one speaker's ``(utterance, text, path)`` items in order, 16-bit PCM, the format
    from the path's suffix (.wav, .flac); returns (uid, seconds) per file."""
    import soundfile as sf

    engine = Espeak()
    engine.set_voice(spk.voice_name, spk.rate, spk.pitch, spk.pitch_range)
    out = []
    for utt, text, path in items:
        wav = render(engine, spk, utt, text)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        sf.write(str(path), wav, SAMPLE_RATE, subtype="PCM_16")
        out.append((utt.uid, wav.size / SAMPLE_RATE))
    return out


def render_all(worker: Callable, jobs: list, num_workers: int, total: int) -> dict[str, float]:
    """``worker(job)`` -> [(uid, seconds)] for every job, each job (one speaker) in a fresh
    process (see the module docstring); largest jobs first; returns uid -> seconds."""
    from tqdm import tqdm

    durations: dict[str, float] = {}
    with mp.Pool(max(1, num_workers), maxtasksperchild=1) as pool, \
            tqdm(total=total, unit="utt", desc="synthesize") as bar:
        for result in pool.imap_unordered(worker, jobs):
            durations.update(result)
            bar.update(len(result))
    return durations


def audio_stats(durations: dict[str, float], wall: float, num_workers: int) -> dict:
    """Hours, mean/min/max seconds and speed of a synthesis."""
    secs = np.array(list(durations.values())) if durations else np.zeros(1)
    return {
        "hours": round(float(secs.sum()) / 3600, 3),
        "mean_s": round(float(secs.mean()), 2), "min_s": round(float(secs.min()), 2),
        "max_s": round(float(secs.max()), 2),
        "wall_s": round(wall, 1), "workers": num_workers,
        "audio_s_per_wall_s": round(float(secs.sum()) / max(wall, 1e-9), 1),
    }


def prepare_root(root: Path, force: bool) -> None:
    """Refuse to mix with an existing directory; --force only deletes one we made."""
    if root.exists() and any(root.iterdir()):
        if not force:
            raise SystemExit(f"{root} exists and is not empty; use --force to replace it")
        if not (root / MARKER).is_file():
            raise SystemExit(f"{root} has no {MARKER}: not a synthesized corpus, not deleting it")
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)


def same_options(root: Path, options: dict) -> bool:
    """``root`` holds a complete corpus made with these options (those in NOT_CORPUS_OPTIONS
    aside); raises OSError / ValueError when there is no readable marker."""
    done = json.loads((Path(root) / MARKER).read_text(encoding="utf-8"))
    return bool(done.get("complete")) and all(done["args"].get(k) == v for k, v in options.items()
                                              if k not in NOT_CORPUS_OPTIONS)


def add_corpus_options(p: argparse.ArgumentParser, split_names: dict[str, str]) -> None:
    """The options every synthesizer takes (``split_names``: how its help names train/dev/test)."""
    for split, default in (("train", 1500), ("dev", 100), ("test", 100)):
        p.add_argument(f"--num_{split}", type=int, default=default, help=f"{split_names[split]} utterances")
    p.add_argument("--num_speakers", type=int, default=40, help="speakers in all; train/dev/test get disjoint ones")
    p.add_argument("--seed", type=int, default=0, help="same seed, same bytes")
    p.add_argument("--mean_duration", type=float, default=4.5, help="mean utterance seconds (lognormal target)")
    p.add_argument("--num_workers", type=int, default=2, help="worker processes")
    p.add_argument("--force", action="store_true", help="replace an earlier synthesized corpus")
    p.add_argument("--check", action="store_true",
                   help="synthesize nothing: print True when OUT already holds a complete corpus made "
                        "with these options, else False (fails when OUT has none)")


def run_cli(tool: str, args: argparse.Namespace, folder: str, synthesize: Callable[[argparse.Namespace], dict],
            check: Callable[[argparse.Namespace], None]) -> dict:
    """A synthesizer's main: ``--check`` against OUT/``folder``'s marker, else the counts checked
    (then ``check``, the tool's own), ``synthesize``, one summary line."""
    if args.check:
        same = same_options(Path(args.out) / folder, vars(args))
        print(same)
        return {"same": same}
    for name in ("num_train", "num_dev", "num_test"):
        if getattr(args, name) < 0:
            raise SystemExit(f"--{name} must be >= 0")
    if args.num_train + args.num_dev + args.num_test == 0:
        raise SystemExit("nothing to synthesize: all of --num_train/--num_dev/--num_test are 0")
    if args.mean_duration <= 0 or args.num_speakers < 1:
        raise SystemExit("--mean_duration and --num_speakers must be positive")
    check(args)
    try:
        stats = synthesize(args)
    except ValueError as e:
        raise SystemExit(str(e)) from e
    u = stats["utterances"]
    print(f"[{tool}] {sum(u.values())} utterances (" + " / ".join(f"{k} {v}" for k, v in u.items())
          + f"), {stats['hours']:.2f} h, mean {stats['mean_s']:.2f} s (min {stats['min_s']:.2f}, "
          f"max {stats['max_s']:.2f}), vocab {stats['vocab_words']} words, {stats['wall_s']:.1f} s wall = "
          f"{stats['audio_s_per_wall_s']:.0f}x real time -> {Path(args.out) / folder}")
    return stats
