"""train.cudnn_attention: west-train and the benchmark's passes both set whether SDPA may pick
cuDNN's fused attention (a graph built per new shape: off unless asked for)."""
from __future__ import annotations

import pytest
import torch

from west.bench.runner import PassRunner
from west.train.config import RunConfig, TrainConfig
from west.train.distributed import DistInfo
from west.train.loop import Trainer

from helpers.fakes import ListData, TokenModel, make_batches


@pytest.fixture
def restore_sdpa_flag():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


@pytest.mark.parametrize("allowed", [False, True])
def test_trainer_and_benchmark_runner_set_cudnn_attention(tmp_path, restore_sdpa_flag, allowed):
    train = TrainConfig(cudnn_attention=allowed, tensorboard=False, progress_bar=False, nvml=False)
    torch.backends.cuda.enable_cudnn_sdp(not allowed)
    Trainer(train, RunConfig(output_dir=str(tmp_path), train_data="unused"), TokenModel(seed=0),
            ListData(make_batches(2)), DistInfo())
    assert torch.backends.cuda.cudnn_sdp_enabled() is allowed
    torch.backends.cuda.enable_cudnn_sdp(not allowed)
    PassRunner(TokenModel(seed=0), train, torch.device("cpu"), 0)
    assert torch.backends.cuda.cudnn_sdp_enabled() is allowed


def test_cudnn_attention_is_off_by_default():
    assert TrainConfig().cudnn_attention is False
