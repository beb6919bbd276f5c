"""train_log.jsonl carries the CUDA caching allocator's events of each step (device allocations,
frees, flush-and-retries: west.train.metrics.AllocatorEvents), and only the step's: what a
checkpoint save between steps allocated is read off and dropped. A stand-in counter on the CPU."""
import contextlib
import io

from helpers.e2e import read_jsonl, tiny_llm, train_argv, write_lists
from helpers.threads import torch_threads


def test_each_step_logs_its_own_allocator_events(tmp_path_factory, corpus, monkeypatch):
    import west.train.loop as loop
    from west.bin.train import main

    reads = []

    class CountingEvents:   # the k-th read returns k * 10 device allocations
        def __init__(self, device):
            pass

        def read(self):
            reads.append(len(reads) + 1)
            return {"device_allocs": 10 * reads[-1], "alloc_retries": 0}

    monkeypatch.setattr(loop, "AllocatorEvents", CountingEvents)
    d = tmp_path_factory.mktemp("allocator")
    lists = write_lists(corpus["rows"], d / "lists", 13)
    with torch_threads(), contextlib.redirect_stdout(io.StringIO()):
        assert main(train_argv(tiny_llm(tmp_path_factory), lists.jsonl, d / "run", "--batch_type", "pack",
                               "--pack_tokens", "200", "--max_steps", "3", "--train.save_every", "1")) == 0
    steps = read_jsonl(d / "run" / "train_log.jsonl")
    # reads: step 1, after its save, step 2, after its save, step 3 (the last save ends the run)
    assert [s["device_allocs"] for s in steps] == [10, 30, 50]
    assert all(s["alloc_retries"] == 0 for s in steps)
