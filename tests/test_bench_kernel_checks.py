"""The helpers the attention-kernel check tools share (west.bench.kernel_checks) and their timing
(west.bench.timing)."""
import torch

from west.bench.kernel_checks import random_lengths, relative_error
from west.bench.timing import host_and_device_ms, median_ms


def test_random_lengths_fill_the_total_within_the_range():
    gen = torch.Generator().manual_seed(0)
    lens = random_lengths(1000, 20, 300, gen)
    assert sum(lens) == 1000
    assert all(20 <= n <= 300 for n in lens[:-1]) and 1 <= lens[-1] <= 300
    again = random_lengths(1000, 20, 300, torch.Generator().manual_seed(0))
    assert again == lens


def test_relative_error_is_the_norm_ratio():
    b = torch.tensor([3.0, 4.0])
    assert relative_error(b + torch.tensor([0.0, 0.5]), b) == 0.1
    assert relative_error(b, b) == 0.0


def test_median_ms_warms_up_then_times_each_call():
    calls = []
    ms = median_ms(lambda: calls.append(1), torch.device("cpu"), repeats=5, warmup=2)
    assert len(calls) == 7
    assert 0.0 <= ms < 1000.0


def test_host_and_device_ms_warm_up_then_time_each_call():
    calls = []
    host, drained = host_and_device_ms(lambda: calls.append(1), torch.device("cpu"), repeats=3, warmup=1)
    assert len(calls) == 4
    assert 0.0 <= host <= drained
