"""Whole model: packing changes the layout and nothing else.

Batches are built by hand here (the data pipeline lives in west.data and is
tested on its own): every mode of west/batch.py is produced from the same
samples, and loss sum, label-token count and every parameter gradient must agree.
"""

import pytest
import torch

from west.batch import IGNORE_INDEX
from west.checkpoint.pretrained import load_speech_llm, save_speech_llm
from west.models.config import ConformerConfig, LLMConfig, ProjectorConfig, SpeechLLMConfig
from west.models.speech_llm import SpeechLLM
from west.shapes import min_fbank_frames, num_speech_tokens

from helpers.speech import (
    PAD,
    SPEECH,
    VOCAB,
    Sample,
    assert_same,
    make_sample,
    packed_batch,
    padded_batch,
    run,
    samples,
    tiny_config,
    tiny_model,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ----------------------------------------------------------------------------- tests
def test_static_dynamic_pack_and_single_passes_agree():
    model, ss = tiny_model(), samples()
    total_tokens = sum(len(s.ids) for s in ss)
    single = run(model, [padded_batch([s]) for s in ss])
    assert single[1] == sum(sum(s.target) for s in ss)
    assert len(single[3]) == sum(1 for p in model.parameters())  # every parameter got a gradient
    cases = {
        "static": [padded_batch(ss, extra_len=3, extra_frames=11)],
        "dynamic": [padded_batch([ss[1], ss[4]]), padded_batch([ss[0], ss[2], ss[3]], extra_len=1)],
        "pack": [packed_batch(ss, total_tokens + 6)],
        "pack_full_row": [packed_batch(ss, total_tokens)],
        "pack_encoder_padded": [packed_batch(ss, total_tokens + 6, encoder="padded")],
        "two_packs": [packed_batch(ss[:2], 64), packed_batch(ss[2:], 64, encoder="padded")],
    }
    for name, batches in cases.items():
        assert_same(run(model, batches), single, name)


def test_stock_sdpa_llm_in_pack_mode_agrees():
    """attn_implementation='sdpa' (no west kernel) relies on position-id packing detection."""
    torch.manual_seed(0)
    cfg = tiny_config()
    cfg.llm.attn_implementation = "sdpa"
    model = SpeechLLM(cfg).eval()
    ss = samples()
    single = run(model, [padded_batch([s]) for s in ss])
    assert_same(run(model, [packed_batch(ss, sum(len(s.ids) for s in ss) + 5)]), single, "sdpa pack")


def test_dummy_batch_contributes_zero_but_touches_every_parameter():
    model = tiny_model()
    dummy = make_sample([("speech", torch.zeros(min_fbank_frames(4), 80)), ("text", [5, 6, 7])])
    b = padded_batch([dummy])
    b.labels.fill_(IGNORE_INDEX)
    loss, n_tok, n_cor, grads = run(model, [b])
    assert loss == 0.0 and n_tok == 0 and n_cor == 0
    assert len(grads) == sum(1 for _ in model.parameters())
    assert all(float(g.abs().max()) == 0.0 for g in grads.values())


def test_span_mismatch_is_a_clear_error():
    model, ss = tiny_model(), samples()
    b = padded_batch(ss[:2])
    b.speech_spans[0, 2] += 1
    with pytest.raises(ValueError, match="speech_spans"):
        model(b)


def test_freeze_options():
    m = tiny_model(freeze_encoder=True)
    m2 = SpeechLLM(SpeechLLMConfig.from_dict({**tiny_config().to_dict(), "freeze_llm": True}))
    assert not any(p.requires_grad for p in m.encoder.parameters())
    assert all(p.requires_grad for p in m.llm.parameters())
    assert not any(p.requires_grad for p in m2.llm.parameters())
    assert all(p.requires_grad for p in m2.encoder.parameters()) and all(
        p.requires_grad for p in m2.projector.parameters())
    _, _, _, grads = run(m2, [padded_batch(samples()[:2])])
    assert grads and all(n.startswith(("encoder.", "projector.")) for n in grads)


def test_config_round_trip_and_shape_keys():
    cfg = SpeechLLMConfig.from_dict({"encoder": {"subsampling_rate": 6}, "projector": {"stride": 3}})
    assert (cfg.encoder.subsampling_rate, cfg.projector.stride) == (6, 3)
    assert SpeechLLMConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="model.encoder.subsampling"):
        SpeechLLMConfig.from_dict({"encoder": {"subsampling": 4}})
    assert SpeechLLMConfig(encoder={"subsampling_rate": 8}).encoder == ConformerConfig(subsampling_rate=8)
    with pytest.raises(ValueError):
        SpeechLLMConfig.from_dict({"encoder": {"subsampling_rate": 5}})
    m = tiny_model()
    assert m.num_speech_tokens(100) == num_speech_tokens(100, m.shape.subsampling_rate, m.shape.projector_stride)


def test_generate_batched_equals_one_by_one():
    model, ss = tiny_model(), samples()
    prompts = [make_sample([("text", s.ids[:3]), ("speech", torch.randn(n, 80))]) for s, n in zip(ss, [30, 90, 50])]
    batched = model.generate(padded_batch(prompts, extra_len=2), max_new_tokens=6, eos_token_id=5)
    alone = [model.generate(padded_batch([p]), max_new_tokens=6, eos_token_id=5)[0] for p in prompts]
    assert batched == alone
    assert all(len(x) <= 6 and 5 not in x for x in batched)
    beams = model.generate(padded_batch(prompts), max_new_tokens=4, num_beams=2, eos_token_id=5)
    assert len(beams) == len(prompts)
    with pytest.raises(ValueError):
        model.generate(packed_batch(prompts, 200))


def test_save_and_load_round_trip(tmp_path):
    model, ss = tiny_model(), samples()
    b = packed_batch(ss, 128)
    save_speech_llm(model, tmp_path / "m")
    loaded = load_speech_llm(tmp_path / "m").eval()
    with torch.no_grad():
        assert torch.equal(model(b)["loss_sum"], loaded(b)["loss_sum"])
    assert loaded.cfg == model.cfg


def test_real_loading_path_tiny_qwen2_from_disk(tmp_path):
    """A tiny Qwen2 + tokenizer saved with save_pretrained, loaded back by path."""
    from transformers import AutoTokenizer

    from west.models.tiny_llm import SPEECH_TOKEN, build_tiny_llm

    llm_dir = build_tiny_llm(["今天 天气 很好", "hello speech world", "语音 识别"] * 10, tmp_path / "llm",
                             vocab_size=300, hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2)
    tok = AutoTokenizer.from_pretrained(llm_dir)
    cfg = tiny_config()
    cfg.llm = LLMConfig(path=str(llm_dir))
    cfg.freeze_llm = True
    model = SpeechLLM(cfg).eval()
    assert model.llm.config._attn_implementation == "west_varlen"
    speech_id = tok.convert_tokens_to_ids(SPEECH_TOKEN)
    prompt = tok.apply_chat_template([{"role": "user", "content": "转写"}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    answer = tok("今天 天气", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    feats = torch.randn(60, 80)
    n = model.num_speech_tokens(60)
    ids = prompt + [speech_id] * n + answer
    target = [False] * (len(prompt) + n) + [True] * len(answer)
    s = Sample(ids, target, [(len(prompt), n, feats)])
    out = model(packed_batch([s], len(ids) + 3))
    assert out["n_tokens"] == len(answer) and torch.isfinite(out["loss_sum"])
    # save with the frozen LLM left out: loading takes it from model.llm.path again
    save_speech_llm(model, tmp_path / "ckpt", tokenizer=tok, include_frozen_llm=False)
    from safetensors.torch import load_file

    assert not any(k.startswith("llm.") for k in load_file(tmp_path / "ckpt" / "model.safetensors"))
    loaded = load_speech_llm(tmp_path / "ckpt").eval()
    with torch.no_grad():
        assert torch.equal(model(packed_batch([s], len(ids)))["loss_sum"], loaded(packed_batch([s], len(ids)))["loss_sum"])
    assert AutoTokenizer.from_pretrained(tmp_path / "ckpt" / "llm").convert_tokens_to_ids(SPEECH_TOKEN) == speech_id


def test_lora_optional(tmp_path):
    from west.models.config import LoraSettings

    model = tiny_model(lora=LoraSettings(r=2, alpha=4, dropout=0.0))
    trainable = [n for n, p in model.llm.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    b = packed_batch(samples()[:2], 64)
    model(b)["loss_sum"].backward()
    assert all(p.grad is not None for n, p in model.llm.named_parameters() if "lora_" in n)
    save_speech_llm(model, tmp_path / "m")
    loaded = load_speech_llm(tmp_path / "m").eval()
    with torch.no_grad():
        assert torch.equal(model(b)["loss_sum"], loaded(b)["loss_sum"])


@pytest.mark.parametrize("pack_tokens", [None, 48])
def test_data_side_dummy_batch_runs(pack_tokens):
    """The data side's dummy batch (each batching policy's) flows through forward/backward contributing 0."""
    from west.data.config import DataConfig
    from west.data.policies import make_policy
    from west.shapes import SpeechShape

    model = tiny_model()
    conf = DataConfig(batch_type="static") if pack_tokens is None else DataConfig(batch_type="pack",
                                                                                  pack_tokens=pack_tokens)
    b = make_policy(conf, PAD, SPEECH, SpeechShape()).dummy_batch()
    loss, n_tok, _, grads = run(model, [b])
    assert loss == 0.0 and n_tok == 0 and len(grads) == sum(1 for _ in model.parameters())


@pytest.mark.parametrize("projector,blank", [("mlp", None), ("ctc_posterior", None), ("ctc_posterior", PAD),
                                             ("ctc_compact", None), ("ctc_compact", PAD)])
def test_ctc_hybrid_loss_is_ce_plus_weighted_ctc_and_agrees_across_modes(projector, blank):
    import torch.nn.functional as F

    torch.manual_seed(0)
    cfg = tiny_config(ctc_weight=0.5, ctc_blank=blank)
    cfg.projector.type = projector
    model, ss = SpeechLLM(cfg).eval(), samples()
    blank_id = VOCAB if blank is None else blank
    out = model(padded_batch(ss))
    # reference CTC: each utterance alone through the encoder and the head
    ref, n = 0.0, 0
    for s in ss:
        for (_, _, f), t in zip(s.speech, s.transcripts):
            if not t:
                continue
            x, lens = model.encoder(f[None], lengths=torch.tensor([len(f)]))
            logp = F.log_softmax(model.ctc_head(x[0]), -1)[:, None]
            ref += F.ctc_loss(logp, torch.tensor(t), torch.tensor([x.shape[1]]), torch.tensor([len(t)]),
                              blank=blank_id, reduction="sum").item()
            n += 1
    assert model.ctc_head.out_features == VOCAB + (blank is None) and model.ctc_blank_id == blank_id
    assert out["ctc_utts"] == n == 3 and out["ctc_infeasible"] == 0
    assert abs(out["ctc_sum"].item() - ref) <= 1e-4 * ref
    assert abs(out["loss_sum"].item() - (out["ce_sum"].item() + 0.5 * ref)) <= 1e-4 * ref
    total_tokens = sum(len(s.ids) for s in ss)
    single = run(model, [padded_batch([s]) for s in ss])
    assert "ctc_head.weight" in single[3]
    for name, batches in {"static": [padded_batch(ss, extra_len=2, extra_frames=7)],
                          "pack": [packed_batch(ss, total_tokens + 6)],
                          "pack_encoder_padded": [packed_batch(ss, total_tokens, encoder="padded")]}.items():
        assert_same(run(model, batches), single, name)


def test_ctc_counts_unalignable_transcripts_and_stays_finite():
    model = tiny_model(ctc_weight=1.0)
    g = torch.Generator().manual_seed(3)
    short = make_sample([("speech", torch.randn(15, 80, generator=g)), ("answer", [5, 6, 6, 7])])  # 3 frames < 4 + 1
    fine = make_sample([("speech", torch.randn(60, 80, generator=g)), ("answer", [8, 9])])
    out = model(packed_batch([short, fine], 64))
    assert out["ctc_utts"] == 2 and out["ctc_infeasible"] == 1
    assert torch.isfinite(out["loss_sum"])
    out["loss_sum"].backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_posterior_projector_gives_averaged_soft_token_embeddings():
    """ctc_posterior: each slot is the mean over its (<= stride) frames of softmax(head) @ E."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    cfg = tiny_config(ctc_weight=1.0, ctc_blank=PAD)
    cfg.projector.type = "ctc_posterior"
    model = SpeechLLM(cfg).eval()
    f = torch.randn(41, 80)
    x, _ = model.encoder(f[None], lengths=torch.tensor([41]))
    soft = F.softmax(model.ctc_head(x[0]), -1) @ model.llm.get_input_embeddings().weight
    want = torch.stack([soft[i:i + 2].mean(0) for i in range(0, soft.shape[0], 2)])   # odd count: last alone
    got = model.encode_speech(padded_batch([make_sample([("speech", f), ("answer", [5])])]))
    assert soft.shape[0] % 2 == 1 and got.shape == want.shape
    assert (got - want).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="ctc_weight"):
        SpeechLLMConfig.from_dict({"projector": {"type": "ctc_posterior"}})


def test_compact_projector_sends_one_soft_token_per_ctc_segment_then_blanks():
    """ctc_compact: blank frames dropped, repeats merged, segments first, blank rows after;
    segments never run across utterances; surplus segments share the last slot."""
    from west.models.projector import CompactPosteriorProjector

    proj, table = CompactPosteriorProjector(ProjectorConfig(stride=2)), torch.randn(5, 3)

    def sharp(labels):  # logits whose softmax is one-hot to float precision
        x = torch.full((len(labels), 5), -50.0)
        x[torch.arange(len(labels)), torch.tensor(labels)] = 50.0
        return x

    got = proj(torch.cat([sharp([0, 1, 1, 0, 2, 0]), sharp([3, 3, 4, 4, 1])]), [6, 5], table, 0)
    want = table[[1, 2, 0, 3, 4, 1]]
    assert torch.allclose(got, want, atol=1e-6)
    got = proj(torch.cat([sharp([1, 1]), sharp([1, 0])]), [2, 2], table, 0)   # 1 | 1: two segments
    assert torch.allclose(got, table[[1, 1]], atol=1e-6)
    got = proj(sharp([1, 2, 3, 4]), [4], table, 0)                             # 4 segments, 2 slots
    assert torch.allclose(got, torch.stack([table[1], table[2:5].mean(0)]), atol=1e-6)
    soft = torch.randn(7, 5, requires_grad=True)                               # a segment is a mean
    logits = soft + sharp([0, 2, 2, 2, 0, 0, 0]) * 0.1
    got = proj(logits, [7], table, 0)
    want = (torch.softmax(logits, -1) @ table)[1:4].mean(0)
    assert torch.allclose(got[0], want, atol=1e-6) and torch.allclose(got[1:], table[[0, 0, 0]], atol=1e-6)
    got.sum().backward()
    assert soft.grad[1:4].abs().sum() > 0
