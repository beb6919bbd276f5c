"""Packed Whisper (transformers' own encoder, west's layout) equals each utterance run alone."""
import copy

import pytest
import torch
from transformers.models.whisper.modeling_whisper import WhisperEncoder

from west.models.whisper_encoder import WhisperPackedEncoder, load_hf_whisper_encoder, whisper_encoder_frames
from west.schema import ConfigError

from helpers.speech import N_MELS, tiny_whisper_dir

LENS = [37, 50, 81]   # odd and even, all different


@pytest.fixture(scope="module")
def wdir(tmp_path_factory):
    return tiny_whisper_dir(tmp_path_factory.mktemp("whisper"))


def eager_encoder(path: str) -> WhisperEncoder:
    enc = WhisperEncoder.from_pretrained(path, key_mapping={r"^model\.encoder\.": ""}, attn_implementation="eager")
    return enc.eval()


def alone(hf: WhisperEncoder, mel: torch.Tensor) -> torch.Tensor:
    """One utterance (T, n_mels) through HF's submodules in WhisperEncoder.forward's order, unpadded."""
    h = torch.nn.functional.gelu(hf.conv1(mel.t()[None]))
    h = torch.nn.functional.gelu(hf.conv2(h)).permute(0, 2, 1)
    h = h + hf.embed_positions.weight[: h.shape[1]]
    for layer in hf.layers:
        h = layer(h, None)
    return hf.layer_norm(h)[0]


def feats(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, N_MELS, generator=g) for n in LENS]


def test_frames_formula():
    assert [whisper_encoder_frames(n) for n in (0, 1, 2, 3, 4, 3000)] == [0, 1, 1, 2, 2, 1500]


def test_reference_is_hf_forward_for_even_lengths(wdir):
    """``alone`` follows HF's own forward: for even T, an HF encoder whose window is exactly T."""
    hf = eager_encoder(wdir)
    mel = feats()[1]                       # T = 50
    conf = copy.deepcopy(hf.config)
    conf.max_source_positions = mel.shape[0] // 2
    small = WhisperEncoder(conf).eval()
    sd = {k: (v[: conf.max_source_positions] if k == "embed_positions.weight" else v)
          for k, v in hf.state_dict().items()}
    small.load_state_dict(sd)
    with torch.no_grad():
        want = small(input_features=mel.t()[None]).last_hidden_state[0]
        torch.testing.assert_close(alone(hf, mel), want, atol=1e-6, rtol=1e-6)


def _packed(enc, mels):
    """(rows, per-utterance output lengths): packed input gives output cu_seqlens (int32), as the Conformer's."""
    cu = torch.tensor([0] + LENS).cumsum(0).to(torch.int32)
    out, out_cu = enc(torch.cat(mels), cu_seqlens=cu)
    assert out_cu.dtype == torch.int32 and out_cu[0] == 0 and out_cu[-1] == out.shape[0]
    return out, torch.diff(out_cu)


@pytest.mark.parametrize("backend", ["sdpa_segments", "flash", "auto"])
def test_packed_equals_each_alone_outputs_and_grads(wdir, backend):
    enc = WhisperPackedEncoder.from_pretrained(wdir, backend=backend).eval()
    ref = eager_encoder(wdir)
    mels = [m.requires_grad_() for m in feats()]
    out, out_lens = _packed(enc, mels)
    assert out_lens.tolist() == [whisper_encoder_frames(n) for n in LENS]
    assert out.shape == (sum(out_lens.tolist()), 32)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    (out * w).sum().backward()

    rmels = [m.detach().clone().requires_grad_() for m in mels]
    want = torch.cat([alone(ref, m) for m in rmels])
    (want * w).sum().backward()
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    for m, r in zip(mels, rmels):
        torch.testing.assert_close(m.grad, r.grad, atol=1e-5, rtol=1e-5)
    got = dict(enc.hf.named_parameters())
    assert not got["embed_positions.weight"].requires_grad   # fixed sinusoids: west keeps them frozen
    for name, p in ref.named_parameters():
        if p.requires_grad and name != "embed_positions.weight":
            torch.testing.assert_close(got[name].grad, p.grad, atol=1e-5, rtol=1e-5, msg=name)


def test_padded_input_equals_packed(wdir):
    enc = WhisperPackedEncoder.from_pretrained(wdir).eval()
    mels = feats()
    pad = torch.nn.utils.rnn.pad_sequence(mels, batch_first=True, padding_value=7.0)
    with torch.no_grad():
        a, la = _packed(enc, mels)
        b, lb = enc(pad, lengths=torch.tensor(LENS))
    assert la.tolist() == lb.tolist()
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_flex_backend_forward(wdir):
    enc = WhisperPackedEncoder.from_pretrained(wdir, backend="flex").eval()
    with torch.no_grad():
        out, _ = _packed(enc, feats())
        want = torch.cat([alone(eager_encoder(wdir), m) for m in feats()])
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_full_window_pad_to_30s_equals_packed(wdir):
    """A 30 s utterance needs no padding: the stock padded path and the packed path agree."""
    packed = WhisperPackedEncoder.from_pretrained(wdir).eval()
    padded = WhisperPackedEncoder.from_pretrained(wdir, pad_to_30s=True).eval()
    mel = torch.randn(3000, N_MELS, generator=torch.Generator().manual_seed(3))
    short = torch.randn(40, N_MELS, generator=torch.Generator().manual_seed(4))
    cu = torch.tensor([0, 3000, 3040], dtype=torch.int32)
    with torch.no_grad():
        a, la = packed(torch.cat([mel, short]), cu_seqlens=cu)
        b, lb = padded(torch.cat([mel, short]), cu_seqlens=cu)
    assert la.tolist() == lb.tolist() == [0, 1500, 1520]   # output cu_seqlens
    torch.testing.assert_close(a[:1500], b[:1500], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(a[1500:], b[1500:], atol=1e-3)   # padding changes a short one's output


def test_longer_than_30s_is_refused(wdir):
    enc = WhisperPackedEncoder.from_pretrained(wdir)
    with pytest.raises(ValueError, match=r"\[3001\] mel frames.*30 s.*skip"):
        enc(torch.zeros(3041, N_MELS), cu_seqlens=torch.tensor([0, 40, 3041], dtype=torch.int32))


def test_wrong_mel_bins_refused(wdir):
    enc = WhisperPackedEncoder.from_pretrained(wdir)
    with pytest.raises(ValueError, match="80 mel bins"):
        enc(torch.zeros(10, 128), cu_seqlens=torch.tensor([0, 10], dtype=torch.int32))


def test_gradient_checkpointing_same_grads(wdir):
    enc = WhisperPackedEncoder.from_pretrained(wdir).train()
    mels = feats()
    out, _ = _packed(enc, mels)
    out.square().sum().backward()
    want = {n: p.grad.clone() for n, p in enc.named_parameters() if p.grad is not None}
    enc.zero_grad()
    enc.gradient_checkpointing = True
    assert enc.gradient_checkpointing
    out2, _ = _packed(enc, mels)
    out2.square().sum().backward()
    torch.testing.assert_close(out2, out)
    for n, p in enc.named_parameters():
        if n in want:
            torch.testing.assert_close(p.grad, want[n], msg=n)


def test_not_a_whisper_dir_is_a_clear_error(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        load_hf_whisper_encoder(str(tmp_path))
    with pytest.raises(ConfigError, match="^model.encoder.path: .* is not a directory"):
        load_hf_whisper_encoder(str(tmp_path / "nope"))
