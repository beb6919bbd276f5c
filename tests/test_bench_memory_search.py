"""The memory-budget search (west.bench.memory_search, west.bench.sizing) and the host-bytes
tracker (west.bench.memory) on a CPU: an injected out-of-memory at a chosen size is found
exactly; sizes parse or fail naming the flag. No timing is asserted."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from west.bench.memory import LiveTensorBytes, parse_size, storage_bytes
from west.bench.memory_search import NothingFits, largest_fitting

from helpers.e2e import bench_setup


def limit(k: int, calls: list):
    """A trial that runs out of memory above size ``k`` (records what it was asked)."""
    def trial(size: int) -> bool:
        calls.append(size)
        return size <= k
    return trial


@pytest.mark.parametrize("start", [None, 1, 8, 37, 38, 500, 1000])
def test_search_finds_the_injected_limit(start):
    calls: list = []
    res = largest_fitting(limit(37, calls), 1, 1000, start=start)
    assert res.size == 37 and not res.capped
    assert len(calls) == len(set(calls)) <= 22          # every size tried once; doubling + bisection
    assert res.trials == [(s, s <= 37) for s in calls]


def test_search_granularity_and_bounds():
    calls: list = []
    res = largest_fitting(limit(5000, calls), 200, 100_000, start=4096, granularity=128)
    assert res.size <= 5000 < res.size + 128 and res.size % 128 == 0
    assert all(s == 4096 or s % 128 == 0 for s in calls)
    res = largest_fitting(limit(10**9, []), 3, 50, start=4)     # everything fits up to the cap
    assert res.size == 50 and res.capped
    res = largest_fitting(limit(3, []), 3, 50, start=20)       # only the smallest fits
    assert res.size == 3 and not res.capped
    with pytest.raises(NothingFits, match="smallest size 3"):
        largest_fitting(limit(2, []), 3, 50, start=20)
    with pytest.raises(NothingFits):
        largest_fitting(limit(2, []), 3, 50)
    with pytest.raises(ValueError, match="lo <= hi"):
        largest_fitting(limit(2, []), 10, 5)


def test_parse_size():
    assert parse_size("24GiB") == 24 * 2**30
    assert parse_size("20GB") == 20 * 10**9
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("1.5 gib") == 3 * 2**29
    assert parse_size("4096") == 4096
    for bad in ("24 gigs", "GiB", "-1GiB", "0MiB", ""):
        with pytest.raises(ValueError, match="--memory_budget"):
            parse_size(bad)


def test_live_tensor_bytes_raises_at_the_allocation_over_budget():
    a = torch.ones(10)
    tracker = LiveTensorBytes(budget=1000, baseline=storage_bytes([a]))      # 40 bytes of baseline
    with tracker:
        x = torch.empty(100)                   # 400 bytes: 440 live
        v = x.view(10, 10).t()                 # views share x's storage: nothing new
        x.add_(1)                              # in place: nothing new
        y = x * 2                              # 400 more: 840
        assert tracker.baseline + tracker.live == 840
        del y                                  # freed: back to 440
        assert tracker.live == 400
        z = torch.empty(140)                   # 560: 1000, exactly the budget, fits
        assert tracker.peak == 1000
        del z
        with pytest.raises(torch.OutOfMemoryError, match="simulated out of memory.*exceed the host budget"):
            torch.empty(141)                   # 564 bytes: 1004 > 1000
        del v, x
    assert tracker.live == 0 and tracker.peak == 1004


def test_live_tensor_bytes_follows_autograd():
    w = torch.randn(256, requires_grad=True)     # 1 KiB
    tracker = LiveTensorBytes()
    with tracker:
        h = w.exp()                              # saved by ExpBackward for the backward
        loss = (h * h).sum()
        del h
        saved = tracker.live
        loss.backward()
        del loss
    assert saved == 1024 + 4                     # exp's result (saved by the graph) and the sum; h*h is gone
    assert tracker.live == 1024                  # the graph is freed; w.grad remains
    assert w.grad is not None


@pytest.fixture(scope="module")
def bench(tmp_path_factory, corpus):
    from west.bench.runner import PassRunner
    from west.bench.trial_batches import BatchSource
    from west.config import load_config
    from west.models.llm import load_tokenizer
    from west.train.build import build_model

    d = tmp_path_factory.mktemp("bench_mem")
    llm, conf = bench_setup(d, corpus["texts"].values())
    cfg = load_config(str(conf), [("model.llm.path", str(llm))])
    model = build_model(cfg.model, 0)
    runner = PassRunner(model, cfg.train, torch.device("cpu"), 0)
    source = BatchSource(str(corpus["list"]), load_tokenizer(cfg.model.llm.path), model.cfg.speech_shape(), 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # tiny steps: a second thread only waits for a busy core
    yield {"cfg": cfg, "runner": runner, "source": source, "dir": d, "llm": llm, "list": corpus["list"]}
    torch.set_num_threads(threads)


def inject_oom(monkeypatch, runner, too_big):
    """The runner's step raises an out-of-memory error on a batch for which ``too_big(batch)``."""
    real = runner.step

    def step(b, opt, sched):
        if too_big(b):
            raise torch.OutOfMemoryError(f"injected: {b.counters['utterances']} utterances")
        return real(b, opt, sched)

    monkeypatch.setattr(runner, "step", step)


def test_mode_search_finds_the_injected_batch_size(bench, monkeypatch):
    from west.bench.modes import standard_modes
    from west.bench.sizing import search_mode

    runner, init = bench["runner"], {k: v.clone() for k, v in bench["runner"].init.items()}
    inject_oom(monkeypatch, runner, lambda b: b.counters["utterances"] > 5)
    rec = search_mode(runner, bench["source"], standard_modes(["static"])[0], bench["cfg"].data, None,
                      log=lambda s: None)
    assert rec["key"] == "batch_size" and rec["size"] == 5 and not rec["capped"]
    assert (rec["lo"], rec["hi"]) == (1, 24)
    assert all(t["fits"] == (t["size"] <= 5) for t in rec["trials"])
    assert any("injected" in t["oom"] for t in rec["trials"])
    # the trials left the model as it was
    assert all(torch.equal(v, init[k]) for k, v in runner.model.state_dict().items())
    assert all(p.grad is None for p in runner.model.parameters())


def test_mode_search_token_budget_keeps_every_utterance(bench, monkeypatch):
    """Pack: OOM above 300 computed LLM positions. The size found makes no batch above that, one
    granule more does, and no size below the longest utterance is tried (all modes keep all N)."""
    from west.bench.modes import standard_modes
    from west.bench.sizing import search_mode
    from west.bench.trial_batches import worst_batches

    runner, source = bench["runner"], bench["source"]
    inject_oom(monkeypatch, runner, lambda b: b.counters["computed_llm_tokens"] > 300)
    mode = standard_modes(["pack"], pack_tokens=256)[0]
    rec = search_mode(runner, source, mode, bench["cfg"].data, None, granularity=32, log=lambda s: None)
    conf = dataclasses.replace(bench["cfg"].data, **mode.data)
    found = source.batches(dataclasses.replace(conf, pack_tokens=rec["size"]))
    assert max(b.counters["computed_llm_tokens"] for b in found) <= 300
    over = source.batches(dataclasses.replace(conf, pack_tokens=rec["size"] + 32))
    assert max(b.counters["computed_llm_tokens"] for b in over) > 300
    assert min(t["size"] for t in rec["trials"]) >= rec["lo"]
    assert sum(b.counters["utterances"] for b in source.batches(conf)) == 24
    assert worst_batches(over)   # the trial ran the worst of them


def test_host_budget_trial(bench):
    """On a CPU a trial runs under the live-tensor tracker: a budget at the weights' size fails
    with the simulated error, a generous one fits and reports its peak."""
    from west.bench.sizing import run_trial

    runner, source = bench["runner"], bench["source"]
    batches = source.batches(dataclasses.replace(bench["cfg"].data, batch_type="static", batch_size=4))[:2]
    weights = storage_bytes([*runner.model.parameters(), *runner.model.buffers()])
    fitted, peak, msg = run_trial(runner, batches, weights)
    assert not fitted and "simulated out of memory" in msg and peak > weights
    fitted, peak, msg = run_trial(runner, batches, 2**34)
    assert fitted and msg == "" and weights < peak < 2**34


def test_cli_with_a_host_budget(bench, tmp_path, capsys):
    from west.bin import benchmark as cli

    args = ["--config", str(bench["dir"] / "conf.yaml"), "--model.llm.path", str(bench["llm"]),
            "--data", str(bench["list"]), "--num_utts", "8", "--out_dir", str(tmp_path / "out"),
            "--modes", "static,pack", "--repeats", "1", "--profile", "never", "--pack_tokens", "512"]
    threads = torch.get_num_threads()
    assert cli.main([*args, "--memory_budget", "24 gigs"]) == 2
    assert cli.main([*args, "--memory_budget", "card"]) == 2        # CUDA only
    assert cli.main([*args, "--memory_budget", "1KiB", "--modes", "static"]) == 1   # not even the weights fit
    err = capsys.readouterr().err
    assert "--memory_budget: cannot read '24 gigs' as a size" in err
    assert "--memory_budget card needs a CUDA device" in err
    assert "--memory_budget 1KiB: mode static: even batch_size=1 runs out of memory (simulated out of memory" in err
    assert cli.main([*args, "--memory_budget", "64MiB", "--threads", "1", "--search_granularity", "64"]) == 0
    torch.set_num_threads(threads)
    res = json.loads((tmp_path / "out" / "benchmark.json").read_text(encoding="utf-8"))
    md = (tmp_path / "out" / "benchmark.md").read_text(encoding="utf-8")
    assert md.startswith("| method | configuration | CPU util %") and "(extrapolated from 8)" in md
    search = res["memory_budget"]["search"]
    assert res["memory_budget"]["budget"] == 64 * 2**20 and set(search) == {"static", "pack"}
    for name, r in res["modes"].items():
        s = search[name]
        assert r["data"][s["key"]] == s["size"] and f"{s['size']}" in r["configuration"]
        assert r["time_per_10000_s"] == pytest.approx(r["time_s"] * 10000 / 8)
        assert 0 < r["mfu"] and r["ops"]["per_step"]["total"] > 0
        assert all(t["fits"] == (t["peak_bytes"] <= 64 * 2**20) for t in s["trials"])
        assert s["capped"] or any(not t["fits"] and t["size"] <= s["size"] + s["granularity"] for t in s["trials"])
    assert res["efficiency"]["peak"]["tflops"] > 0 and res["efficiency"]["useful_flops_from"] == "pack"



def test_back_off_shrinks_by_a_share_and_at_least_one_step():
    from west.bench.sizing import back_off

    found = {"pack": {"key": "pack_tokens", "size": 22912, "granularity": 128, "lo": 600, "capped": False},
             "static": {"key": "batch_size", "size": 3, "granularity": 1, "lo": 1, "capped": True}}
    assert back_off(found, "pack") == 22912 - 1024          # 5 % = 1145, rounded down to the granularity
    assert found["pack"]["backed_off"] == [22912]
    assert back_off(found, "static") == 2 and not found["static"]["capped"]
    assert back_off(found, "static") == 1
    with pytest.raises(NothingFits, match="static"):
        back_off(found, "static")
    assert found["static"]["size"] == 1 and found["static"]["backed_off"] == [3, 2]


def test_cli_backs_off_a_mode_whose_timed_pass_runs_out(bench, tmp_path, capsys, monkeypatch):
    """A whole pass can need more than the search's worst batches (fragmentation on a GPU): that
    mode is timed again one step smaller, the weights restored, and the table says so."""
    from west.bench.runner import PassRunner
    from west.bin import benchmark as cli

    real, failed, inits = PassRunner.run, [], []

    def run(self, batches, warmup_steps):
        inits.append(self.init)
        if batches[0].is_packed and not failed:
            failed.append(len(batches))
            self.step(batches[0], *self.fresh(1))            # the weights move before it runs out
            raise torch.OutOfMemoryError("injected: the whole pass")
        return real(self, batches, warmup_steps)

    monkeypatch.setattr(PassRunner, "run", run)
    import west.bench.benchmark as benchmark
    real_load, loads = benchmark.load_batches, []
    monkeypatch.setattr(benchmark, "load_batches", lambda *a, **k: loads.append(a[2].batch_type) or real_load(*a, **k))
    args = ["--config", str(bench["dir"] / "conf.yaml"), "--model.llm.path", str(bench["llm"]),
            "--data", str(bench["list"]), "--num_utts", "8", "--out_dir", str(tmp_path / "out"),
            "--modes", "static,pack", "--repeats", "1", "--profile", "never", "--pack_tokens", "512",
            "--memory_budget", "64MiB", "--threads", "1", "--search_granularity", "64", "--no-count_ops"]
    threads = torch.get_num_threads()
    assert cli.main(args) == 0
    torch.set_num_threads(threads)
    assert failed
    out = capsys.readouterr().out
    assert "the timed pass of pack ran out of memory: injected: the whole pass; pack again at pack_tokens" in out
    # the retry loads and counts again only the mode whose size changed
    assert loads == ["static", "pack", "pack"]
    assert "static: batches, FLOP and operator counts as in the last attempt (same size)" in out
    res = json.loads((tmp_path / "out" / "benchmark.json").read_text(encoding="utf-8"))
    s = res["memory_budget"]["search"]["pack"]
    (first,) = s["backed_off"]
    assert s["size"] <= first - 64 and res["modes"]["pack"]["data"]["pack_tokens"] == s["size"]
    assert f"backed off from {first}" in res["modes"]["pack"]["configuration"]
    assert "backed_off" not in res["memory_budget"]["search"]["static"]
    assert len({id(i) for i in inits}) == 2                  # the retry started from a new runner ...
    assert all(torch.equal(v, inits[0][k]) for k, v in inits[-1].items())   # ... at the same initial weights
    assert all(math.isfinite(r["mean_loss"]) for r in res["modes"].values())

class FakeCuda:
    """torch.cuda's memory-cap calls on a machine without a GPU: records what was set."""

    def __init__(self, monkeypatch):
        self.fractions: list[tuple[float, int]] = []
        self.emptied = 0
        props = type("Props", (), {"total_memory": 80 * 2**30, "name": "Fake GPU"})()
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                            lambda f, device: self.fractions.append((f, device if isinstance(device, int)
                                                                     else device.index)))
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: setattr(self, "emptied", self.emptied + 1))


def test_cuda_budget_needs_no_index_and_bookkeeping_passes_lift_it(monkeypatch):
    """"cuda" (no index) is the current device, as torch's cap needs one (seen failing on an H100);
    FLOP/operator-count passes run uncapped and the cap is set again afterwards."""
    import west.bench.memory as memory

    fake = FakeCuda(monkeypatch)
    monkeypatch.setattr(memory, "_CAPS", {})
    with memory.cap_lifted(torch.device("cuda")):
        pass
    assert fake.fractions == []                                   # no cap set: nothing to lift
    cap = memory.cuda_budget(torch.device("cuda"), 20 * 2**30)
    assert cap["fraction"] == pytest.approx(0.25) and fake.fractions == [(0.25, 0)]
    with memory.cap_lifted(torch.device("cuda")):
        assert fake.fractions[-1] == (1.0, 0)
    assert fake.fractions[-1] == (0.25, 0) and fake.emptied == 1
    with memory.cap_lifted(torch.device("cpu")):
        pass
    assert len(fake.fractions) == 3
    with pytest.raises(ValueError, match="more than the card"):
        memory.cuda_budget(torch.device("cuda", 0), 100 * 2**30)


def test_flop_count_runs_in_the_training_precision():
    """The FLOP pass doubles as the warm-up and must hold the step's activations, not fp32 ones."""
    from west.bench.costs import count_flops

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.dtypes: list[torch.dtype] = []

        def forward(self, b):
            y = self.lin(b.x)
            self.dtypes.append(y.dtype)
            return {"loss_sum": y.float().sum()}

    class B:
        def __init__(self):
            self.x = torch.randn(3, 4)

        def to(self, device):
            return self

    probe = Probe()
    fp32 = count_flops(probe, [B()], torch.device("cpu"))
    bf16 = count_flops(probe, [B()], torch.device("cpu"), "bf16")
    assert probe.dtypes == [torch.float32, torch.bfloat16]
    assert fp32["total"] == bf16["total"] > 0


def test_worst_batches_include_the_longest_utterance_for_encoder_attention():
    """One attention group (the Conformer on CUDA) materialises N · longest² scores: a batch with one
    long utterance can be the worst although another has more frames and tokens."""
    from types import SimpleNamespace

    from west.bench.trial_batches import worst_batches

    def fake(lens, tokens):
        return SimpleNamespace(feat_lens=torch.tensor(lens), is_packed=False, input_ids=torch.zeros(1, tokens),
                               counters={"computed_llm_tokens": tokens, "computed_enc_frames": sum(lens)})

    many = fake([300] * 20, 900)        # most frames (6000), most tokens, most LLM attention
    long = fake([1500, 100, 100], 400)  # 3 · 1500² = 6.75M > 20 · 300² = 1.8M
    assert worst_batches([many, long]) == [0, 1]
    assert worst_batches([many, fake([300] * 3, 100)]) == [0]
