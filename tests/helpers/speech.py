"""Tiny SpeechLLM configs, speech samples and their padded / packed batches, LoRA models, a tiny Whisper."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import WhisperConfig, WhisperForConditionalGeneration

from west.batch import IGNORE_INDEX, Batch
from west.models.config import LLMConfig, LoraSettings, ProjectorConfig, SpeechLLMConfig
from west.models.speech_llm import SpeechLLM
from west.shapes import num_speech_tokens

from helpers.batches import packed_row, padded_rows
from helpers.e2e import tiny_encoder

N_MELS = 80


VOCAB, PAD, SPEECH = 97, 0, 3


RTOL = 1e-5


# ----------------------------------------------------------------------------- batch builders
@dataclass
class Sample:
    ids: list            # token ids, placeholders included
    target: list         # bool per position: this token is a label (predicted from the previous one)
    speech: list         # (start, n_slots, feats) per speech segment, in order
    transcripts: list = None  # CTC target ids per speech segment ([] = unknown); None = no CTC targets


def make_sample(pieces, rate=4, stride=2, slots=None):
    """pieces: ("text", ids), ("answer", ids) (labelled) or ("speech", feats (T, 80)); ``slots``:
    the encoder's frame count for T feature frames (default: the Conformer's at rate / stride)."""
    ids, target, speech = [], [], []
    for kind, x in pieces:
        if kind == "speech":
            n = slots(len(x)) if slots is not None else num_speech_tokens(len(x), rate, stride)
            speech.append((len(ids), n, x))
            ids += [SPEECH] * n
            target += [False] * n
        else:
            ids += list(x)
            target += [kind == "answer"] * len(x)
    answers = [list(x) for kind, x in pieces if kind == "answer"]
    # like west.data: a plain ASR sample (one speech part) has its answer as transcript
    transcripts = [answers[0] if len(speech) == 1 and answers else [] for _ in speech]
    return Sample(ids, target, speech, transcripts)


def _ctc(samples) -> dict:
    ts = [t for s in samples for t in (s.transcripts or [])]
    if not ts:
        return {}
    return dict(ctc_targets=torch.tensor([x for t in ts for x in t], dtype=torch.long),
                ctc_target_lens=torch.tensor([len(t) for t in ts], dtype=torch.long))


def _labels(s: Sample) -> list:
    """Pre-shifted: labels[t] = ids[t+1] if that token is a target, IGNORE at the last position."""
    return [s.ids[t + 1] if s.target[t + 1] else IGNORE_INDEX for t in range(len(s.ids) - 1)] + [IGNORE_INDEX]


def _feats(samples, encoder, extra_frames=0):
    segs = [f for s in samples for _, _, f in s.speech]
    lens = torch.tensor([len(f) for f in segs], dtype=torch.int64)
    if not segs:
        return dict()
    if encoder == "packed":
        cu = torch.zeros(len(segs) + 1, dtype=torch.int32)
        cu[1:] = lens.cumsum(0)
        return dict(feats=torch.cat(segs), feat_lens=lens, feat_cu_seqlens=cu, feat_max_len=int(lens.max()))
    out = torch.zeros(len(segs), int(lens.max()) + extra_frames, 80)
    for i, f in enumerate(segs):
        out[i, : len(f)] = f
    return dict(feats=out, feat_lens=lens)


def padded_batch(samples, extra_len=0, extra_frames=0) -> Batch:
    spans = [(r, a, n_slots) for r, s in enumerate(samples) for a, n_slots, _ in s.speech]
    return Batch(**padded_rows([(s.ids, _labels(s)) for s in samples], PAD, extra_len),
                 speech_spans=torch.tensor(spans, dtype=torch.int64).view(-1, 3),
                 **_feats(samples, "padded", extra_frames), **_ctc(samples))


def packed_batch(samples, pack_tokens, encoder="packed") -> Batch:
    spans, start = [], 0
    for s in samples:
        spans += [(0, start + a, n) for a, n, _ in s.speech]
        start += len(s.ids)
    return Batch(**packed_row([(s.ids, _labels(s)) for s in samples], pack_tokens, PAD),
                 speech_spans=torch.tensor(spans, dtype=torch.int64).view(-1, 3),
                 **_feats(samples, encoder), **_ctc(samples))


def tiny_config(**kw) -> SpeechLLMConfig:
    return SpeechLLMConfig(
        encoder=tiny_encoder(dropout=0.0, buckets_per_octave=2),
        projector=ProjectorConfig(stride=2, hidden_dim=48),
        llm=LLMConfig(config=dict(model_type="qwen2", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  attention_dropout=0.0)),
        freeze_llm=False,
        **kw,
    )


def tiny_model(seed=0, **kw) -> SpeechLLM:
    torch.manual_seed(seed)
    return SpeechLLM(tiny_config(**kw)).eval()  # eval: dropout off, still differentiable


def samples(seed=1):
    g = torch.Generator().manual_seed(seed)

    def toks(n):
        return torch.randint(4, VOCAB, (n,), generator=g).tolist()

    def wav(t):
        return torch.randn(t, 80, generator=g)

    return [
        make_sample([("text", toks(4)), ("speech", wav(37)), ("text", toks(2)), ("answer", toks(5))]),
        make_sample([("speech", wav(100)), ("answer", toks(8))]),
        make_sample([("text", toks(3)), ("speech", wav(15)), ("text", toks(1)), ("speech", wav(23)),
                     ("answer", toks(3))]),
        make_sample([("text", toks(6)), ("answer", toks(4))]),          # text only
        make_sample([("text", toks(2)), ("speech", wav(64)), ("text", toks(2)), ("answer", toks(6))]),
    ]


def run(model, batches):
    """Sum loss/token/correct counts over batches; gradients of the summed loss."""
    model.zero_grad(set_to_none=True)
    total, n_tok, n_cor = 0.0, 0, 0
    for b in batches:
        out = model(b)
        out["loss_sum"].backward()
        total += out["loss_sum"].item()
        n_tok += out["n_tokens"]
        n_cor += out["n_correct"]
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return total, n_tok, n_cor, grads


def assert_same(a, b, what):
    la, ta, ca, ga = a
    lb, tb, cb, gb = b
    assert ta == tb and ca == cb, what
    assert abs(la - lb) <= RTOL * abs(lb), (what, la, lb)
    assert ga.keys() == gb.keys(), what
    # Relative to each parameter's largest gradient entry; gradients that are zero in exact
    # arithmetic (e.g. attention key biases: softmax is shift-invariant) are compared
    # against 1e-3 of the model's largest gradient instead of their own round-off.
    floor = 1e-3 * max(g.abs().max().item() for g in gb.values())
    for name in gb:
        scale = max(gb[name].abs().max().item(), floor)
        assert (ga[name] - gb[name]).abs().max().item() <= RTOL * scale, (what, name)


ALL_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_model(seed=0, targets=ALL_PROJ, llm_path=None, llm_dtype="float32", **kw) -> SpeechLLM:
    """LoRA on attention and MLP projections, dropout 0; B drawn at random (peft starts it at 0,
    which would leave every A gradient exactly 0 and prove nothing about A). With ``llm_path``
    the base LLM is read from that dir; ``llm_dtype`` its dtype (the adapters stay float32)."""
    torch.manual_seed(seed)
    cfg = tiny_config(lora=LoraSettings(r=4, alpha=8, dropout=0.0, target_modules=targets), **kw)
    if llm_path is not None:
        cfg.llm = LLMConfig(path=str(llm_path))
    cfg.llm.dtype = llm_dtype
    model = SpeechLLM(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    return model.eval()


def write_base(path, seed=0):
    torch.manual_seed(seed)
    SpeechLLM(tiny_config()).llm.save_pretrained(path)
    return path


def tiny_whisper_dir(path, n_mels: int = N_MELS) -> str:
    """A random tiny Whisper written the way users get one: save_pretrained of the full model."""
    conf = WhisperConfig(
        d_model=32, encoder_layers=2, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=n_mels, max_source_positions=1500,
        vocab_size=100, max_target_positions=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1, suppress_tokens=None, begin_suppress_tokens=None)
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration._from_config(conf)
    with torch.no_grad():  # random, non-trivial positions and biases
        for p in model.model.encoder.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(str(path))
    return str(path)


def tower_alone(tower, mel: torch.Tensor) -> torch.Tensor:
    """transformers' Qwen2AudioEncoder.forward on one utterance without its 30 s padding: the same
    modules in the same order (its forward refuses anything but 3000 frames)."""
    import torch.nn.functional as F

    x = F.gelu(tower.conv2(F.gelu(tower.conv1(mel.t()[None]))))[0].t()
    x = x + tower.embed_positions.weight[: x.shape[0]]
    for layer in tower.layers:
        out = layer(x[None], None)
        x = (out[0] if isinstance(out, tuple) else out)[0]
    x = F.avg_pool1d(x.t()[None], 2, 2)[0].t()
    return tower.layer_norm(x)


def tiny_qwen2_audio_dir(path) -> str:
    """A random tiny Qwen2AudioForConditionalGeneration written by save_pretrained, with a processor
    and a tokenizer that knows Qwen2-Audio's audio tokens: what a user's download looks like."""
    from west.models.random_qwen2_audio import write_random_qwen2_audio

    return write_random_qwen2_audio(path, n_mels=N_MELS)


def tiny_qwen3_asr_dir(path) -> str:
    """A random tiny Qwen3ASRForConditionalGeneration written by save_pretrained, with its processor,
    tokenizer (Qwen3-ASR's audio tokens named) and chat template: what a user's download looks like."""
    from west.models.random_qwen3_asr import write_random_qwen3_asr

    return write_random_qwen3_asr(path, n_mels=N_MELS)


def tiny_qwen2_5_omni_dir(path, full: bool = False) -> str:
    """A random tiny Qwen2.5-Omni written by save_pretrained as the release lays it out: its thinker
    alone, or with ``full`` the whole model (talker and token2wav too), with the processor's files
    and a tokenizer that knows its audio tokens."""
    from west.models.random_qwen2_5_omni import write_random_qwen2_5_omni

    return write_random_qwen2_5_omni(path, n_mels=N_MELS, full=full)


def assert_over_the_window_is_skipped(path: str, config: SpeechLLMConfig, tmp_path, seconds: float) -> None:
    """Of three utterances, the one of ``seconds`` (past a released model's audio window) is a counted
    ``too_long`` skip when the epoch is planned; the other two are batched."""
    from west.data.config import DataConfig
    from west.data.dataset import SpeechDataset
    from west.models.llm import load_tokenizer

    from helpers.corpus import make_wav, transcript, write_jsonl

    rows = [{"key": f"u{i}", "wav": str(make_wav(tmp_path / f"u{i}.wav", s, seed=i)), "txt": transcript(i),
             "duration": s} for i, s in enumerate([1.0, seconds, 0.7])]
    ds = SpeechDataset(str(write_jsonl(tmp_path / "long.list", rows)), load_tokenizer(path),
                       DataConfig(features="whisper", batch_type="pack", pack_tokens=512), config.speech_shape(),
                       training=False)
    assert ds.list_skips[0][1].as_dict() == {"too_long": 1}
    assert sorted(k for b, _ in iter(ds) if b is not None for k in b.keys) == ["u0", "u2"]
