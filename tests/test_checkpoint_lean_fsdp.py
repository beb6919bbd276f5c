"""A lean LoRA checkpoint under FSDP2 on 2 gloo ranks: the frozen base LLM is never gathered
(the save gathers exactly the other entries' elements, all of them sharded DTensors), the files hold the same
entries as on one process, and a fresh FSDP2 model resumes every weight and optimizer state."""
from __future__ import annotations

import torch

from helpers.ranks import init_gloo, rank_results, run_ranks
from helpers.speech import lora_model, packed_batch, samples, write_base


def _full(model) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().clone() for k, v in sd.items()}


def _worker(rank: int, world: int, port: int, env: dict) -> None:
    from torch.distributed.tensor import DTensor

    from west.checkpoint import training as ck
    from west.checkpoint.base_llm import base_llm_of, frozen_names
    from west.train.distributed import cleanup, wrap_model
    from west.train.schedule import build_optimizer, build_scheduler

    info = init_gloo(rank, world, port)
    model = lora_model(llm_path=env["base"]).train()
    base, frozen = base_llm_of(model), frozen_names(model, "llm.")
    fsdp = wrap_model(model, info, fsdp=True)
    opt = build_optimizer(fsdp, 1e-2, 0.0)
    sched = build_scheduler(opt, 1, 10)
    b = packed_batch(samples()[rank * 2:rank * 2 + 2], 96)
    fsdp(b)["loss_sum"].backward()
    opt.step()
    sched.step()
    entries = fsdp.state_dict()
    assert all(isinstance(entries[n], DTensor) for n in frozen)  # sharded: a gather would show
    want = sum(t.numel() for n, t in entries.items() if n not in frozen and isinstance(t, DTensor))
    gathered, real = [], DTensor.full_tensor
    DTensor.full_tensor = lambda self, *a, **k: gathered.append(self.numel()) or real(self, *a, **k)
    try:
        path = ck.save_checkpoint(env["dir"], 1, model=fsdp, optimizer=opt, scheduler=sched,
                                  data_state={}, base=base)
    finally:
        DTensor.full_tensor = real
    before = _full(fsdp)
    fresh = wrap_model(lora_model(seed=7, llm_path=env["base"]).train(), info, fsdp=True)
    opt2 = build_optimizer(fresh, 1e-2, 0.0)
    ck.load_checkpoint(path, model=fresh, optimizer=opt2, scheduler=build_scheduler(opt2, 1, 10), base=base)
    after = _full(fresh)
    same = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    torch.save({"gathered": sum(gathered), "want": want, "frozen": len(frozen), "same": same},
               env["dir"] / f"rank{rank}.pt")
    cleanup()


def test_fsdp_lean_lora_checkpoint_never_gathers_the_base(tmp_path):
    from safetensors.torch import load_file

    env = {"base": str(write_base(tmp_path / "base")), "dir": tmp_path / "ckpts"}
    run_ranks(_worker, env)
    res = rank_results(tmp_path / "ckpts")
    for r in res:
        assert r["frozen"] > 0 and r["gathered"] == r["want"] > 0, r  # every entry but the frozen LLM
        assert r["same"], r
    path = tmp_path / "ckpts" / "step_00000001"
    assert not any(k.startswith("llm.") for k in load_file(path / "model.safetensors"))
    assert any("lora_A" in k for k in load_file(path / "adapter" / "adapter_model.safetensors"))
