"""Qwen2.5-Omni's thinker behind the encoder seam: tiny random directories (the thinker alone, and the
full model with talker and token2wav) written by save_pretrained and loaded by path. The packed audio
tower equals transformers' tower on each utterance alone; loss and gradients equal transformers' own
thinker on each conversation alone in every batch mode (a packed row mixing a text-only sample and
audio samples); the multimodal positions are the thinker's, per sample; export goes back to a
directory the thinker's from_pretrained loads."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from west.models.config import SpeechLLMConfig
from west.models.encoders import encoder_class, release_of
from west.models.qwen2_5_omni import Qwen2_5OmniPackedEncoder, load_hf_omni_tower, load_thinker_part
from west.models.qwen2_5_omni_llm import mrope_position_ids
from west.models.speech_llm import SpeechLLM
from west.models.whisper_encoder import hf_part
from west.schema import ConfigError
from west.shapes import frames_after

from helpers.speech import (
    N_MELS,
    Sample,
    assert_over_the_window_is_skipped,
    assert_same,
    packed_batch,
    padded_batch,
    run,
    tiny_qwen2_5_omni_dir,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")
LENS = [37, 100, 64, 9, 20]


@pytest.fixture(scope="module")
def omni(tmp_path_factory) -> str:
    return tiny_qwen2_5_omni_dir(tmp_path_factory.mktemp("omni"))


@pytest.fixture(scope="module")
def omni_full(tmp_path_factory) -> str:
    return tiny_qwen2_5_omni_dir(tmp_path_factory.mktemp("omni_full"), full=True)


@pytest.fixture(scope="module")
def thinker(omni):
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration

    return Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(omni).eval()


def config(path: str, **kw) -> SpeechLLMConfig:
    cfg = SpeechLLMConfig.from_dict({"type": "qwen2_5_omni", "path": path, "freeze_llm": False, **kw})
    cfg.derive()
    return cfg


def feats(seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, N_MELS, generator=g) for n in LENS]


def slots(n_frames: int) -> int:
    from west.models.qwen2_audio import QWEN2_AUDIO_STAGES

    return frames_after(QWEN2_AUDIO_STAGES, n_frames)


def conversations(conf) -> list[Sample]:
    """A text-only sample, one with an audio part, one with two, in the thinker's own tokens
    (<|audio_bos|>, one <|AUDIO|> per tower frame, <|audio_eos|>)."""
    g = torch.Generator().manual_seed(3)
    xs = feats()

    def sample(pieces) -> Sample:
        ids, target, speech = [], [], []
        for kind, x in pieces:
            if kind == "speech":
                ids.append(conf.audio_start_token_id)
                speech.append((len(ids), slots(len(x)), x))
                ids += [conf.audio_token_index] * slots(len(x)) + [conf.audio_end_token_id]
                target += [False] * (slots(len(x)) + 2)
            else:
                ids += torch.randint(4, 270, (x,), generator=g).tolist()
                target += [kind == "answer"] * x
        return Sample(ids, target, speech)

    return [sample([("text", 5), ("answer", 4)]),
            sample([("text", 3), ("speech", xs[0]), ("text", 2), ("answer", 5)]),
            sample([("speech", xs[2]), ("text", 1), ("speech", xs[4]), ("answer", 3)])]


def hf_step(thinker, samples: list[Sample]):
    """transformers' thinker on each conversation alone: (summed loss, label tokens, gradients by west's names)."""
    thinker.zero_grad(set_to_none=True)
    total, n_tok = 0.0, 0
    for s in samples:
        ids = torch.tensor([s.ids])
        labels = torch.tensor([[t if y else -100 for t, y in zip(s.ids, s.target)]])
        kw = {}
        if s.speech:
            mels = [x for _, _, x in s.speech]
            kw["input_features"] = torch.nn.utils.rnn.pad_sequence(mels, batch_first=True).transpose(1, 2)
            kw["feature_attention_mask"] = (torch.arange(kw["input_features"].shape[-1])[None]
                                            < torch.tensor([len(x) for x in mels])[:, None]).long()
        loss = thinker(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels, **kw).loss
        n = int((labels[:, 1:] != -100).sum())
        (loss * n).backward()
        total, n_tok = total + float(loss.detach()) * n, n_tok + n
    params = dict(thinker.named_parameters())
    return total, n_tok, params


def hf_name(name: str, thinker) -> str:
    """What a west parameter is called in transformers' thinker (west: encoder, then projector =
    tower.proj): the parts sit under ``model.`` since transformers 5.2x, beside it in 5.17."""
    tower = "model.audio_tower." if hasattr(thinker.model, "audio_tower") else "audio_tower."
    text = "model.language_model." if hasattr(thinker.model, "language_model") else "model."
    names = {"encoder.hf.": tower, "projector.net.": tower + "proj.", "llm.model.": text, "llm.lm_head.": "lm_head."}
    prefix = next(p for p in names if name.startswith(p))
    return names[prefix] + name[len(prefix):]


def test_the_registry_serves_it(omni):
    assert encoder_class("qwen2_5_omni") is Qwen2_5OmniPackedEncoder
    assert release_of("qwen2_5_omni_thinker").name == release_of("qwen2_5_omni").name == "qwen2_5_omni"
    shape = config(omni).speech_shape()
    # the processor's window (chunk_length 300 s, as released), the tower's mel bins
    assert shape.max_frames == 30000 and shape.num_mel_bins == N_MELS and shape.features == "whisper"
    assert [shape.slots(n) for n in LENS] == [slots(n) for n in LENS] == [9, 25, 16, 2, 5]


def test_packed_tower_equals_transformers_on_each_utterance_alone(omni):
    """Chunks of 2 * n_window = 10 mel frames (odd conv counts per chunk: pooled pairs straddle them)."""
    enc = Qwen2_5OmniPackedEncoder(load_hf_omni_tower(omni), omni).eval()
    ref = load_thinker_part(omni, "audio_tower").eval()   # transformers' own forward, its sdpa attention
    proj = torch.nn.Linear(*reversed(ref.proj.weight.shape))
    proj.load_state_dict({k[len("net."):]: v for k, v in enc.pretrained_projector().items()})
    xs = feats()
    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad():
        out, layout = enc.forward_flat(torch.cat(xs), cu_seqlens=cu)
        padded, _ = enc.forward_flat(torch.nn.utils.rnn.pad_sequence(xs, batch_first=True), lengths=torch.tensor(LENS))
        alone = [ref(x.t(), feature_lens=torch.tensor([len(x)])).last_hidden_state for x in xs]
        out = proj(out)
    assert layout.lengths == [a.shape[0] for a in alone] == [slots(n) for n in LENS]
    assert torch.allclose(out, torch.cat(alone), atol=1e-5)
    assert torch.allclose(proj(padded), out, atol=1e-6)


def test_a_full_release_loads_its_thinker_alone(omni_full, monkeypatch):
    """Only thinker.audio_tower.* and the thinker's language model are read: the vision tower, the
    talker and token2wav stay on disk."""
    import transformers.modeling_utils as modeling
    from safetensors.torch import load_file

    opened, read = modeling.safe_open, []

    class Recorded:   # a safetensors slice whose reads are recorded
        def __init__(self, part, key):
            self.part, self.key = part, key

        def __getitem__(self, i):
            read.append(self.key)
            return self.part[i]

        def __getattr__(self, name):
            return getattr(self.part, name)

    class Open:
        def __init__(self, *a, **kw):
            self.f = opened(*a, **kw)

        def get_slice(self, key):
            return Recorded(self.f.get_slice(key), key)

        def __getattr__(self, name):
            return getattr(self.f, name)

    monkeypatch.setattr(modeling, "safe_open", Open)
    model = SpeechLLM(config(omni_full)).eval()
    monkeypatch.undo()
    assert read and all(k.startswith(("thinker.audio_tower.", "thinker.model.", "thinker.lm_head.")) for k in read)
    stored = load_file(f"{omni_full}/model.safetensors")
    assert torch.equal(model.projector.net.weight, stored["thinker.audio_tower.proj.weight"])
    assert torch.equal(model.encoder.hf.layers[1].fc1.weight, stored["thinker.audio_tower.layers.1.fc1.weight"])
    assert torch.equal(model.llm.get_input_embeddings().weight, stored["thinker.model.embed_tokens.weight"])
    assert torch.equal(model.llm.lm_head.weight, stored["thinker.lm_head.weight"])


def test_positions_are_the_thinker_s_per_sample_and_restart_in_a_packed_row(omni, thinker):
    samples = conversations(thinker.config)
    batch = packed_batch(samples, sum(len(s.ids) for s in samples) + 3)
    pos = mrope_position_ids(batch.position_ids)
    assert pos.shape == (4, 1, batch.input_ids.shape[1])
    start = 0
    for s in samples:
        ids = torch.tensor([s.ids])
        audio = torch.tensor([len(x) for _, _, x in s.speech], dtype=torch.long)
        mine = pos[:, 0, start: start + len(s.ids)]
        assert int(mine[:, 0].max()) == 0   # restarts
        for grid in (None, torch.zeros(0, 3, dtype=torch.long)):   # the text path, and the audio-counting path
            ref, _ = hf_part(thinker, "get_rope_index")(ids, image_grid_thw=grid, attention_mask=torch.ones_like(ids),
                                                  audio_seqlens=audio)
            assert torch.equal(mine[1:], ref[:, 0]) and torch.equal(mine[0], ref[0, 0])
        start += len(s.ids)


def test_loss_and_gradients_equal_transformers_per_conversation_in_every_mode(omni, thinker):
    samples = conversations(thinker.config)
    torch.manual_seed(0)
    model = SpeechLLM(config(omni)).eval()
    row = sum(len(s.ids) for s in samples) + 3
    single = run(model, [padded_batch([s]) for s in samples])
    total, n_tok, ref = hf_step(thinker, samples)
    assert single[1] == n_tok and abs(single[0] - total) <= 1e-5 * abs(total)
    grads = single[3]   # every trainable tensor of west's model, each compared with transformers' own
    assert len(grads) == sum(p.grad is not None for p in ref.values())
    floor = 1e-3 * max(g.abs().max().item() for g in grads.values())
    for name, g in grads.items():
        want = ref[hf_name(name, thinker)].grad
        assert (g - want).abs().max().item() <= 1e-5 * max(want.abs().max().item(), floor), name
    assert_same(run(model, [packed_batch(samples, row)]), single, "pack: a text-only and two audio samples in one row")
    assert_same(run(model, [padded_batch(samples, extra_len=2)]), single, "static")
    assert_same(run(model, [padded_batch(samples[:1]), padded_batch(samples[1:], extra_len=5)]), single, "dynamic")
    assert_same(run(model, [packed_batch(samples[:2], row), packed_batch(samples[2:], row)]), single, "accumulation")


def test_stock_attention_finds_the_samples_of_a_packed_row_in_the_positions(omni, thinker):
    """With transformers' sdpa (no cu_seqlens), the packed row's samples are told apart by the 1-D
    position row put before the three multimodal ones."""
    samples = conversations(thinker.config)
    torch.manual_seed(0)
    model = SpeechLLM(config(omni, llm={"attn_implementation": "sdpa"})).eval()
    single = run(model, [padded_batch([s]) for s in samples])
    assert_same(run(model, [packed_batch(samples, sum(len(s.ids) for s in samples) + 3)]), single, "sdpa pack")


def test_freezing_and_lora_apply_to_it(omni):
    model = SpeechLLM(config(omni, freeze_encoder_blocks=1, freeze_llm=True, lora={"r": 4, "alpha": 8, "dropout": 0.0}))
    tower = model.encoder.hf
    assert not any(p.requires_grad for m in (tower.conv1, tower.conv2, tower.layers[0]) for p in m.parameters())
    assert all(p.requires_grad for p in tower.layers[1].parameters())
    assert all(p.requires_grad for p in model.projector.parameters())
    trainable = [n for n, p in model.llm.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    with pytest.raises(ValueError, match="freeze_encoder_blocks 3 > .* 2 layers"):
        SpeechLLM(config(omni, freeze_encoder_blocks=3))


def test_the_data_side_writes_the_processor_s_prompt(omni, thinker):
    """The prompt west builds is what the directory's chat template renders and its processor expands:
    <|audio_bos|>, one <|AUDIO|> per tower frame, <|audio_eos|>; labels on the answer only."""
    import numpy as np

    from west.data.config import DataConfig
    from west.data.records import AudioSpec, Record
    from west.data.tokenize import IGNORE_INDEX, PromptEncoder
    from west.data.whisper_features import whisper_frames, whisper_log_mel
    from west.models.llm import load_tokenizer

    tok = load_tokenizer(omni)
    pe = PromptEncoder(tok, DataConfig(prompt="<|speech|>Transcribe the speech."), config(omni).speech_shape())
    wave = (0.1 * np.random.default_rng(0).standard_normal(14407)).astype(np.float32)
    expanded, _ = processor_audio(omni, wave)
    rendered = tok.apply_chat_template([{"role": "user", "content": [{"type": "audio", "audio": "x"},
                                                                       {"type": "text", "text": "Transcribe the speech."}]}],
                                       tokenize=False, add_generation_prompt=True)
    want = tok(rendered.replace("<|AUDIO|>", expanded), add_special_tokens=False)["input_ids"]
    ids, spans = pe.encode_prompt(Record("a", "x:1", [AudioSpec()], txt="hello world"), [whisper_frames(len(wave))])
    assert ids == want and spans[0][1] == expanded.count("<|AUDIO|>")
    enc = Qwen2_5OmniPackedEncoder(load_hf_omni_tower(omni), omni).eval()
    mel = torch.from_numpy(whisper_log_mel(wave, N_MELS, 30000))
    with torch.no_grad():
        assert enc.forward_flat(mel, cu_seqlens=torch.tensor([0, len(mel)], dtype=torch.int32))[0].shape[0] == spans[0][1]
    full = pe.encode(Record("a", "x:1", [AudioSpec()], txt="hello world"), [whisper_frames(len(wave))])
    assert tok.decode([t for t in full.labels if t != IGNORE_INDEX]) == "hello world<|im_end|>"
    assert full.ids[:len(ids)] == ids


def processor_audio(path: str, wave):
    """What Qwen2_5OmniProcessor does with one waveform (its own _process_audio, run on the directory's
    feature extractor; the processor object itself needs torchvision for its video part): the text
    its <|AUDIO|> becomes, and the features with their attention mask."""
    import types

    from transformers import AutoFeatureExtractor
    from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import Qwen2_5OmniProcessor as P

    if "_process_audio" not in P.__dict__:
        pytest.skip("this transformers' Qwen2_5OmniProcessor has no _process_audio of its own (5.17 and older)")
    proc = types.SimpleNamespace(feature_extractor=AutoFeatureExtractor.from_pretrained(path), audio_token="<|AUDIO|>")
    proc.replace_audio_token = lambda inputs, audio_idx: P.replace_audio_token(proc, inputs, audio_idx)
    inputs, text = P._process_audio(proc, [wave], sampling_rate=16000, return_attention_mask=True,
                                    return_tensors="np")
    return text[0], inputs


@pytest.mark.parametrize("n", [32370, 14407, 16000 * 2 + 37, 8000])
def test_audio_token_count_and_features_equal_the_processor_s(omni, n):
    """Raw waveforms of any length (multiples of 160 or not): as many <|AUDIO|> as the processor places,
    its features on every real frame (it pads to its 300 s window first)."""
    import numpy as np

    from west.data.whisper_features import whisper_frames, whisper_log_mel

    wave = (0.1 * np.random.default_rng(n).standard_normal(n)).astype(np.float32)
    text, inputs = processor_audio(omni, wave)
    assert config(omni).speech_shape().slots(whisper_frames(n)) == text.count("<|AUDIO|>")
    real = int(inputs["feature_attention_mask"][0].sum())
    mel = whisper_log_mel(wave, N_MELS, 30000)
    assert mel.shape[0] == real == whisper_frames(n)
    np.testing.assert_allclose(mel, inputs["input_features"][0].T[:real], rtol=0, atol=1e-5)


def test_clear_errors(omni, tmp_path):
    from helpers.speech import tiny_qwen2_audio_dir, write_base

    with pytest.raises(ConfigError, match="model_type='qwen2'.*qwen2_5_omni"):
        config(str(write_base(tmp_path / "qwen2"))).speech_shape()
    with pytest.raises(ConfigError, match="model_type='qwen2_audio'"):
        config(tiny_qwen2_audio_dir(tmp_path / "q2a")).speech_shape()
    with pytest.raises(ConfigError, match="model.path"):
        config(str(tmp_path / "missing")).speech_shape()

    def variant(name, edit):
        d = tmp_path / name
        shutil.copytree(omni, d)
        edit(d)
        return str(d)

    no_processor = variant("no_processor", lambda d: (d / "preprocessor_config.json").unlink())
    with pytest.raises(ConfigError, match="model.path: .* has no loadable processor"):
        config(no_processor).speech_shape()
    for key, value in (("feature_size", 128), ("sampling_rate", 8000), ("hop_length", 200)):
        def edit(d, key=key, value=value):
            pre = json.loads((d / "preprocessor_config.json").read_text())
            (d / "preprocessor_config.json").write_text(json.dumps({**pre, key: value}))
        with pytest.raises(ConfigError, match=f"model.path: .*feature extractor {key}={value}"):
            config(variant(f"bad_{key}", edit)).speech_shape()
    with pytest.raises(ConfigError, match="model.encoder.pad_to_30s"):
        SpeechLLM(config(omni, encoder={"pad_to_30s": True}))


def test_audio_over_the_processor_s_window_is_a_counted_skip(omni, tmp_path):
    assert_over_the_window_is_skipped(omni, config(omni), tmp_path, 300.5)


@pytest.mark.parametrize("source", ["omni", "omni_full"])
def test_export_loads_in_transformers_and_gives_west_s_loss(source, request, tmp_path):
    """LoRA merged, tower and projector trained, back as a thinker directory (from a full release too:
    the thinker alone), its processor files carried; transformers' loss equals west's."""
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration

    from west.checkpoint.released import export_qwen2_5_omni
    from west.checkpoint.restore import load_released, released_type
    from west.models.encoders import exporter
    from west.models.qwen2_5_omni import read_thinker_config

    path = request.getfixturevalue(source)
    assert exporter("qwen2_5_omni") is export_qwen2_5_omni
    torch.manual_seed(0)
    model = SpeechLLM(config(path, lora={"r": 4, "alpha": 8, "dropout": 0.0})).eval()
    with torch.no_grad():   # "trained": every part moved away from the released weights
        for n, p in model.named_parameters():
            p.add_(0.01 * torch.randn_like(p) if "lora_" not in n else 0.1 * torch.randn_like(p))
    samples = conversations(read_thinker_config(path))
    with torch.no_grad():
        out = model(packed_batch(samples, sum(len(s.ids) for s in samples)))
    west_loss = float(out["loss_sum"])

    out_dir = export_qwen2_5_omni(model, tmp_path / "export")
    assert released_type(out_dir) == "qwen2_5_omni"
    for name in ("preprocessor_config.json", "chat_template.json", "tokenizer_config.json", "tokenizer.json"):
        assert (out_dir / name).is_file(), name
    hf, info = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(out_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert hf_step(hf.eval(), samples)[0] == pytest.approx(west_loss, rel=1e-5)
    source_visual = load_thinker_part(path, "visual").state_dict()
    assert all(torch.equal(v, source_visual[k]) for k, v in hf_part(hf, "visual").state_dict().items())
    back, _ = load_released(out_dir, {})   # west reads the export as a release of its own
    with torch.no_grad():
        again = back.eval()(packed_batch(samples, sum(len(s.ids) for s in samples)))
    assert float(again["loss_sum"]) == pytest.approx(west_loss, rel=1e-5)
