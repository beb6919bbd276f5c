"""west.lab.preloaded: west-train's loop fed from memory, its loader ended (a diagnosis tool's data)."""
import pytest

from west.lab.preloaded import PreloadedData


class FakeLoader:
    """A TrainData whose iteration is a generator, as WestDataLoader's is; it records what was asked."""

    def __init__(self, n: int = 10) -> None:
        self.n, self.closed, self.epochs, self.iterations = n, 0, [], 0

    def __iter__(self):
        self.iterations += 1
        try:
            for i in range(self.n):
                yield f"batch{i}"
        finally:
            self.closed += 1   # a DataLoader iterator dropped here ends its workers

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def state_dict(self) -> dict:
        return {"pos": 7}

    def load_state_dict(self, state: dict) -> None:
        self.loaded = state

    def dummy_batch(self) -> str:
        return "dummy"

    def pack_extent(self) -> str:
        return "extent"


def test_the_first_n_batches_come_once_from_the_loader_and_then_from_memory_every_epoch():
    loader = FakeLoader()
    data = PreloadedData(loader, 3)
    assert len(data) == 3 and data.pack_extent() == "extent"   # the encoder's replay is sized before any batch
    data.set_epoch(0)
    assert list(data) == ["batch0", "batch1", "batch2"]
    assert loader.iterations == 1 and loader.closed == 1      # the loader's iteration ended after the preload
    assert "preloaded 3 batches from the loader, then ended it: 0 child processes" in data.note
    data.set_epoch(1)                                          # later epochs: the same batches, the loader untouched
    assert list(data) == ["batch0", "batch1", "batch2"] and loader.iterations == 1 and loader.epochs == [0]
    assert data.dummy_batch() == "dummy" and data.state_dict() == {"pos": 7}


def test_a_short_loader_gives_what_it_has_and_an_empty_one_or_no_batch_is_refused():
    data = PreloadedData(FakeLoader(2), 5)
    assert list(data) == ["batch0", "batch1"] and len(data) == 2
    with pytest.raises(ValueError, match="gave no batch"):
        list(PreloadedData(FakeLoader(0), 3))
    with pytest.raises(ValueError, match="at least one batch"):
        PreloadedData(FakeLoader(), 0)
