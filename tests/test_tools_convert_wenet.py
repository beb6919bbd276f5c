"""tools/convert_wenet_checkpoint.py: a WeNet-layout checkpoint becomes a west Conformer with the
same weights, or is refused naming the option west does not compute.

WeNet is not installed, so the WeNet side is (1) a state dict whose names and shapes are written
here by hand from WeNet's source (wenet/models/transformer/*.py at 0154699), independently of the
converter's table, and (2) a reference forward that follows WeNet's layer code over those names.
"""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file

from west.data.features import GlobalCMVN
from west.models.config import ConformerConfig
from west.models.conformer import ConformerEncoder
from west.shapes import SUBSAMPLING_LAYERS

from helpers.e2e import tiny_encoder

TOOLS = Path(__file__).resolve().parents[1] / "tools"
sys.path.insert(0, str(TOOLS))
import convert_wenet_checkpoint as conv  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
INPUT_LAYER = {4: "conv2d", 6: "conv2d6", 8: "conv2d8"}


def _west(rate=4, seed=0):
    torch.manual_seed(seed)
    enc = ConformerEncoder(tiny_encoder(subsampling_rate=rate, dropout=0.0,
                                                  pos_enc="wenet")).eval()
    with torch.no_grad():   # non-trivial norms, so a swapped norm would show in the outputs
        for name, p in enc.named_parameters():
            if "norm" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.2 * torch.randn_like(p))
    return enc


def _lin(sd, name, layer):
    sd[f"{name}.weight"], sd[f"{name}.bias"] = layer.weight, layer.bias


def wenet_state(enc, rate):
    """A WeNet ASR model state dict holding ``enc``'s weights under WeNet's names and shapes."""
    sd, sub = {}, enc.subsampling
    for i in range(0, len(sub.conv), 2):
        _lin(sd, f"encoder.embed.conv.{i}", sub.conv[i])
    _lin(sd, "encoder.embed.out.0" if rate == 4 else "encoder.embed.linear", sub.out)
    sd["encoder.embed.pos_enc.pe"] = torch.zeros(1, 5000, enc.cfg.d_model)
    for i, b in enumerate(enc.blocks):
        p = f"encoder.encoders.{i}."
        for n in ("linear_q", "linear_k", "linear_v", "linear_out"):
            _lin(sd, p + "self_attn." + n, getattr(b.attn, n))
        sd[p + "self_attn.linear_pos.weight"] = b.attn.linear_pos.weight
        sd[p + "self_attn.pos_bias_u"], sd[p + "self_attn.pos_bias_v"] = b.attn.pos_bias_u, b.attn.pos_bias_v
        for wenet, ff in (("feed_forward_macaron", b.ff1), ("feed_forward", b.ff2)):
            _lin(sd, p + wenet + ".w_1", ff.net[0])
            _lin(sd, p + wenet + ".w_2", ff.net[3])
        c = b.conv   # WeNet's pointwise convs are Conv1d(kernel_size=1): (out, in, 1)
        sd[p + "conv_module.pointwise_conv1.weight"] = c.pointwise1.weight[..., None]
        sd[p + "conv_module.pointwise_conv1.bias"] = c.pointwise1.bias
        _lin(sd, p + "conv_module.depthwise_conv", c.depthwise)
        _lin(sd, p + "conv_module.norm", c.norm)
        sd[p + "conv_module.pointwise_conv2.weight"] = c.pointwise2.weight[..., None]
        sd[p + "conv_module.pointwise_conv2.bias"] = c.pointwise2.bias
        for wenet, norm in (("norm_ff_macaron", b.norm_ff1), ("norm_mha", b.norm_attn),
                            ("norm_conv", b.norm_conv), ("norm_ff", b.norm_ff2), ("norm_final", b.norm_out)):
            _lin(sd, p + wenet, norm)
    _lin(sd, "encoder.after_norm", enc.after_norm)
    sd["decoder.embed.0.weight"] = torch.randn(10, enc.cfg.d_model)   # not the encoder: ignored
    sd["ctc.ctc_lo.weight"] = torch.randn(10, enc.cfg.d_model)
    return {k: v.detach().clone() for k, v in sd.items()}


def train_yaml(rate=4, **enc_overrides):
    enc = dict(output_size=64, attention_heads=4, linear_units=128, num_blocks=2, dropout_rate=0.1,
               positional_dropout_rate=0.1, attention_dropout_rate=0.0, input_layer=INPUT_LAYER[rate],
               normalize_before=True, cnn_module_kernel=7, use_cnn_module=True, activation_type="swish",
               pos_enc_layer_type="rel_pos", selfattention_layer_type="rel_selfattn",
               cnn_module_norm="layer_norm", use_dynamic_chunk=False)
    enc.update(enc_overrides)
    return {"encoder": "conformer", "encoder_conf": enc, "input_dim": 80, "cmvn": "global_cmvn",
            "cmvn_conf": {"cmvn_file": "data/train/global_cmvn", "is_json_cmvn": True}}


def write_exp(tmp_path, sd, conf):
    d = tmp_path / "exp"
    d.mkdir(exist_ok=True)
    torch.save(sd, d / "final.pt")
    (d / "train.yaml").write_text(yaml.safe_dump(conf))
    return d


# ------------------------------------------------------------------ WeNet's math, from its source
def _sinusoid(pos, d):
    div = torch.exp(torch.arange(0, d, 2, dtype=torch.float64) * -(math.log(10000.0) / d))
    pe = torch.zeros(*pos.shape, d, dtype=torch.float64)
    pe[..., 0::2], pe[..., 1::2] = torch.sin(pos[..., None] * div), torch.cos(pos[..., None] * div)
    return pe


def wenet_forward(sd, rate, h, feats, relative):
    """One utterance (T, F) through WeNet's ConformerEncoder math (eval), in float64.

    ``relative=False``: WeNet's rel_pos term (q+v)·W_pos·pe(j), pe of the key's absolute position
    (RelPositionalEncoding + RelPositionMultiHeadedAttention, no rel_shift). ``relative=True``:
    the same with pe(i−j), Transformer-XL's distance, which is what west computes."""
    W = {k[len("encoder."):]: v.double() for k, v in sd.items() if k.startswith("encoder.")}
    x = feats.double()[None, None]
    for i, (_, stride) in enumerate(SUBSAMPLING_LAYERS[rate]):
        x = F.relu(F.conv2d(x, W[f"embed.conv.{2 * i}.weight"], W[f"embed.conv.{2 * i}.bias"], stride=stride))
    _, c, t, f = x.shape
    out = "embed.out.0" if rate == 4 else "embed.linear"
    d = W[out + ".weight"].shape[0]
    x = F.linear(x.transpose(1, 2).reshape(1, t, c * f), W[out + ".weight"], W[out + ".bias"]) * math.sqrt(d)
    i_, j_ = torch.arange(t)[:, None], torch.arange(t)[None, :]
    pe = _sinusoid((i_ - j_).double(), d) if relative else _sinusoid(torch.arange(t).double(), d)[None]
    for n in range(len([k for k in W if k.endswith("norm_final.weight")])):
        layer = {k.removeprefix(f"encoders.{n}."): v for k, v in W.items() if k.startswith(f"encoders.{n}.")}
        x = _wenet_layer(x, layer, h, pe, relative)
    return F.layer_norm(x, (d,), W["after_norm.weight"], W["after_norm.bias"], 1e-5)[0]


def _wenet_layer(x, L, h, pe, relative):
    """ConformerEncoderLayer.forward (normalize_before, macaron, conv module with layer_norm)."""
    t, d = x.shape[1], x.shape[2]
    dk = d // h

    def ln(y, name):
        return F.layer_norm(y, (d,), L[name + ".weight"], L[name + ".bias"], 1e-5)

    def lin(y, name):
        return F.linear(y, L[name + ".weight"], L[name + ".bias"])

    def ff(y, name):
        return lin(F.silu(lin(y, name + ".w_1")), name + ".w_2")

    x = x + 0.5 * ff(ln(x, "norm_ff_macaron"), "feed_forward_macaron")
    y = ln(x, "norm_mha")
    q, k, v = (lin(y, f"self_attn.linear_{s}").view(1, t, h, dk) for s in "qkv")
    p = F.linear(pe, L["self_attn.linear_pos.weight"]).view(*pe.shape[:-1], h, dk)
    qu, qv = q + L["self_attn.pos_bias_u"], q + L["self_attn.pos_bias_v"]
    ac = torch.einsum("bihc,bjhc->bhij", qu, k)
    bd = torch.einsum("bihc,ijhc->bhij", qv, p) if relative else torch.einsum("bihc,bjhc->bhij", qv, p)
    att = torch.softmax((ac + bd) / math.sqrt(dk), -1)
    x = x + lin(torch.einsum("bhij,bjhc->bihc", att, v).reshape(1, t, d), "self_attn.linear_out")
    y = ln(x, "norm_conv").transpose(1, 2)                       # (1, d, t)
    y = F.glu(F.conv1d(y, L["conv_module.pointwise_conv1.weight"], L["conv_module.pointwise_conv1.bias"]), 1)
    kern = L["conv_module.depthwise_conv.weight"]
    y = F.conv1d(y, kern, L["conv_module.depthwise_conv.bias"], padding=(kern.shape[-1] - 1) // 2, groups=d)
    y = F.silu(ln(y.transpose(1, 2), "conv_module.norm")).transpose(1, 2)
    y = F.conv1d(y, L["conv_module.pointwise_conv2.weight"], L["conv_module.pointwise_conv2.bias"])
    x = x + y.transpose(1, 2)
    x = x + 0.5 * ff(ln(x, "norm_ff"), "feed_forward")
    return ln(x, "norm_final")


def _convert(tmp_path, sd, conf, *extra):
    exp = write_exp(tmp_path, sd, conf)
    out = tmp_path / "out"
    rc = conv.main(["--wenet_dir", str(exp), "--out", str(out), *extra])
    return rc, out


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("rate", [4, 6, 8])
def test_round_trip_same_weights_and_outputs(tmp_path, rate, capsys):
    enc = _west(rate)
    sd = wenet_state(enc, rate)
    sd["encoder.global_cmvn.mean"], sd["encoder.global_cmvn.istd"] = torch.randn(80), torch.rand(80) + 0.5
    rc, out = _convert(tmp_path, sd, train_yaml(rate))
    assert rc == 0
    cfg = ConformerConfig.from_dict(yaml.safe_load((out / "encoder.yaml").read_text())["model"]["encoder"])
    assert cfg.pos_enc == "wenet" and cfg.init == str((out / "encoder.safetensors").resolve())
    assert (cfg.d_model, cfg.num_blocks, cfg.subsampling_rate, cfg.conv_kernel, cfg.ffn_dim) == (64, 2, rate, 7, 128)
    back = ConformerEncoder(cfg).eval()
    back.load_state_dict(load_file(str(out / "encoder.safetensors")), strict=True)
    for (name, a), (_, b) in zip(enc.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name
    feats = torch.randn(2, 90, 80)
    lens = torch.tensor([90, 61])
    torch.testing.assert_close(back(feats, lens)[0], enc(feats, lens)[0], rtol=0, atol=0)
    cmvn = GlobalCMVN.from_json(str(out / "global_cmvn.json"))      # from the checkpoint's buffers
    torch.testing.assert_close(torch.from_numpy(cmvn.mean), sd["encoder.global_cmvn.mean"])
    torch.testing.assert_close(torch.from_numpy(cmvn.istd), sd["encoder.global_cmvn.istd"])


@pytest.mark.parametrize("rate", [4, 8])
def test_converted_encoder_computes_wenets_function(tmp_path, rate):
    """Every tensor lands where WeNet's forward uses it, and the written config (pos_enc: wenet)
    makes west compute WeNet's own positional term, pe of the key's position: WeNet's layer math
    over the WeNet names gives west's output; with the relative term pe(i−j) it would not."""
    enc = _west(rate, seed=3)
    sd = wenet_state(enc, rate)
    rc, out = _convert(tmp_path, sd, train_yaml(rate))
    assert rc == 0
    back = ConformerEncoder(ConformerConfig.from_dict(
        yaml.safe_load((out / "encoder.yaml").read_text())["model"]["encoder"])).eval()
    back.load_state_dict(load_file(str(out / "encoder.safetensors")), strict=True)
    feats = torch.randn(77, 80)
    with torch.no_grad():
        got = back(feats[None], torch.tensor([77]))[0][0].double()
    torch.testing.assert_close(got, wenet_forward(sd, rate, 4, feats, relative=False), rtol=1e-4, atol=1e-4)
    assert (got - wenet_forward(sd, rate, 4, feats, relative=True)).abs().max() > 1e-2


def test_relative_and_wenet_terms_agree_with_their_references():
    """West's default pos_enc (relative) is the Transformer-XL term of the same weights."""
    enc = _west(4, seed=5)
    rel = ConformerEncoder(tiny_encoder(dropout=0.0)).eval()
    rel.load_state_dict(enc.state_dict())
    sd = wenet_state(enc, 4)
    feats = torch.randn(53, 80)
    with torch.no_grad():
        got = rel(feats[None], torch.tensor([53]))[0][0].double()
    torch.testing.assert_close(got, wenet_forward(sd, 4, 4, feats, relative=True), rtol=1e-4, atol=1e-4)


def test_init_loads_the_converted_weights_or_names_the_key(tmp_path):
    from types import SimpleNamespace

    from west.train.build import load_encoder_init

    enc = _west(4, seed=7)
    rc, out = _convert(tmp_path, wenet_state(enc, 4), train_yaml(4))
    assert rc == 0
    cfg = ConformerConfig.from_dict(yaml.safe_load((out / "encoder.yaml").read_text())["model"]["encoder"])
    model = SimpleNamespace(encoder=ConformerEncoder(cfg))
    load_encoder_init(model, cfg.init)
    for (name, a), (_, b) in zip(enc.state_dict().items(), model.encoder.state_dict().items()):
        assert torch.equal(a, b), name
    other = SimpleNamespace(encoder=ConformerEncoder(tiny_encoder(num_blocks=3)))
    with pytest.raises(ValueError, match="model.encoder.init .*does not fit model.encoder"):
        load_encoder_init(other, cfg.init)


REFUSALS = [
    (dict(pos_enc_layer_type="abs_pos"), "encoder_conf.pos_enc_layer_type"),
    (dict(pos_enc_layer_type="rel_pos_firered"), "encoder_conf.pos_enc_layer_type"),
    (dict(causal=True), "encoder_conf.causal"),
    (dict(input_layer="conv2d2"), "encoder_conf.input_layer"),
    (dict(input_layer="linear"), "encoder_conf.input_layer"),
    (dict(macaron_style=False), "encoder_conf.macaron_style"),
    (dict(cnn_module_norm="batch_norm"), "encoder_conf.cnn_module_norm"),
    (dict(cnn_module_norm=None), "encoder_conf.cnn_module_norm"),      # unset: WeNet's batch_norm
    (dict(use_cnn_module=False), "encoder_conf.use_cnn_module"),
    (dict(activation_type="relu"), "encoder_conf.activation_type"),
    (dict(normalize_before=False), "encoder_conf.normalize_before"),
    (dict(static_chunk_size=16), "encoder_conf.static_chunk_size"),
    (dict(selfattention_layer_type="selfattn"), "encoder_conf.selfattention_layer_type"),
    (dict(key_bias=False), "encoder_conf.key_bias"),
    (dict(layer_norm_type="rms_norm"), "encoder_conf.layer_norm_type"),
    (dict(new_wenet_option=1), "encoder_conf.new_wenet_option"),
]


@pytest.mark.parametrize("overrides,option", REFUSALS)
def test_refusals_name_the_option(tmp_path, capsys, overrides, option):
    conf = train_yaml(4, **overrides)
    if overrides.get("cnn_module_norm", "") is None:
        del conf["encoder_conf"]["cnn_module_norm"]
    rc, out = _convert(tmp_path, wenet_state(_west(), 4), conf)
    err = capsys.readouterr().err
    assert rc == 2 and option in err and "refused" in err, err
    assert not out.exists()


def test_refuses_other_encoders_and_foreign_tensors(tmp_path, capsys):
    sd = wenet_state(_west(), 4)
    conf = dict(train_yaml(4), encoder="branchformer")
    assert _convert(tmp_path, sd, conf)[0] == 2
    assert "encoder: 'branchformer'" in capsys.readouterr().err
    extra = dict(sd, **{"encoder.encoders.0.self_attn.layer_norm_q.weight": torch.ones(64)})
    assert _convert(tmp_path, extra, train_yaml(4))[0] == 2
    assert "encoder.encoders.0.self_attn.layer_norm_q.weight" in capsys.readouterr().err
    # a checkpoint with more blocks than train.yaml says: named, not half-loaded
    assert _convert(tmp_path, sd, train_yaml(4, num_blocks=3))[0] == 2
    assert "blocks.2" in capsys.readouterr().err


@pytest.mark.parametrize("feats", ["mfcc", "log_mel_spectrogram"])
def test_features_other_than_fbank_are_refused(tmp_path, capsys, feats):
    conf = dict(train_yaml(4), dataset_conf={"feats_type": feats, "fbank_conf": {"num_mel_bins": 80}})
    rc, out = _convert(tmp_path, wenet_state(_west(), 4), conf)
    err = capsys.readouterr().err
    assert rc == 2 and f"dataset_conf.feats_type: {feats!r}" in err and not out.exists(), err
    fbank = dict(train_yaml(4), dataset_conf={"feats_type": "fbank"})
    assert _convert(tmp_path, wenet_state(_west(), 4), fbank)[0] == 0


def test_cmvn_from_the_files_train_yaml_names(tmp_path):
    sd = wenet_state(_west(), 4)
    stats = {"mean_stat": [2.0 * i for i in range(80)], "var_stat": [9.0 + 4.0 * i * i for i in range(80)],
             "frame_num": 2}
    exp = write_exp(tmp_path, sd, train_yaml(4))
    (exp / "global_cmvn").write_text(json.dumps(stats))       # found next to train.yaml by basename
    assert conv.main(["--wenet_dir", str(exp), "--out", str(tmp_path / "a")]) == 0
    a = GlobalCMVN.from_json(str(tmp_path / "a" / "global_cmvn.json"))
    kaldi = "[ " + " ".join(map(str, stats["mean_stat"])) + " 2 " + " ".join(map(str, stats["var_stat"])) + " 0 ]"
    (exp / "global_cmvn").write_text(kaldi)                    # WeNet's Kaldi-text form
    assert conv.main(["--checkpoint", str(exp / "final.pt"), "--config", str(exp / "train.yaml"),
                      "--out", str(tmp_path / "b")]) == 0
    b = GlobalCMVN.from_json(str(tmp_path / "b" / "global_cmvn.json"))
    for c in (a, b):
        assert c.mean.tolist() == [float(i) for i in range(80)]
        assert c.istd.tolist() == pytest.approx([1 / math.sqrt(4.5 + i * i) for i in range(80)])


def test_script_runs(tmp_path):
    exp = write_exp(tmp_path, wenet_state(_west(), 4), train_yaml(4))
    cmd = [sys.executable, str(TOOLS / "convert_wenet_checkpoint.py"), "--wenet_dir", str(exp),
           "--out", str(tmp_path / "o")]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    assert "cmvn: MISSING" in r.stdout and len(r.stdout.strip().splitlines()) == 1
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["encoder.safetensors", "encoder.yaml"]
