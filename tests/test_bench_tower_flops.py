"""The audio tower's FLOP arithmetic (west.bench.tower_flops) equals torch's flop counter on a
tiny Qwen2-Audio tower, run packed on one utterance and padded to 30 s."""
from __future__ import annotations

import pytest
import torch

from west.bench.costs import sdpa_flops
from west.bench.tower_flops import QWEN2_AUDIO_7B, WINDOW_FRAMES, TowerShape, padding_saving, tower_flops
from west.models.qwen2_audio import Qwen2AudioPackedEncoder, load_hf_qwen2_audio_tower, read_qwen2_audio_config

from helpers.speech import N_MELS, tiny_qwen2_audio_dir, tower_alone

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def counted(run, n: int) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    mode = FlopCounterMode(display=False, custom_mapping=sdpa_flops())
    with mode, torch.no_grad():
        run(torch.randn(n, N_MELS))
    return int(mode.get_total_flops())


def test_the_formula_is_what_the_counter_counts(tmp_path):
    path = tiny_qwen2_audio_dir(tmp_path / "q2a")
    shape = TowerShape.of(read_qwen2_audio_config(path).audio_config)
    tower = load_hf_qwen2_audio_tower(path).eval()
    packed = Qwen2AudioPackedEncoder(load_hf_qwen2_audio_tower(path), path).eval()
    padded = Qwen2AudioPackedEncoder(load_hf_qwen2_audio_tower(path), path, pad_to_30s=True).eval()
    for n in (37, 100, 451):
        assert counted(lambda mel: tower_alone(tower, mel), n) == tower_flops(n, shape), n
        assert counted(lambda mel: padded.forward_flat(mel[None], lengths=torch.tensor([n])), n) \
            == tower_flops(WINDOW_FRAMES, shape), n
        # west's packed layout adds a gap frame or two per utterance to the convolutions and runs
        # attention on the CPU at its length bucket (8 per octave: <= 2^(1/8) longer, <= 1.19x the product)
        west = counted(lambda mel: packed.forward_flat(mel[None], lengths=torch.tensor([n])), n)
        assert tower_flops(n, shape) < west <= 1.19 * tower_flops(n + 2, shape), n


def test_the_real_shape_s_saving_grows_as_utterances_shorten():
    savings = [padding_saving(n, QWEN2_AUDIO_7B) for n in (1500, 450, 200)]
    assert 0.4 < savings[0] < savings[1] < savings[2] < 1.0
    assert padding_saving(WINDOW_FRAMES, QWEN2_AUDIO_7B) == 0.0
