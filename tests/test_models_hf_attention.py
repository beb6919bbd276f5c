"""A stock HF Qwen2 with west's registered attention is exact on packed rows."""
import warnings

import pytest
import torch

from west.models.hf_attention import ATTN_NAME, packed_kwargs, register

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LENS = [5, 9, 3, 7, 4]  # last one plays the pack's dummy tail
VOCAB = 97


def _llm(attn=ATTN_NAME, seed=0):
    from transformers import AutoModelForCausalLM, Qwen2Config

    register()
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()


@pytest.fixture(scope="module")
def llm():
    return _llm()


def _samples(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in LENS]


def _packed(samples):
    ids = torch.cat(samples)[None]
    pos = torch.cat([torch.arange(len(s)) for s in samples])[None]
    cu = torch.tensor([0] + torch.tensor([len(s) for s in samples]).cumsum(0).tolist(), dtype=torch.int32)
    return ids, pos, cu


def _alone(model, samples):
    with torch.no_grad():
        return [model(input_ids=s[None], use_cache=False).logits[0] for s in samples]


def _packed_logits(model, samples, backend="auto", west=True):
    ids, pos, cu = _packed(samples)
    kw = packed_kwargs(cu, backend=backend, west_extras=west)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model(input_ids=ids, position_ids=pos, attention_mask=None, use_cache=False, **kw).logits[0], cu


@pytest.mark.parametrize("backend", ["auto", "sdpa_segments", "flash", "flex"])
def test_packed_logits_equal_per_sample_logits(llm, backend):
    samples = _samples()
    ref = _alone(llm, samples)
    logits, cu = _packed_logits(llm, samples, backend)
    for i, r in enumerate(ref):
        assert (logits[cu[i]: cu[i + 1]] - r).abs().max() <= 1e-5


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_stock_attention_with_packed_kwargs_is_also_exact(attn):
    """Stock eager/sdpa ignore cu_seq_lens but detect packing from position_ids (use_cache=False)."""
    model = _llm(attn)
    samples = _samples()
    ref = _alone(model, samples)
    logits, cu = _packed_logits(model, samples, west=False)
    for i, r in enumerate(ref):
        assert (logits[cu[i]: cu[i + 1]] - r).abs().max() <= 1e-5


def test_leak_changing_one_sample_changes_no_other(llm):
    samples = _samples()
    before, cu = _packed_logits(llm, samples)
    samples[1] = (samples[1] + 1) % VOCAB
    after, _ = _packed_logits(llm, samples)
    for i in range(len(samples)):
        seg = slice(int(cu[i]), int(cu[i + 1]))
        assert torch.equal(before[seg], after[seg]) == (i != 1)


def test_packed_gradients_equal_sum_of_per_sample_gradients():
    model = _llm()
    samples = _samples()
    params = [p for p in model.parameters()]

    def loss_of(logits, ids):
        return torch.nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="sum")

    ref = torch.autograd.grad(sum(loss_of(model(input_ids=s[None], use_cache=False).logits[0], s)
                                  for s in samples), params)
    ids, pos, cu = _packed(samples)
    logits = model(input_ids=ids, position_ids=pos, use_cache=False, **packed_kwargs(cu)).logits[0]
    loss = sum(loss_of(logits[cu[i]: cu[i + 1]], s) for i, s in enumerate(samples))
    got = torch.autograd.grad(loss, params)
    for a, b in zip(got, ref):
        assert (a - b).abs().max() <= 1e-5 * max(1.0, b.abs().max().item())


def test_padded_rows_with_mask_equal_per_sample(llm):
    samples = _samples()
    L = max(LENS) + 2
    ids = torch.zeros(len(samples), L, dtype=torch.long)
    mask = torch.zeros(len(samples), L, dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
    pos = torch.arange(L).expand(len(samples), L)
    with torch.no_grad():
        logits = llm(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        no_mask = llm(input_ids=ids, position_ids=pos, use_cache=False).logits  # right pad + causal
    for i, r in enumerate(_alone(llm, samples)):
        n = len(samples[i])
        assert (logits[i, :n] - r).abs().max() <= 1e-5
        assert (no_mask[i, :n] - r).abs().max() <= 1e-5


def test_packed_call_rejects_mask_and_bad_cu(llm):
    samples = _samples()
    ids, pos, cu = _packed(samples)
    with pytest.raises(TypeError):
        packed_kwargs(cu.long())
    with pytest.raises(ValueError):
        packed_kwargs(cu, backend="nope")
