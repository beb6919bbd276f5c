"""linear_cross_entropy: the chunked loss equals the plain one (value, argmax count, gradients)
without ever holding more than one chunk of logits; the optional CUDA libraries are dispatched
to (checked with fake modules: the real ones are not installed here)."""
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from west.models import loss as loss_mod
from west.models.loss import LOSS_IMPLS, linear_cross_entropy

pytestmark = pytest.mark.usefixtures("one_torch_thread")

H, V = 16, 50


def make(n: int, h: int = H, v: int = V, bias: bool = True, dtype=torch.float32, seed: int = 0):
    """(hidden, weight, bias, target); every other row's target is its argmax, so n_correct
    is neither 0 nor n."""
    g = torch.Generator().manual_seed(seed)
    hid = torch.randn(n, h, generator=g, dtype=dtype)
    w = torch.randn(v, h, generator=g, dtype=dtype) * 0.5
    b = torch.randn(v, generator=g, dtype=dtype) if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    if n:
        best = F.linear(hid, w, b).argmax(-1)
        t[::2] = best[::2]
    return hid, w, b, t


def run(impl, hid, w, b, t, chunk_rows=8, train_w=True, autocast=False):
    """(loss, n_correct, grad_h, grad_w, grad_b of 0.37 * loss) for fresh leaf copies of the inputs."""
    hid = hid.clone().requires_grad_(True)
    w = w.clone().requires_grad_(train_w)
    b = None if b is None else b.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss, n_correct = linear_cross_entropy(hid, w, t, bias=b, chunk_rows=chunk_rows, impl=impl)
    (0.37 * loss).backward()   # a grad_output other than 1, as a normalised loss would give
    return loss.detach(), n_correct, hid.grad, w.grad, None if b is None else b.grad


def assert_close(a, b, rel):
    """|a - b| <= rel * max|a| (elementwise scale of the reference)."""
    assert a.shape == b.shape and a.dtype == b.dtype
    assert float((a - b).abs().max()) <= rel * float(a.abs().max())


# (rows, chunk_rows, vocab): N not a multiple of chunk_rows, a multiple, N < chunk_rows, one row;
# a larger vocabulary, and chunks of 2 rows (150 of them: W's gradient summed over many)
CASES = [(37, 8, V), (16, 8, V), (5, 8, V), (1, 1, V), (37, 8, 3000), (300, 2, 3000)]


@pytest.mark.parametrize("n, chunk_rows, v", CASES)
@pytest.mark.parametrize("bias", [True, False])
def test_chunked_equals_plain_float32(n, chunk_rows, v, bias):
    inputs = make(n, v=v, bias=bias)
    ref = run("plain", *inputs, chunk_rows=chunk_rows)
    got = run("chunked", *inputs, chunk_rows=chunk_rows)
    assert got[0].dtype == torch.float32 and got[0].dim() == 0
    assert got[1].dtype == torch.int64 and got[1].dim() == 0
    assert 0 < int(ref[1]) <= n and int(got[1]) == int(ref[1])
    assert torch.allclose(got[0], ref[0], rtol=1e-5, atol=0)
    for r, g in zip(ref[2:], got[2:]):
        if r is None:
            assert g is None
        else:
            assert_close(r, g, 1e-5)


def test_weight_gradient_summed_in_vocabulary_blocks(monkeypatch):
    """W's gradient is written block by block of the vocabulary (a (block, H) product, not (V, H)),
    the first row chunk assigning and the later ones adding: still plain's gradient."""
    monkeypatch.setattr(loss_mod, "W_GRAD_ROWS", 7)   # 50 = 7 blocks of 7 and one of 1
    inputs = make(37, v=V)
    ref = run("plain", *inputs, chunk_rows=8)
    with OpRecorder() as rec:
        got = run("chunked", *inputs, chunk_rows=8)
    for r, g in zip(ref[2:], got[2:]):
        assert_close(r, g, 1e-5)
    assert sum(rec.ops[k] for k in MATMULS) == 5 * (2 + 8)   # per row chunk: logits, grad_h, 8 blocks of W's gradient


def test_argmax_ties_count_the_first_index():
    """Two equal top logits far apart in the vocabulary: argmax (and so n_correct) takes the
    first, in the plain and the chunked path alike."""
    hid, w, _, _ = make(4, v=3000)
    w[5] = w[2500] = 10 * hid[0] / hid[0].norm()
    hid[:] = hid[0]
    t = torch.tensor([5, 5, 5, 2500])
    for impl in ("plain", "chunked"):
        _, n_correct = linear_cross_entropy(hid, w, t, chunk_rows=1, impl=impl)
        assert int(n_correct) == 3, impl


@pytest.mark.parametrize("n, chunk_rows, v", [(37, 8, 300), (5, 8, 300), (37, 8, 3000)])
def test_chunked_under_bf16_autocast(n, chunk_rows, v):
    """Logits in bf16 as F.linear under autocast, softmax in float32: the loss and grad_h
    match the plain path; grad_W / grad_b within bf16 rounding (chunks accumulate in fp32)."""
    inputs = make(n, h=32, v=v)
    ref = run("plain", *inputs, chunk_rows=chunk_rows, autocast=True)
    got = run("chunked", *inputs, chunk_rows=chunk_rows, autocast=True)
    fp32 = run("plain", *inputs, chunk_rows=chunk_rows)
    assert int(got[1]) == int(ref[1])
    assert got[0].dtype == torch.float32
    assert torch.allclose(got[0], ref[0], rtol=1e-5)
    # the bf16 matmul really happened: fp32 logits give a visibly different loss
    assert float((fp32[0] - ref[0]).abs()) > 10 * float((got[0] - ref[0]).abs())
    for r, g in zip(ref[2:], got[2:]):
        assert g.dtype == torch.float32   # gradients come back in the leaves' dtype
        assert_close(r, g, 2e-2)


@pytest.mark.parametrize("impl", ["chunked", "plain"])
def test_empty_rows_give_zero_loss_and_zero_gradients(impl):
    hid, w, b, t = make(0)
    loss, n_correct, gh, gw, gb = run(impl, hid, w, b, t)
    assert float(loss) == 0.0 and loss.dtype == torch.float32 and int(n_correct) == 0
    # the weights stay in the graph (DDP expects a gradient for every used parameter)
    assert gh.shape == (0, H) and torch.equal(gw, torch.zeros(V, H)) and torch.equal(gb, torch.zeros(V))


@pytest.mark.parametrize("autocast", [False, True])
def test_frozen_weight_gets_no_gradient(autocast):
    inputs = make(37)
    ref = run("plain", *inputs, train_w=False, autocast=autocast)
    got = run("chunked", *inputs, train_w=False, autocast=autocast)
    assert got[3] is None
    # under autocast the chunked path rounds (softmax - one_hot) to bf16 before grad_loss scales
    # it, plain after: the same bf16 rounding, applied at another scale
    assert_close(ref[2], got[2], 1e-5 if not autocast else 1e-2)
    assert_close(ref[4], got[4], 1e-5 if not autocast else 2e-2)


def test_gradcheck_float64():
    hid, w, b, t = make(7, h=3, v=5, dtype=torch.float64, seed=3)
    hid, w, b = (x.requires_grad_(True) for x in (hid, w, b))

    def fn(hid, w, b):
        return linear_cross_entropy(hid, w, t, bias=b, chunk_rows=3, impl="chunked")[0]

    assert fn(hid, w, b).dtype == torch.float64
    assert torch.autograd.gradcheck(fn, (hid, w, b))


class OpRecorder(TorchDispatchMode):
    """The largest numel among all op outputs, and how many matmuls ran."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops[func.overloadpacket.__name__] += 1
        for x in tree_flatten(out)[0]:
            if isinstance(x, torch.Tensor):
                self.max_numel = max(self.max_numel, x.numel())
        return out


@pytest.mark.parametrize("v", [V, 3000])
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("impl", ["chunked", "plain"])
def test_never_more_than_one_chunk_of_logits(impl, autocast, v):
    chunk_rows, n = 8, 40
    inputs = make(n, h=4, v=v)     # W (V x 4) and its gradient stay under the chunk_rows x V bound
    with OpRecorder() as rec:
        run(impl, *inputs, chunk_rows=chunk_rows, autocast=autocast)
    if impl == "chunked":
        assert rec.max_numel <= chunk_rows * v
    else:   # the bound is tight enough to catch the full logits
        assert rec.max_numel >= n * v > chunk_rows * v


MATMULS = ("mm", "addmm", "addmm_")


def test_frozen_weight_skips_its_matmul_and_nothing_is_recomputed():
    """5 chunks: the logits, grad_h and grad_W per chunk, all in the forward (2 when W is
    frozen); the backward only scales them, so it runs no matmul at all."""
    hid, w, b, t = make(40)
    counts = {}
    for train_w in (True, False):
        h, w_ = hid.clone().requires_grad_(True), w.clone().requires_grad_(train_w)
        with OpRecorder() as fwd:
            loss, _ = linear_cross_entropy(h, w_, t, bias=b, chunk_rows=8, impl="chunked")
        with OpRecorder() as bwd:
            loss.backward()
        counts[train_w] = (sum(fwd.ops[k] for k in MATMULS), sum(bwd.ops[k] for k in MATMULS))
    assert counts == {True: (15, 0), False: (10, 0)}


def test_no_grad_computes_only_the_logits():
    """Evaluation (no_grad) pays one matmul per chunk and keeps no gradient."""
    hid, w, b, t = make(40)
    h = hid.clone().requires_grad_(True)
    with torch.no_grad(), OpRecorder() as rec:
        loss, n_correct = linear_cross_entropy(h, w, t, bias=b, chunk_rows=8, impl="chunked")
    assert sum(rec.ops[k] for k in MATMULS) == 5
    ref, ref_correct = linear_cross_entropy(hid, w, t, bias=b, impl="plain")
    assert torch.allclose(loss, ref, rtol=1e-5) and int(n_correct) == int(ref_correct)


@pytest.mark.parametrize("impl", ["chunked", "plain"])
@pytest.mark.parametrize("bad, idx", [(-100, 3), (V, 6), (V + 7, 0)])
def test_target_outside_vocabulary_is_named(impl, bad, idx):
    hid, w, b, t = make(10)
    t[idx] = bad
    with pytest.raises(ValueError, match=rf"target\[{idx}\] = {bad} is outside the vocabulary \[0, {V}\)"):
        linear_cross_entropy(hid, w, t, bias=b, impl=impl)


def test_bad_shapes_and_options():
    hid, w, b, t = make(10)
    with pytest.raises(ValueError, match="impl='fast'"):
        linear_cross_entropy(hid, w, t, impl="fast")
    with pytest.raises(ValueError, match="target must be"):
        linear_cross_entropy(hid, w, t[:9])
    with pytest.raises(ValueError, match="integer class ids"):
        linear_cross_entropy(hid, w, t.float())
    with pytest.raises(ValueError, match="weight must be"):
        linear_cross_entropy(hid, w[:, :3], t)
    with pytest.raises(ValueError, match="bias must be"):
        linear_cross_entropy(hid, w, t, bias=b[:3])
    with pytest.raises(ValueError, match="chunk_rows"):
        linear_cross_entropy(hid, w, t, chunk_rows=0)
    with pytest.raises(ValueError, match="outside autocast"):
        linear_cross_entropy(hid, w.double(), t, impl="chunked")
    assert LOSS_IMPLS == ("auto", "chunked", "plain")
