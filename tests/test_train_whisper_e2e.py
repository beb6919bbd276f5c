"""Whisper as the product uses it: config keys, the data path, one step in every batch mode, train + decode.

A tiny random Whisper written with ``save_pretrained`` (test_models_whisper_encoder.tiny_whisper_dir)
and the tiny Qwen2 of the other end-to-end tests, loaded by path. Checked: the same 8
utterances give the same loss and gradients as one static batch, as accumulated static
micro-batches, dynamic batches, packs with a packed and a padded encoder input (in float64
to 1e-9: the modes compute the same function; in float32 to 1e-4: the tiny random Whisper,
weights N(0, 0.2), is ill-conditioned enough that summation order shows at ~4e-5);
``west-train --model.encoder.type whisper ... --batch_type pack --pack_tokens 8192`` then
``west-decode`` on its run dir; config mistakes fail before data, naming the keys; an
utterance over Whisper's 30 s window is a counted ``too_long`` skip when the epoch is planned.
"""
from __future__ import annotations

import pytest
import torch
import yaml

from helpers.corpus import make_wav, transcript, write_jsonl
from helpers.e2e import read_jsonl, tiny_cpu_model, tiny_llm, train_argv, write_lists
from helpers.speech import tiny_whisper_dir

N_UTTS = 8
RTOL = {torch.float64: 1e-9, torch.float32: 1e-4}
WHISPER = ("--model.encoder.type", "whisper", "--data.features", "whisper")
CASES = {  # name -> data config
    "static_1x8": dict(batch_type="static", batch_size=8),
    "static_4x2": dict(batch_type="static", batch_size=2),          # 4 accumulated micro-batches
    "dynamic": dict(batch_type="dynamic", max_tokens_in_batch=200),
    "pack": dict(batch_type="pack", pack_tokens=200),
    "pack_encoder_padded": dict(batch_type="pack", pack_tokens=200, encoder_layout="padded"),
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def env(tmp_path_factory, corpus):
    d = tmp_path_factory.mktemp("whisper_e2e")
    return {"llm": str(tiny_llm(tmp_path_factory)), "whisper": tiny_whisper_dir(d / "whisper"),
            "list": str(write_lists(corpus["rows"], d / "lists", N_UTTS).jsonl), "dir": d}


def model_config(env: dict, **encoder):
    """tiny_cpu.yaml's model (ctc_compact projector, CTC head) with the tiny Whisper as encoder."""
    return tiny_cpu_model(env["llm"], type="whisper", path=env["whisper"], **encoder)


def one_step(env: dict, data_kw: dict, dtype: torch.dtype = torch.float32, **encoder) -> dict:
    """All batches of epoch 0 as the micro-batches of one SGD step (as test_train_real_model)."""
    from transformers import AutoTokenizer

    from west.data.config import DataConfig
    from west.data.dataset import build_dataloader
    from west.models.speech_llm import SpeechLLM
    from west.train.step import plan_step, train_step

    tok = AutoTokenizer.from_pretrained(env["llm"])
    cfg = model_config(env, **encoder)
    loader, _ = build_dataloader(env["list"], tok, DataConfig(features="whisper", **data_kw), cfg.speech_shape(),
                                 seed=3, epoch=0, training=True)
    batches = list(loader)
    for b in batches:
        b.feats = b.feats.to(dtype)
    torch.manual_seed(0)
    model = SpeechLLM(cfg).to(dtype).train()
    names = {id(p): n for n, p in model.named_parameters()}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    grads: dict = {}
    opt.register_step_pre_hook(lambda o, a, k: grads.update(
        {names[id(p)]: p.grad.detach().clone() for g in o.param_groups for p in g["params"]}))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    res = train_step(model, batches, plan_step(batches, len(batches)), opt, sched, device=torch.device("cpu"),
                     world_size=1)
    return {"status": res.status, "loss": res.loss, "n_tokens": res.n_tokens, "micro": len(batches),
            "keys": sorted(k for b in batches for k in b.keys), "grads": grads,
            "packed_enc": [b.encoder_packed for b in batches]}


@pytest.fixture(scope="module")
def results(env):
    return {(name, dt): one_step(env, kw, dt) for name, kw in CASES.items() for dt in RTOL}


def test_layouts_really_differ(results):
    r = {name: results[(name, torch.float32)] for name in CASES}
    assert r["static_1x8"]["micro"] == 1 and r["static_4x2"]["micro"] == 4
    assert r["dynamic"]["micro"] > 1 and r["pack"]["micro"] > 1
    assert all(r["pack"]["packed_enc"]) and not any(r["pack_encoder_padded"]["packed_enc"])


@pytest.mark.parametrize("dtype", list(RTOL), ids=str)
@pytest.mark.parametrize("name", [n for n in CASES if n != "static_1x8"])
def test_same_loss_and_gradients_in_every_mode(results, name, dtype):
    ref, got, rtol = results[("static_1x8", dtype)], results[(name, dtype)], RTOL[dtype]
    assert got["status"] == ref["status"] == "ok"
    assert got["keys"] == ref["keys"] and len(ref["keys"]) == N_UTTS
    assert got["n_tokens"] == ref["n_tokens"]
    assert got["loss"] == pytest.approx(ref["loss"], rel=max(rtol, 1e-6))   # CE runs on float32 logits
    assert got["grads"].keys() == ref["grads"].keys()
    assert any(k.startswith("encoder.hf.layers.") for k in ref["grads"])   # the Whisper encoder trains
    floor = 1e-3 * max(g.abs().max().item() for g in ref["grads"].values())
    for k, g in ref["grads"].items():
        scale = max(g.abs().max().item(), floor)
        assert (got["grads"][k] - g).abs().max().item() <= rtol * scale, (name, k)


def test_pad_to_30s_is_the_same_function_in_static_and_pack(env):
    """The stock padded encoder (every utterance padded to 3000 frames) also sees each utterance alone."""
    static, pack = (one_step(env, CASES[n], pad_to_30s=True) for n in ("static_1x8", "pack"))
    assert pack["micro"] > 1 and pack["keys"] == static["keys"]
    assert pack["loss"] == pytest.approx(static["loss"], rel=1e-5)


# ----------------------------------------------------------------------------- model

def test_model_uses_whisper_width_and_freezes_its_blocks(env):
    from west.models.speech_llm import SpeechLLM
    from west.models.whisper_encoder import WhisperPackedEncoder

    model = SpeechLLM(model_config(env))
    assert isinstance(model.encoder, WhisperPackedEncoder) and model.encoder.output_dim == 32
    assert model.ctc_head.in_features == 32
    assert model.shape.encoder_type == "whisper" and model.shape.max_frames == 3000
    assert model.num_speech_tokens(101) == 26   # 101 mel -> 51 encoder frames -> ceil(51 / 2)
    cfg = model_config(env)
    cfg.freeze_encoder_blocks = 1
    hf = SpeechLLM(cfg).encoder.hf
    assert not any(p.requires_grad for m in (hf.conv1, hf.conv2, hf.layers[0]) for p in m.parameters())
    assert all(p.requires_grad for p in hf.layers[1].parameters())
    cfg = model_config(env)
    cfg.freeze_encoder = True
    assert not any(p.requires_grad for p in SpeechLLM(cfg).encoder.parameters())
    assert model_config(env, gradient_checkpointing=True, pad_to_30s=True).encoder.pad_to_30s
    assert SpeechLLM(model_config(env, gradient_checkpointing=True)).encoder.gradient_checkpointing


def test_export_round_trip_by_path(env, tmp_path):
    from west.checkpoint.pretrained import load_speech_llm, save_speech_llm
    from west.models.speech_llm import SpeechLLM

    torch.manual_seed(1)
    model = SpeechLLM(model_config(env))
    with torch.no_grad():
        model.encoder.hf.layers[0].fc1.weight.add_(1.0)   # trained weights, not the Whisper dir's
    back = load_speech_llm(save_speech_llm(model, tmp_path / "export"))
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


# ----------------------------------------------------------------------------- data

def test_over_30s_is_a_counted_skip_at_plan_time(env, tmp_path):
    from transformers import AutoTokenizer

    from west.data.config import DataConfig
    from west.data.dataset import SpeechDataset

    rows = [{"key": f"u{i}", "wav": str(make_wav(tmp_path / f"u{i}.wav", s, seed=i)), "txt": transcript(i),
             "duration": s} for i, s in enumerate([1.0, 30.5, 0.7])]
    data = write_jsonl(tmp_path / "long.list", rows)
    shape = model_config(env).speech_shape()
    ds = SpeechDataset(str(data), AutoTokenizer.from_pretrained(env["llm"]), DataConfig(features="whisper",
                       batch_type="static", batch_size=4), shape, training=False)
    assert ds.list_skips[0][1].as_dict() == {"too_long": 1}
    batches = list(iter(ds))
    assert sorted(k for b, _ in batches if b is not None for k in b.keys) == ["u0", "u2"]
    assert batches[0][0].feats.shape[-1] == 80 and batches[0][0].feat_lens.tolist() == [100, 70]
    from west.models.speech_llm import SpeechLLM

    out = SpeechLLM(model_config(env))(ds.dummy_batch())   # what an idle rank trains on: 1 frame
    assert out["n_tokens"] == 0 and torch.isfinite(out["loss_sum"])


def test_kaldi_features_are_refused_with_whisper(env, list_kinds):
    from transformers import AutoTokenizer

    from west.data.config import DataConfig
    from west.data.dataset import SpeechDataset

    with pytest.raises(ValueError, match="has precomputed features; data.features whisper"):
        SpeechDataset(str(list_kinds["kaldi"]), AutoTokenizer.from_pretrained(env["llm"]),
                      DataConfig(features="whisper"), model_config(env).speech_shape())


def test_a_list_that_understates_the_length_is_skipped_when_decoded(env, tmp_path):
    from west.data.processors import DecodeContext, whisper_features
    from west.data.stats import DataStats

    class _Enc:
        shape = model_config(env).speech_shape()

    from west.data.config import DataConfig
    from west.data.records import AudioSpec, Record, Sample

    stats = DataStats()
    samples = [Sample(Record("a", "x.list:1", [AudioSpec()]), waves=[torch.zeros(16000 * 31).numpy()]),
               Sample(Record("b", "x.list:2", [AudioSpec()]), waves=[torch.zeros(1600).numpy()])]
    out = list(whisper_features(samples, DecodeContext(DataConfig(features="whisper"), _Enc(), stats)))
    assert [s.key for s in out] == ["b"] and out[0].feats[0].shape == (10, 80)
    assert stats.as_dict() == {"too_long": 1}


def test_features_must_match_the_encoder(env):
    from west.data.config import DataConfig, for_shape
    from west.shapes import SpeechShape

    shape = model_config(env).speech_shape()
    with pytest.raises(ValueError, match="^data.features: fbank .*model.encoder.type whisper"):
        for_shape(DataConfig(), shape)
    with pytest.raises(ValueError, match="^data.features: whisper .*model.encoder.type conformer"):
        for_shape(DataConfig(features="whisper"), SpeechShape())
    assert for_shape(DataConfig(features="whisper"), SpeechShape(encoder_type="whisper", num_mel_bins=128,
                                                                 features="whisper")).num_mel_bins == 128


# ----------------------------------------------------------------------------- CLI

def test_train_then_decode_by_path(env, tmp_path, corpus):
    """What a new user runs: west-train with a Whisper dir, packs of 8192 tokens, then west-decode."""
    from west.bin.decode import main as decode
    from west.bin.train import main as train

    out = tmp_path / "run"
    argv = train_argv(env["llm"], env["list"], out, *WHISPER, "--model.encoder.path", env["whisper"],
                      "--batch_type", "pack", "--pack_tokens", "8192", "--max_steps", "2")
    assert train(argv) == 0
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["model"]["encoder"]["type"] == "whisper" and saved["data"]["features"] == "whisper"
    assert saved["data"]["num_mel_bins"] == 80
    log = read_jsonl(out / "train_log.jsonl")
    steps = [r for r in log if "loss" in r and r.get("status") == "ok"]
    assert len(steps) == 2 and all(r["utterances"] == N_UTTS for r in steps)
    result = tmp_path / "dec" / "result.jsonl"
    assert decode(["--checkpoint", str(out), "--data", env["list"], "--result", str(result), "--batch_size", "3",
                   "--max_new_tokens", "3", "--device", "cpu", "--quiet"]) == 0
    rows = read_jsonl(result)
    assert [r["key"] for r in rows] == [r["key"] for r in corpus["rows"][:N_UTTS]]
    assert all(isinstance(r["hyp"], str) for r in rows)


def _train_error(argv, capsys) -> str:
    from west.bin.train import main

    assert main(argv) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("extra, keys", [
    (("--model.encoder.type", "whisper", "--data.features", "whisper"), ["model.encoder.type", "model.encoder.path"]),
    (("--model.encoder.type", "whisper", "--model.encoder.path", "{whisper}"), ["data.features", "model.encoder.type"]),
    (("--data.features", "whisper"), ["data.features", "model.encoder.type"]),
    ((*WHISPER, "--model.encoder.path", "{llm}"), ["model.encoder.path", "model_type='qwen2'"]),
    ((*WHISPER, "--model.encoder.path", "{missing}"), ["model.encoder.path", "not a directory"]),
    ((*WHISPER, "--model.encoder.path", "{whisper}", "--data.cmvn", "x.json"), ["data.cmvn", "whisper"]),
    ((*WHISPER, "--model.encoder.path", "{whisper}", "--data.sample_rate", "8000"), ["data.sample_rate"]),
    ((*WHISPER, "--model.encoder.path", "{whisper}", "--data.num_mel_bins", "128"), ["data.num_mel_bins", "80"]),
    ((*WHISPER, "--model.encoder.path", "{whisper}", "--model.freeze_encoder_blocks", "3"),
     ["model.freeze_encoder_blocks", "2 layers"]),
])
def test_config_mistakes_fail_before_data_naming_the_keys(env, tmp_path, capsys, extra, keys):
    paths = {"whisper": env["whisper"], "llm": env["llm"], "missing": str(tmp_path / "nope")}
    out = tmp_path / "out"
    err = _train_error(train_argv(env["llm"], env["list"], out, *(x.format(**paths) for x in extra)), capsys)
    for key in keys:
        assert key in err, err
    assert not out.exists()


def test_flops_of_packed_whisper_attention_are_counted_as_segment_sdpa(env):
    """The benchmark's FLOP count runs packed attention as segment SDPA (the flop counter cannot see
    into cu_seqlens kernels): Whisper's packed encoder too, whatever route it was built with (on a
    GPU ``auto`` is torch's varlen kernel; here ``flash`` runs its reference), and keeps that route."""
    from transformers import AutoTokenizer

    from west.bench.costs import count_flops
    from west.data.config import DataConfig
    from west.data.dataset import build_dataloader
    from west.models.speech_llm import SpeechLLM

    tok = AutoTokenizer.from_pretrained(env["llm"])
    cfg = model_config(env)
    loader, _ = build_dataloader(env["list"], tok, DataConfig(features="whisper", **CASES["pack"]),
                                 cfg.speech_shape(), seed=3, epoch=0, training=True)
    batches = list(loader)
    assert all(b.encoder_packed for b in batches)
    counts = {}
    for route in ("flash", "sdpa_segments"):
        torch.manual_seed(0)
        model = SpeechLLM(cfg)
        model.encoder.backend = route
        counts[route] = count_flops(model, batches, torch.device("cpu"))
        assert model.encoder.backend == route
    assert counts["flash"] == counts["sdpa_segments"]
