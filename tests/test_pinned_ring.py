"""``train.pinned_ring_mib``: the ring hands every copy intact bytes, however far the device runs behind.

The device is modelled: a copy is only queued, and runs when the test lets the device advance (or
when the host waits for an event); the result tensor is filled then, from whatever the ring's
bytes hold at that moment. A ring that rewrote a slice too early would deliver changed data."""
import random

import pytest
import torch

import west.batch as batch_module
import west.pinned_ring as pinned_ring
from west.pinned_ring import ALIGN, PinnedRing, use_pinned_ring


class LaggingDevice:
    """Copies run in order, only when :meth:`advance` (or an event's ``synchronize``) lets them."""

    def __init__(self):
        self.queued: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.done = 0

    def copy(self, staged: torch.Tensor, device) -> torch.Tensor:
        out = torch.full_like(staged, 7) if staged.dtype != torch.bool else torch.zeros_like(staged)
        self.queued.append((staged, out))
        return out

    def advance(self, n: int) -> None:
        for staged, out in self.queued[:n]:
            out.copy_(staged)
        self.done += min(n, len(self.queued))
        del self.queued[:n]

    def new_event(self) -> "Event":
        return Event(self)


class Event:
    def __init__(self, device: LaggingDevice):
        self.device, self.at = device, None

    def record(self) -> None:      # after every copy queued so far
        self.at = self.device.done + len(self.device.queued)

    def query(self) -> bool:
        return self.device.done >= self.at

    def synchronize(self) -> None:
        self.device.advance(self.at - self.device.done)


def ring(capacity: int, device: LaggingDevice) -> PinnedRing:
    return PinnedRing(capacity, "cuda:0", alloc=lambda n: torch.empty(n, dtype=torch.uint8),
                      copy=device.copy, new_event=device.new_event)


def random_tensor(rng: random.Random, max_bytes: int) -> torch.Tensor:
    dtype = rng.choice([torch.int64, torch.int32, torch.bool, torch.float32])
    n = rng.randint(0, max_bytes // torch.empty(0, dtype=dtype).element_size())
    g = torch.Generator().manual_seed(rng.randint(0, 2**31))
    if dtype == torch.bool:
        return torch.rand(n, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(n, generator=g)
    return torch.randint(-2**30, 2**30, (n,), generator=g, dtype=dtype)


def send_random(seed: int, copies: int, lags=(0,)) -> tuple[bool, PinnedRing]:
    """``copies`` random tensors through a 1 KiB ring, the device advancing by a random choice of
    ``lags`` copies after each (its sources changed once the call returns): (all intact, the ring)."""
    rng = random.Random(seed)
    dev = LaggingDevice()
    r = ring(1024, dev)
    sent, got = [], []
    for _ in range(copies):
        t = random_tensor(rng, 512)
        sent.append(t.clone())
        got.append(r.to_device(t))
        t.fill_(0) if t.dtype != torch.bool else t.logical_not_()
        dev.advance(rng.choice(lags))
    dev.advance(len(dev.queued))
    return all(torch.equal(a, b) for a, b in zip(sent, got)), r


@pytest.mark.parametrize("seed", range(5))
def test_every_copy_arrives_intact_with_the_device_behind(seed):
    """Copies of random sizes and dtypes through a ring of 1 KiB (wraps and waits on most copies)
    while the device runs behind by a random amount: each result equals its source."""
    intact, r = send_random(seed, 400, lags=(0, 0, 0, 1, 2))
    assert intact
    assert r.wraps > 10 and r.waits > 10, r.summary()


def test_the_model_catches_a_ring_that_does_not_wait(monkeypatch):
    """The method works: without the waits, the same run delivers overwritten bytes."""
    monkeypatch.setattr(Event, "synchronize", lambda self: None)
    intact, _ = send_random(0, 100)
    assert not intact


def test_a_device_that_keeps_up_never_waits():
    dev = LaggingDevice()
    r = ring(4096, dev)
    for i in range(200):
        out = r.to_device(torch.arange(i % 50, dtype=torch.int64))
        dev.advance(1)
        assert torch.equal(out, torch.arange(i % 50))
    assert r.waits == 0 and r.wraps > 0 and r.copies == 200
    assert len(r._inflight) <= 1 and len(r._spare) <= 2   # completed events are reused, not piled up


def test_slices_are_aligned_and_shapes_kept():
    dev = LaggingDevice()
    r = ring(4096, dev)
    for shape, dtype in [((3, 5), torch.int64), ((), torch.float32), ((0, 4), torch.int32), ((7,), torch.bool)]:
        t = torch.ones(shape, dtype=dtype)
        out = r.to_device(t)
        dev.advance(1)
        assert out.shape == t.shape and out.dtype == dtype and torch.equal(out, t)
        start = r._inflight[-1][0]
        assert start % ALIGN == 0
    t = torch.arange(12).reshape(3, 4).t()    # not contiguous: staged in order, values kept
    out = r.to_device(t)
    dev.advance(1)
    assert torch.equal(out, t)


def test_a_tensor_over_half_the_ring_is_pinned_apart():
    r = ring(1024, LaggingDevice())
    assert r.fits(torch.zeros(64, dtype=torch.int64)) and not r.fits(torch.zeros(65, dtype=torch.int64))
    with pytest.raises(ValueError, match="capacity"):
        ring(100, LaggingDevice())


def test_the_process_ring_serves_cuda_only(monkeypatch):
    """``use_pinned_ring``: none on the CPU or at 0 MiB; ``to_device`` sends a CPU tensor bound for
    the ring's CUDA device through it, and anything else past it."""
    assert use_pinned_ring(8, "cpu") is None and use_pinned_ring(0, "cuda:0") is None
    assert pinned_ring.ring_for(torch.device("cuda:0")) is None
    dev = LaggingDevice()
    fake = ring(4096, dev)
    monkeypatch.setattr(pinned_ring, "_ring", fake)
    assert pinned_ring.ring_for(torch.device("cuda:0")) is fake
    assert pinned_ring.ring_for(torch.device("cuda:1")) is None
    out = batch_module.to_device(torch.arange(5), "cuda:0")
    dev.advance(1)
    assert torch.equal(out, torch.arange(5)) and fake.copies == 1
    assert batch_module.to_device(torch.arange(5), "cpu").device.type == "cpu" and fake.copies == 1


def test_trainer_and_benchmark_runner_set_the_ring(tmp_path, monkeypatch):
    """train.pinned_ring_mib reaches use_pinned_ring from west-train and the benchmark alike, and a
    negative size is refused naming the key."""
    import west.bench.runner as runner
    import west.train.loop as loop
    from west.train.config import RunConfig, TrainConfig
    from west.train.distributed import DistInfo

    from helpers.fakes import ListData, TokenModel, make_batches
    asked = []
    for module in (loop, runner):
        monkeypatch.setattr(module, "use_pinned_ring", lambda mib, device: asked.append((mib, str(device))))
    train = TrainConfig(pinned_ring_mib=8, tensorboard=False, progress_bar=False, nvml=False)
    loop.Trainer(train, RunConfig(output_dir=str(tmp_path), train_data="unused"), TokenModel(seed=0),
                 ListData(make_batches(2)), DistInfo())
    runner.PassRunner(TokenModel(seed=0), train, torch.device("cpu"), 0)
    assert asked == [(8, "cpu"), (8, "cpu")]
    assert TrainConfig().pinned_ring_mib == 0
    with pytest.raises(ValueError, match="train.pinned_ring_mib"):
        TrainConfig(pinned_ring_mib=-1)


def test_the_summary_line():
    from west.train.metrics import done_sentence
    r = ring(2**20, LaggingDevice())
    r.to_device(torch.arange(3))
    assert r.summary() == "pinned ring of 1 MiB: 1 copies, 0 waits, 0 wraps"
    assert done_sentence({"step": 3, "epoch": 0, "pinned_ring": r.summary()}).endswith(
        "; pinned ring of 1 MiB: 1 copies, 0 waits, 0 wraps (train.pinned_ring_mib)")
