"""Qwen3-ASR behind the encoder seam: a tiny random Qwen3ASRForConditionalGeneration saved by
save_pretrained, loaded by path into SpeechLLM. Its encoder run packed equals transformers' encoder
on each utterance alone (chunks and attention windows included); west's loss and gradients equal
transformers' own model on each conversation alone, in every batch mode; the data side's features
and audio token count equal the directory's processor's; export goes back through from_pretrained."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from west.models.config import SpeechLLMConfig
from west.models.encoders import encoder_class
from west.models.qwen3_asr import Qwen3ASRPackedEncoder, encoder_frames, load_hf_qwen3_asr_encoder
from west.models.speech_llm import SpeechLLM
from west.schema import ConfigError

from helpers.speech import (
    N_MELS,
    assert_same,
    make_sample,
    packed_batch,
    padded_batch,
    run,
    tiny_qwen3_asr_dir,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")
# 37: one partial chunk; 100: one full chunk; 264: three chunks, two attention windows (the tiny
# model's window is 2 chunks = 26 frames); 530: six chunks, three windows; 9: a handful of frames
LENS = [37, 100, 264, 9, 530]


@pytest.fixture(scope="module")
def q3(tmp_path_factory) -> str:
    return tiny_qwen3_asr_dir(tmp_path_factory.mktemp("q3asr"))


@pytest.fixture(scope="module")
def hf_model(q3):
    from transformers import Qwen3ASRForConditionalGeneration

    return Qwen3ASRForConditionalGeneration.from_pretrained(q3, attn_implementation="sdpa").eval()


def config(path: str, **kw) -> SpeechLLMConfig:
    cfg = SpeechLLMConfig.from_dict({"type": "qwen3_asr", "path": path, "freeze_llm": False, **kw})
    cfg.derive()
    return cfg


def feats(seed: int = 1, lens=LENS) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, N_MELS, generator=g) for n in lens]


def stock_input(mels: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_features, input_features_mask) as Qwen3ASRProcessor lays mels out: zero-padded to whole
    chunks of 100 frames (and to the longest of the call)."""
    width = max(-(-m.shape[0] // 100) * 100 for m in mels)
    x, mask = torch.zeros(len(mels), N_MELS, width), torch.zeros(len(mels), width, dtype=torch.long)
    for i, m in enumerate(mels):
        x[i, :, : m.shape[0]], mask[i, : m.shape[0]] = m.t(), 1
    return x, mask


def test_the_registry_serves_it(q3):
    assert encoder_class("qwen3_asr") is Qwen3ASRPackedEncoder
    assert not Qwen3ASRPackedEncoder.window_mode   # no 30 s padded row in the benchmark
    cfg = config(q3)
    assert (cfg.projector.type, cfg.projector.stride, cfg.projector.hidden_dim) == ("mlp", 1, 32)
    assert cfg.encoder.type == "qwen3_asr" and cfg.llm.path == q3
    shape = cfg.speech_shape()
    assert shape.num_mel_bins == N_MELS and shape.features == "qwen3_asr" and shape.chunk_frames == 100
    assert shape.audio_tokens == ("<|audio_start|>", "<|audio_pad|>", "<|audio_end|>")
    assert [shape.slots(n) for n in LENS] == [encoder_frames(n) for n in LENS] == [5, 13, 34, 2, 69]


def test_packed_encoder_equals_transformers_on_each_utterance_alone(q3, hf_model):
    enc = Qwen3ASRPackedEncoder(load_hf_qwen3_asr_encoder(q3), q3).eval()
    xs = feats()
    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad():
        out, layout = enc.forward_flat(torch.cat(xs), cu_seqlens=cu)
        padded, _ = enc.forward_flat(torch.nn.utils.rnn.pad_sequence(xs, batch_first=True),
                                     lengths=torch.tensor(LENS))
        refs = [hf_model.model.audio_tower(*stock_input([x])).last_hidden_state for x in xs]
    assert layout.lengths == [r.shape[0] for r in refs] == [encoder_frames(n) for n in LENS]
    assert torch.allclose(out, torch.cat(refs), atol=1e-5)
    assert torch.allclose(padded, out, atol=1e-6)


def conversations(audio_id: int) -> list:
    """A text-only conversation and audio ones (one with two audio parts); placeholders are the
    model's audio token, so that transformers' own forward finds them."""
    g = torch.Generator().manual_seed(3)

    def toks(n):
        return torch.randint(4, 200, (n,), generator=g).tolist()

    def sample(pieces):
        s = make_sample(pieces, slots=encoder_frames)
        for start, n, _ in s.speech:
            s.ids[start: start + n] = [audio_id] * n
        return s

    a, b, c, d = feats(lens=[37, 264, 9, 130])
    return [sample([("text", toks(3)), ("speech", a), ("text", toks(2)), ("answer", toks(5))]),
            sample([("text", toks(6)), ("answer", toks(4))]),
            sample([("speech", b), ("answer", toks(7))]),
            sample([("text", toks(2)), ("speech", c), ("text", toks(1)), ("speech", d), ("answer", toks(3))])]


def west_to_hf(name: str) -> str:
    """A SpeechLLM parameter's name in Qwen3ASRForConditionalGeneration."""
    for ours, theirs in (("encoder.hf.", "model.audio_tower."), ("projector.net.0.", "model.multi_modal_projector.linear_1."),
                         ("projector.net.3.", "model.multi_modal_projector.linear_2."),
                         ("llm.model.", "model.language_model."), ("llm.lm_head.", "lm_head.")):
        if name.startswith(ours):
            return theirs + name[len(ours):]
    raise KeyError(name)


def hf_run(hf, samples, backward: bool = True) -> tuple[float, int, dict]:
    """transformers' own forward on each conversation alone: (summed loss, label tokens, gradients)."""
    hf.zero_grad(set_to_none=True)
    total, n_tok = 0.0, 0
    for s in samples:
        labels = torch.tensor([t if y else -100 for t, y in zip(s.ids, s.target)])[None]
        kw = dict(zip(("input_features", "input_features_mask"), stock_input([f for _, _, f in s.speech]))) \
            if s.speech else {}
        loss = hf(input_ids=torch.tensor([s.ids]), labels=labels, **kw).loss * sum(s.target)
        if backward:
            loss.backward()
        total, n_tok = total + loss.item(), n_tok + sum(s.target)
    return total, n_tok, {n: p.grad.clone() for n, p in hf.named_parameters() if p.grad is not None}


def test_loss_and_gradients_equal_transformers_own_forward_in_every_mode(q3, hf_model):
    from transformers import AutoConfig

    torch.manual_seed(0)
    model = SpeechLLM(config(q3)).eval()
    samples = conversations(AutoConfig.from_pretrained(q3).audio_token_id)
    single = run(model, [padded_batch([s]) for s in samples])
    hf_loss, hf_tokens, hf_grads = hf_run(hf_model, samples)
    assert single[1] == hf_tokens and single[0] == pytest.approx(hf_loss, rel=1e-5)
    grads = single[3]
    assert {west_to_hf(n) for n in grads} == set(hf_grads)
    floor = 1e-3 * max(g.abs().max().item() for g in hf_grads.values())
    for name, g in grads.items():
        ref = hf_grads[west_to_hf(name)]
        assert (g - ref).abs().max().item() <= 1e-5 * max(ref.abs().max().item(), floor), name
    # one packed row holding a text-only conversation and audio ones (one with two audio parts)
    assert_same(run(model, [packed_batch(samples, sum(len(s.ids) for s in samples) + 3)]), single, "pack")
    assert_same(run(model, [padded_batch(samples, extra_len=2)]), single, "static")
    assert_same(run(model, [padded_batch(samples[:3]), padded_batch(samples[3:], extra_len=5)]), single, "dynamic")
    assert_same(run(model, [packed_batch(samples[:2], 200), packed_batch(samples[2:], 300, encoder="padded")]),
                single, "pack, accumulated over two micro-batches")


def test_freezing_and_lora_apply_to_it(q3):
    cfg = config(q3, freeze_encoder_blocks=1, freeze_llm=True, lora={"r": 4, "alpha": 8, "dropout": 0.0})
    model = SpeechLLM(cfg)
    enc = model.encoder.hf
    frozen = (enc.conv2d1, enc.conv2d2, enc.conv2d3, enc.conv_out, enc.layers[0])
    assert not any(p.requires_grad for m in frozen for p in m.parameters())
    assert all(p.requires_grad for p in enc.layers[1].parameters())
    assert all(p.requires_grad for p in model.projector.parameters())
    trainable = [n for n, p in model.llm.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert not any(p.requires_grad for p in SpeechLLM(config(q3, freeze_encoder=True)).encoder.parameters())
    with pytest.raises(ValueError, match="freeze_encoder_blocks 3 > .* 2 layers"):
        SpeechLLM(config(q3, freeze_encoder_blocks=3))


def test_prompt_ids_features_and_token_count_equal_the_processor_s(q3):
    """From raw waveforms of lengths that are not multiples of 160 (and one under the processor's
    0.5 s minimum): west's log-mel equals the processor's on every real frame, and the prompt west
    builds through the directory's chat template is the processor's input_ids, token for token
    (one <|audio_pad|> per encoder frame)."""
    from transformers import AutoProcessor

    from west.data.config import DataConfig
    from west.data.qwen3_asr_features import qwen3_asr_frames, qwen3_asr_log_mel
    from west.data.records import AudioSpec, Record
    from west.data.tokenize import IGNORE_INDEX, PromptEncoder
    from west.models.llm import load_tokenizer

    proc = AutoProcessor.from_pretrained(q3)
    tok = load_tokenizer(q3)
    pe = PromptEncoder(tok, DataConfig(prompt="<|speech|>"), config(q3).speech_shape())
    messages = [{"role": "user", "content": [{"type": "audio", "path": "x.wav"}]}]
    text = proc.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    for n in (32370, 14407, 5003, 16000 * 3 + 37):
        wave = (0.1 * np.random.default_rng(n).standard_normal(n)).astype(np.float32)
        out = proc(text=text, audio=[wave], sampling_rate=16000, return_tensors="pt")
        real = int(out["input_features_mask"][0].sum())
        mel = qwen3_asr_log_mel(wave, N_MELS)
        assert mel.shape[0] == real == qwen3_asr_frames(n)
        np.testing.assert_allclose(mel, out["input_features"][0].T[:real].numpy(), rtol=0, atol=1e-5)
        rec = Record("a", "x:1", [AudioSpec()], txt="hello world")
        ids, spans = pe.encode_prompt(rec, [real])
        assert ids == out["input_ids"][0].tolist()
        assert spans[0][1] == int((out["input_ids"] == proc.audio_token_id).sum()) == encoder_frames(real)
        enc = pe.encode(rec, [real])
        assert enc.ids[: len(ids)] == ids
        assert tok.decode([t for t in enc.labels if t != IGNORE_INDEX]) == "hello world<|im_end|>"


def test_clear_errors(q3, tmp_path):
    from helpers.speech import tiny_qwen2_audio_dir, write_base

    with pytest.raises(ConfigError, match="model_type='qwen2'.*qwen3_asr"):
        config(str(write_base(tmp_path / "qwen2")))
    with pytest.raises(ConfigError, match="model_type='qwen2_audio'.*qwen3_asr"):
        config(tiny_qwen2_audio_dir(tmp_path / "q2a"))
    with pytest.raises(ConfigError, match="model.path"):
        config(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="pad_to_30s"):
        SpeechLLM(config(q3, encoder={"pad_to_30s": True}))

    def broken(name: str, edit) -> str:
        d = tmp_path / name
        shutil.copytree(q3, d)
        edit(d)
        return str(d)

    no_processor = broken("no_processor", lambda d: (d / "processor_config.json").unlink())
    with pytest.raises(ConfigError, match="no Qwen3-ASR processor|no loadable processor"):
        config(no_processor).speech_shape()
    for key, value in (("feature_size", 128), ("sampling_rate", 8000), ("n_window", 25)):
        def edit(d, key=key, value=value):
            proc = json.loads((d / "processor_config.json").read_text())
            proc["feature_extractor"][key] = value
            (d / "processor_config.json").write_text(json.dumps(proc))
        with pytest.raises(ConfigError, match=f"model.path.*feature extractor {key}={value}"):
            config(broken(f"bad_{key}", edit)).speech_shape()


def test_audio_longer_than_the_model_takes_is_a_counted_skip(q3, tmp_path):
    from west.data.config import DataConfig
    from west.data.dataset import SpeechDataset
    from west.data.qwen3_asr_features import qwen3_asr_log_mel
    from west.data.stats import SkipSample
    from west.models.llm import load_tokenizer

    from helpers.corpus import make_wav, transcript, write_jsonl

    # the plan reads durations from the list: the 1300 s line is skipped before any audio is read
    rows = [{"key": f"u{i}", "wav": str(make_wav(tmp_path / f"u{i}.wav", 0.6 + i / 10, seed=i)), "txt": transcript(i),
             "duration": s} for i, s in enumerate([0.6, 1300.0, 0.8])]
    ds = SpeechDataset(str(write_jsonl(tmp_path / "long.list", rows)), load_tokenizer(q3),
                       DataConfig(features="qwen3_asr", num_mel_bins=N_MELS, batch_type="pack", pack_tokens=512),
                       config(q3).speech_shape(), training=False)
    assert ds.list_skips[0][1].as_dict() == {"too_long": 1}
    assert sorted(k for b, _ in iter(ds) if b is not None for k in b.keys) == ["u0", "u2"]
    with pytest.raises(SkipSample, match="too_long|exceed"):   # decoded audio is checked again
        qwen3_asr_log_mel(np.zeros(16000, np.float32), N_MELS, max_frames=99)


def test_export_with_lora_merged_loads_in_transformers_and_gives_west_s_loss(q3, tmp_path):
    from transformers import AutoConfig, AutoProcessor, Qwen3ASRForConditionalGeneration

    from west.checkpoint.released import export_qwen3_asr
    from west.models.encoders import exporter

    assert exporter("qwen3_asr") is export_qwen3_asr
    torch.manual_seed(0)
    model = SpeechLLM(config(q3, freeze_llm=True, lora={"r": 4, "alpha": 8, "dropout": 0.0})).eval()
    with torch.no_grad():   # "trained": encoder, projector and adapters moved away from the released weights
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    samples = conversations(AutoConfig.from_pretrained(q3).audio_token_id)
    with torch.no_grad():
        west = [model(padded_batch([s])) for s in samples]
    export_qwen3_asr(model, tmp_path / "export")
    hf = Qwen3ASRForConditionalGeneration.from_pretrained(tmp_path / "export", attn_implementation="sdpa").eval()
    with torch.no_grad():
        hf_loss, hf_tokens, _ = hf_run(hf, samples, backward=False)
    assert sum(o["n_tokens"] for o in west) == hf_tokens
    assert sum(float(o["loss_sum"]) for o in west) == pytest.approx(hf_loss, rel=1e-5)
    assert AutoProcessor.from_pretrained(tmp_path / "export").audio_token == "<|audio_pad|>"
