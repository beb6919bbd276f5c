"""west.models.depthwise: the depthwise convolution as an opaque operator in compiled graphs. It
computes F.conv1d's output and gradients, passes torch's operator checks, and a compiled function
over it compiles once for every length (the convolution traced by AOT autograd specialised the
length; the shifted products it replaced made a 1.7 ms kernel per block on an H200)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

from west.models.depthwise import _conv, depthwise_conv_op
from west.models.layout import same_conv1d


def _grads(fn, x, conv, g):
    x = x.detach().requires_grad_(True)
    conv.zero_grad()
    y = fn(x, conv)
    y.backward(g)
    return y.detach(), x.grad, conv.weight.grad.clone(), conv.bias.grad.clone()


@pytest.mark.parametrize("bias", [True, False])
def test_the_operator_passes_torchs_checks(bias):
    torch.manual_seed(0)
    x, w = torch.randn(2, 6, 19, requires_grad=True), torch.randn(6, 1, 7, requires_grad=True)
    torch.library.opcheck(_conv, (x, w, torch.randn(6, requires_grad=True) if bias else None, 3))


def test_it_computes_the_convolution_and_its_gradients():
    torch.manual_seed(0)
    conv = torch.nn.Conv1d(8, 8, 15, groups=8, padding=7)
    x, g = torch.randn(2, 8, 41), torch.randn(2, 8, 41)
    for a, b in zip(_grads(depthwise_conv_op, x, conv, g), _grads(lambda x, c: c(x), x, conv, g)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="depthwise convolution of odd kernel"):
        depthwise_conv_op(x, torch.nn.Conv1d(8, 8, 4, groups=8))
    with torch.autocast("cpu", dtype=torch.bfloat16):   # the dtype autocast gives F.conv1d
        assert depthwise_conv_op(x, conv).dtype == F.conv1d(x, conv.weight, conv.bias, padding=7, groups=8).dtype


def test_compiled_it_runs_once_for_every_length_and_matches_eager():
    torch.manual_seed(0)
    conv = torch.nn.Conv1d(8, 8, 7, groups=8, padding=3)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(same_conv1d, backend=counter, dynamic=True)
    for length in (23, 40, 57):
        x, g = torch.randn(1, 8, length), torch.randn(1, 8, length)
        for a, b in zip(_grads(compiled, x, conv, g), _grads(same_conv1d, x, conv, g)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert counter.frame_count == 1
    graph = "\n".join(str(gm.graph) for gm in counter.graphs)
    assert "west.depthwise_conv1d" in graph and "unfold" not in graph
