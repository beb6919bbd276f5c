"""Projector: per-utterance frame stacking with a zero-filled last group."""
import pytest
import torch

from west.models.config import ProjectorConfig
from west.models.projector import Projector
from west.shapes import projected_frames

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("stride", [1, 2, 3, 4])
def test_output_length_and_zero_fill_per_utterance(stride):
    torch.manual_seed(0)
    proj = Projector(8, 16, ProjectorConfig(stride=stride, hidden_dim=32))
    lens = [1, 5, 8, 3, 7]
    xs = [torch.randn(n, 8) for n in lens]
    out = proj(torch.cat(xs), lens)
    assert proj.output_lengths(lens) == [projected_frames(n, stride) for n in lens]
    assert out.shape == (sum(projected_frames(n, stride) for n in lens), 16)
    start = 0
    for x in xs:
        n_out = projected_frames(len(x), stride)
        manual = torch.zeros(n_out * stride, 8)
        manual[: len(x)] = x  # zeros, never the next utterance's frames
        expected = proj.net(manual.view(n_out, stride * 8))
        assert torch.allclose(out[start: start + n_out], expected, atol=1e-6)
        start += n_out


def test_rejects_wrong_lengths():
    proj = Projector(8, 16, ProjectorConfig(stride=2, hidden_dim=32))
    with pytest.raises(ValueError):
        proj(torch.randn(10, 8), [4, 4])
    with pytest.raises(ValueError):
        ProjectorConfig(stride=0)
