"""One per-token loss per optimizer step, with the real data pipeline and the real SpeechLLM.

The same 8 utterances (tiny corpus, dither on: seeded per key, so every layout sees
the same features) go into ONE optimizer step laid out as: one static batch (the
reference), 4 accumulated static micro-batches, dynamic batches, packs with a packed
and with a padded encoder, and 2 gloo ranks (packs and static). The gradient of the
step and the parameters after one SGD step must agree (float32, rel 1e-5). The
fake-model versions of these checks are in test_train_step.py / test_train_ddp.py.
"""
from __future__ import annotations

import pytest
import torch

from helpers.e2e import tiny_cpu_model, tiny_llm, write_lists
from helpers.ranks import init_gloo, rank_results, run_ranks

N_UTTS = 8
RTOL = 1e-5
LR = 1.0
CASES = {  # name -> (data config, world size)
    "static_1x8": (dict(batch_type="static", batch_size=8), 1),
    "static_4x2": (dict(batch_type="static", batch_size=2), 1),       # 4 accumulated micro-batches
    "dynamic": (dict(batch_type="dynamic", max_tokens_in_batch=150), 1),
    "pack": (dict(batch_type="pack", pack_tokens=160), 1),
    "pack_encoder_padded": (dict(batch_type="pack", pack_tokens=160, encoder_layout="padded"), 1),
    "pack_2_ranks": (dict(batch_type="pack", pack_tokens=160), 2),
    "static_2_ranks": (dict(batch_type="static", batch_size=3), 2),
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def env(tmp_path_factory, corpus):
    d = tmp_path_factory.mktemp("real_step")
    planned = write_lists(corpus["rows"], d, N_UTTS).jsonl
    return {"llm": str(tiny_llm(tmp_path_factory)), "list": str(planned), "dir": d}


def one_step(llm: str, data_list: str, data_kw: dict, info=None) -> dict:
    """All of this rank's batches of epoch 0 as the micro-batches of one SGD step."""
    from transformers import AutoTokenizer

    from west.data.config import DataConfig
    from west.data.dataset import build_dataloader
    from west.models.speech_llm import SpeechLLM
    from west.ranks import unwrap
    from west.train.distributed import DistInfo, wrap_model
    from west.train.step import plan_step, train_step

    info = info or DistInfo()
    tok = AutoTokenizer.from_pretrained(llm)
    model_cfg = tiny_cpu_model(llm)
    loader, _ = build_dataloader(data_list, tok, DataConfig(**data_kw), model_cfg.speech_shape(), info.rank,
                                 info.world_size, seed=3, epoch=0, training=True)
    batches = list(loader)
    torch.manual_seed(0)
    model = wrap_model(SpeechLLM(model_cfg).train(), info)
    names = {id(p): n for n, p in unwrap(model).named_parameters()}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    grads: dict = {}
    opt.register_step_pre_hook(lambda o, a, k: grads.update(
        {names[id(p)]: p.grad.detach().clone() for g in o.param_groups for p in g["params"]}))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    res = train_step(model, batches, plan_step(batches, len(batches)), opt, sched,
                     device=torch.device("cpu"), world_size=info.world_size)
    return {"status": res.status, "loss": res.loss, "n_tokens": res.n_tokens, "micro": len(batches),
            "utterances": res.counters["utterances"], "keys": sorted(k for b in batches for k in b.keys),
            "grads": grads, "params": {k: v.detach().clone() for k, v in unwrap(model).state_dict().items()}}


def _rank_worker(rank: int, world: int, port: int, env: dict) -> None:
    from west.train.distributed import cleanup

    info = init_gloo(rank, world, port)
    out = {name: one_step(env["llm"], env["list"], kw, info) for name, (kw, w) in CASES.items() if w == world}
    torch.save(out, env["dir"] / f"rank{rank}.pt")
    cleanup()


@pytest.fixture(scope="module")
def results(env):
    out = {name: one_step(env["llm"], env["list"], kw) for name, (kw, w) in CASES.items() if w == 1}
    run_ranks(_rank_worker, env)
    ranks = rank_results(env["dir"])
    for name in ranks[0]:
        out[name] = ranks[0][name]
        out[name]["keys"] = sorted(ranks[0][name]["keys"] + ranks[1][name]["keys"])
        out[name]["micro"] = (ranks[0][name]["micro"], ranks[1][name]["micro"])
    return out


def test_layouts_really_differ(results):
    assert results["static_1x8"]["micro"] == 1 and results["static_4x2"]["micro"] == 4
    assert results["dynamic"]["micro"] > 1 and results["pack"]["micro"] > 1
    assert min(results["pack_2_ranks"]["micro"]) >= 1 and min(results["static_2_ranks"]["micro"]) >= 1


@pytest.mark.parametrize("name", [n for n in CASES if n != "static_1x8"])
def test_same_data_same_step(results, name):
    ref, got = results["static_1x8"], results[name]
    assert got["status"] == ref["status"] == "ok"
    assert got["keys"] == ref["keys"] and len(ref["keys"]) == N_UTTS  # the same utterances, once each
    assert got["n_tokens"] == ref["n_tokens"] and got["utterances"] == N_UTTS
    assert got["loss"] == pytest.approx(ref["loss"], rel=RTOL)
    assert got["grads"].keys() == ref["grads"].keys() and len(ref["grads"]) > 20
    # Per tensor, relative to its largest entry; exactly-zero-in-theory gradients (softmax shift
    # invariance) against 1e-3 of the largest gradient of the model instead of their round-off.
    floor = 1e-3 * max(g.abs().max().item() for g in ref["grads"].values())
    for k, g in ref["grads"].items():
        scale = max(g.abs().max().item(), floor)
        assert (got["grads"][k] - g).abs().max().item() <= RTOL * scale, (name, k)
    for k, p in ref["params"].items():
        torch.testing.assert_close(got["params"][k], p, rtol=RTOL, atol=RTOL * LR * floor * 1e3, msg=f"{name}: {k}")
