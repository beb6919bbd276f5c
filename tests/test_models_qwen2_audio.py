"""Qwen2-Audio behind the encoder seam: a tiny random Qwen2AudioForConditionalGeneration saved by
save_pretrained, loaded by path into SpeechLLM; its audio tower run packed equals the tower on each
utterance alone (and transformers' own forward on a full 30 s input); the released projector and
language model come along; static and pack batches give the same loss and gradients."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from west.models.config import SpeechLLMConfig
from west.models.encoders import encoder_class
from west.models.qwen2_audio import Qwen2AudioPackedEncoder, load_hf_qwen2_audio_tower, tower_frames
from west.models.speech_llm import SpeechLLM
from west.schema import ConfigError

from helpers.speech import (
    N_MELS,
    assert_over_the_window_is_skipped,
    assert_same,
    make_sample,
    packed_batch,
    padded_batch,
    run,
    tiny_qwen2_audio_dir,
    tower_alone,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")
LENS = [37, 100, 64, 9]


@pytest.fixture(scope="module")
def q2a(tmp_path_factory) -> str:
    return tiny_qwen2_audio_dir(tmp_path_factory.mktemp("q2a"))


def config(path: str, **kw) -> SpeechLLMConfig:
    cfg = SpeechLLMConfig.from_dict({"type": "qwen2_audio", "path": path, "freeze_llm": False, **kw})
    cfg.derive()
    return cfg


def feats(seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, N_MELS, generator=g) for n in LENS]


def test_the_registry_serves_it(q2a):
    assert encoder_class("qwen2_audio") is Qwen2AudioPackedEncoder
    shape = config(q2a).speech_shape()
    assert shape.max_frames == 3000 and shape.num_mel_bins == N_MELS and shape.features == "whisper"
    assert [shape.slots(n) for n in LENS] == [tower_frames(n) for n in LENS] == [9, 25, 16, 2]


def test_packed_tower_equals_each_utterance_alone(q2a):
    enc = Qwen2AudioPackedEncoder(load_hf_qwen2_audio_tower(q2a), q2a).eval()
    ref_tower = load_hf_qwen2_audio_tower(q2a).eval()
    xs = feats()
    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad():
        out, layout = enc.forward_flat(torch.cat(xs), cu_seqlens=cu)
        padded, _ = enc.forward_flat(torch.nn.utils.rnn.pad_sequence(xs, batch_first=True),
                                     lengths=torch.tensor(LENS))
        refs = [tower_alone(ref_tower, x) for x in xs]
    assert layout.lengths == [r.shape[0] for r in refs] == [tower_frames(n) for n in LENS]
    assert torch.allclose(out, torch.cat(refs), atol=1e-5)
    assert torch.allclose(padded, out, atol=1e-6)


def test_a_full_window_equals_transformers_own_forward(q2a):
    enc = Qwen2AudioPackedEncoder(load_hf_qwen2_audio_tower(q2a), q2a).eval()
    mel = torch.randn(3000, N_MELS, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours, _ = enc.forward_flat(mel, cu_seqlens=torch.tensor([0, 3000], dtype=torch.int32))
        stock = enc.hf(input_features=mel.t()[None]).last_hidden_state[0]
    assert ours.shape == stock.shape == (750, 32) and torch.allclose(ours, stock, atol=1e-5)


def test_speech_llm_takes_tower_projector_and_language_model_from_the_dir(q2a):
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = SpeechLLM(config(q2a)).eval()
    stored = load_file(f"{q2a}/model.safetensors")
    assert torch.equal(model.projector.net.weight, stored["multi_modal_projector.linear.weight"])
    # the released layout is language_model.model.embed_tokens; transformers 5.17's save_pretrained
    # writes language_model.model.model.embed_tokens (and reads it back): either is the LLM's table
    embed = [k for k in ("language_model.model.embed_tokens.weight", "language_model.model.model.embed_tokens.weight")
             if k in stored]
    assert len(embed) == 1 and torch.equal(model.llm.get_input_embeddings().weight, stored[embed[0]])
    assert torch.equal(model.encoder.hf.layers[0].fc1.weight, stored["audio_tower.layers.0.fc1.weight"])
    samples = [make_sample([("text", [5, 6]), ("speech", x), ("answer", [7, 8, 9])], slots=tower_frames)
               for x in feats()]
    for s, n in zip(samples, LENS):   # the data side reserves what the tower produces
        assert sum(k for _, k, _ in s.speech) == tower_frames(n)
    single = run(model, [padded_batch([s]) for s in samples])
    assert_same(run(model, [packed_batch(samples, sum(len(s.ids) for s in samples) + 3)]), single, "pack")
    assert_same(run(model, [padded_batch(samples, extra_len=2)]), single, "static")
    # dynamic: padded batches of uneven size, accumulated over the step
    assert_same(run(model, [padded_batch(samples[:3]), padded_batch(samples[3:], extra_len=5)]), single, "dynamic")


def test_freezing_and_lora_apply_to_it(q2a):
    cfg = config(q2a, freeze_encoder_blocks=1, freeze_llm=True, lora={"r": 4, "alpha": 8, "dropout": 0.0})
    model = SpeechLLM(cfg)
    tower = model.encoder.hf
    assert not any(p.requires_grad for m in (tower.conv1, tower.conv2, tower.layers[0]) for p in m.parameters())
    assert all(p.requires_grad for p in tower.layers[1].parameters())
    assert all(p.requires_grad for p in model.projector.parameters())
    trainable = [n for n, p in model.llm.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    with pytest.raises(ValueError, match="freeze_encoder_blocks 3 > .* 2 layers"):
        SpeechLLM(config(q2a, freeze_encoder_blocks=3))


def test_the_data_side_writes_qwen2_audio_s_prompt(q2a):
    """Through the directory's own chat template (its processor's) and audio tokens: <|audio_bos|>,
    one <|AUDIO|> per pooled tower frame (the count from west/shapes.py equals what the tower
    gives), <|audio_eos|>; labels on the answer only."""
    from transformers import AutoConfig

    from west.data.config import DataConfig
    from west.data.records import AudioSpec, Message, Record
    from west.data.tokenize import IGNORE_INDEX, PromptEncoder
    from west.models.llm import load_tokenizer

    tok = load_tokenizer(q2a)
    audio, bos, eos = (tok.convert_tokens_to_ids(t) for t in ("<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"))
    assert audio == AutoConfig.from_pretrained(q2a).audio_token_index
    shape = config(q2a).speech_shape()
    encoder = Qwen2AudioPackedEncoder(load_hf_qwen2_audio_tower(q2a), q2a).eval()
    pe = PromptEncoder(tok, DataConfig(prompt="<|speech|>Transcribe the speech."), shape)
    for mel in feats():
        enc = pe.encode(Record("a", "x:1", [AudioSpec()], txt="hello world"), [mel.shape[0]])
        (start, n), = enc.spans
        with torch.no_grad():
            produced = encoder.forward_flat(mel[None], lengths=torch.tensor([mel.shape[0]]))[0].shape[0]
        assert n == produced == tower_frames(mel.shape[0])
        assert enc.ids[start - 1] == bos and enc.ids[start: start + n] == [audio] * n and enc.ids[start + n] == eos
        text = tok.decode(enc.ids)
        assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>")  # the processor's
        assert "<|im_start|>user\nAudio 1: <|audio_bos|>" in text   # as its processor renders an audio item
        assert "<|audio_eos|>\nTranscribe the speech.<|im_end|>" in text
        assert tok.decode([t for t in enc.labels if t != IGNORE_INDEX]) == "hello world<|im_end|>"
    # a conversation: every audio part numbered as the template numbers them, labels on the answers only
    rec = Record("c", "x:2", [AudioSpec(), AudioSpec()], messages=[
        Message("user", [("audio", 0), ("text", "Compare.")]), Message("assistant", [("text", "hello")]),
        Message("user", [("text", "And ")]), Message("user", [("audio", 1)]), Message("assistant", [("text", "world")])])
    mels = feats()[:2]
    enc = pe.encode(rec, [m.shape[0] for m in mels])
    text = tok.decode(enc.ids)
    assert "Audio 1: <|audio_bos|>" in text and "Audio 2: <|audio_bos|>" in text
    assert [n for _, n in enc.spans] == [tower_frames(m.shape[0]) for m in mels]
    assert tok.decode([t for t in enc.labels if t != IGNORE_INDEX]) == "hello<|im_end|>world<|im_end|>"
    prompt_ids, spans = pe.encode_prompt(rec, [m.shape[0] for m in mels])
    assert len(spans) == 1 and tok.decode(prompt_ids).endswith("<|im_start|>assistant\n")


def test_clear_errors(q2a, tmp_path):
    from helpers.speech import write_base

    other = write_base(tmp_path / "qwen2")   # a plain Qwen2 LLM dir
    with pytest.raises(ConfigError, match="model_type='qwen2'.*qwen2_audio"):
        config(str(other)).speech_shape()
    with pytest.raises(ConfigError, match="model.path"):
        config(str(tmp_path / "missing")).speech_shape()
    no_processor = tmp_path / "no_processor"
    shutil.copytree(q2a, no_processor)
    (no_processor / "processor_config.json").unlink()
    with pytest.raises(ConfigError, match="no Qwen2-Audio processor|no loadable processor"):
        config(str(no_processor)).speech_shape()
    bad_mels = tmp_path / "bad_mels"
    shutil.copytree(q2a, bad_mels)
    proc = json.loads((bad_mels / "processor_config.json").read_text())
    proc["feature_extractor"]["feature_size"] = 128
    (bad_mels / "processor_config.json").write_text(json.dumps(proc))
    with pytest.raises(ConfigError, match="feature_size=128"):
        config(str(bad_mels)).speech_shape()


def test_audio_over_the_tower_s_window_is_a_counted_skip(q2a, tmp_path):
    assert_over_the_window_is_skipped(q2a, config(q2a), tmp_path, 30.5)


def test_export_loads_in_transformers_and_gives_west_s_loss(q2a, tmp_path):
    """west (pad_to_30s: the released model's own 30 s input) -> export -> from_pretrained: same loss."""
    from transformers import AutoConfig, Qwen2AudioForConditionalGeneration

    from west.checkpoint.released import export_qwen2_audio
    from west.models.encoders import exporter

    from helpers.speech import Sample

    assert exporter("qwen2_audio") is export_qwen2_audio
    torch.manual_seed(0)
    model = SpeechLLM(config(q2a, encoder={"pad_to_30s": True})).eval()
    with torch.no_grad():   # "trained": every part moved away from the released weights
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    audio_id = AutoConfig.from_pretrained(q2a).audio_token_index
    mel = feats()[1]
    n = tower_frames(mel.shape[0])
    ids = [5, 6] + [audio_id] * n + [7, 8, 9, 10]
    target = [False] * (2 + n) + [True] * 4
    sample = Sample(ids, target, [(2, n, mel)])
    with torch.no_grad():
        out = model(padded_batch([sample]))
    west_loss = float(out["loss_sum"]) / out["n_tokens"]

    export_qwen2_audio(model, tmp_path / "export")
    hf = Qwen2AudioForConditionalGeneration.from_pretrained(tmp_path / "export").eval()
    fill = (mel.max() - 2.0).clamp(min=-1.5)           # what west pads with (the extractor's silence)
    full = torch.full((3000, N_MELS), float(fill))
    full[: mel.shape[0]] = mel
    labels = torch.tensor([t if y else -100 for t, y in zip(ids, target)])[None]
    with torch.no_grad():
        hf_out = hf(input_ids=torch.tensor([ids]), input_features=full.t()[None],
                    feature_attention_mask=(torch.arange(3000) < mel.shape[0]).long()[None], labels=labels)
    assert float(hf_out.loss) == pytest.approx(west_loss, rel=1e-5)


@pytest.mark.parametrize("n", [32370, 14407, 16000 * 2 + 37, 8000, 16000])
def test_audio_token_count_and_features_equal_the_processor_s(q2a, n):
    """From a raw waveform of any length (multiples of 160 or not): as many <|AUDIO|> tokens as the
    directory's own processor places, and the processor's features on every real frame."""
    import numpy as np
    from transformers import AutoProcessor

    from west.data.whisper_features import whisper_frames, whisper_log_mel

    proc = AutoProcessor.from_pretrained(q2a)
    rng = np.random.default_rng(n)
    wave = (0.1 * rng.standard_normal(n)).astype(np.float32)
    out = proc(text="<|audio_bos|><|AUDIO|><|audio_eos|>", audio=[wave], sampling_rate=16000, return_tensors="np")
    audio_id = proc.tokenizer.convert_tokens_to_ids("<|AUDIO|>")
    assert tower_frames(whisper_frames(n)) == int((out["input_ids"][0] == audio_id).sum())
    real = int(out["feature_attention_mask"][0].sum())
    mel = whisper_log_mel(wave, out["input_features"].shape[1])
    assert mel.shape[0] == real
    np.testing.assert_allclose(mel, out["input_features"][0].T[:real], rtol=0, atol=1e-5)
