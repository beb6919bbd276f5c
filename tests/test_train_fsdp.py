"""Per-layer FSDP2 on 2 gloo ranks (CPU) with the real SpeechLLM and the real data pipeline.

One 2-rank run does every check that needs the same process group: the module
tree (each encoder block and LLM decoder layer its own FSDP unit, every parameter a
DTensor shard, one unit gathered at a time), optimizer steps under FSDP2 vs DDP (fp32:
equal within float tolerance; bf16: the mixed-precision policy gathers bf16 weights,
keeps fp32 master weights and gradients, and agrees with DDP + autocast within bf16
tolerance), a frozen LLM (still sharded, no gradients, same steps as DDP), activation
checkpointing under FSDP2 (each unit recomputed with gathered weights, same losses), an
uninterrupted Trainer run with ``train.fsdp``, and last the same run killed with SIGKILL
on both ranks. A second 2-rank run resumes it from its latest checkpoint and must match
the uninterrupted run exactly.

The model: tiny_cpu.yaml's, with 4 Conformer blocks and a random 4-layer 64-d Qwen2, so
the units hold most of the weights (73 %; the root keeps the subsampling, projector, CTC
head and the tied embedding table, and is sharded too).
"""
from __future__ import annotations

import signal

import pytest
import torch
import torch.multiprocessing as mp

from helpers.e2e import tiny_cpu_model, write_lists
from helpers.fakes import ListData
from helpers.ranks import init_gloo, rank_results, run_ranks

N_UTTS = 8
STEPS = 2           # optimizer steps per comparison (each over all of the rank's packs)
TRAIN_STEPS = 4     # Trainer runs: checkpoints at 2 and 4
KILL_AT = 3         # SIGKILL when fetching the batch of step 4: the latest checkpoint is step 2
DATA = dict(batch_type="pack", pack_tokens=160)


def model_config(llm: str):
    """tiny_cpu.yaml's model, 4 encoder blocks (DDP and FSDP compute the same function)."""
    return tiny_cpu_model(llm, num_blocks=4)


def _full_state(model) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().clone() for k, v in sd.items()}


class UnitProbe:
    """Forward pre-hooks on every FSDP unit (after FSDP's own): how many units hold gathered
    (plain tensor) weights at that moment and their dtype; and on the first parametrised
    submodule of each unit, which also runs when activation checkpointing recomputes the
    unit in backward (transformers checkpoints a layer's ``forward``, inside FSDP's hooks):
    how often it runs and whether its weights were ever still sharded there."""

    def __init__(self, model) -> None:
        from torch.distributed.tensor import DTensor

        self.units = list(model.fsdp_units())
        self.model, self.max_gathered, self.max_gathered_bytes = model, 0, 0
        self.calls, self.inner_sharded, self.dtypes = 0, 0, set()

        def unit_hook(module, args):
            gathered = [u for u in self.units if not isinstance(next(u.parameters()), DTensor)]
            self.max_gathered = max(self.max_gathered, len(gathered))
            live = sum(p.numel() * p.element_size() for p in self.model.parameters()
                       if not isinstance(p, DTensor))
            self.max_gathered_bytes = max(self.max_gathered_bytes, live)
            self.dtypes.add(str(next(module.parameters()).dtype))

        def inner_hook(module, args):
            self.calls += 1
            self.inner_sharded += any(isinstance(p, DTensor) for p in module.parameters(recurse=False))

        for u in self.units:
            u.register_forward_pre_hook(unit_hook)
            inner = next(m for m in u.modules() if m is not u and next(m.parameters(recurse=False), None) is not None)
            inner.register_forward_pre_hook(inner_hook)


def _tree(model) -> dict:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard

    not_shards, local, full = [], 0, 0
    for name, p in model.named_parameters():
        if not (isinstance(p, DTensor) and tuple(p.placements) == (Shard(0),)):
            not_shards.append(name)
            continue
        local += p.to_local().numel() * p.element_size()
        full += p.numel() * p.element_size()
    units = list(model.fsdp_units())
    return {"n_units": len(units), "n_blocks": len(model.encoder.blocks),
            "n_layers": len(model.llm.model.layers),
            "units_fsdp": all(isinstance(u, FSDPModule) for u in units),
            "root_fsdp": isinstance(model, FSDPModule), "not_shards": not_shards,
            "mesh_devices": sorted({p.device_mesh.device_type for p in model.parameters() if isinstance(p, DTensor)}),
            "local_bytes": local, "full_bytes": full,
            "unit_bytes": [sum(p.numel() * p.element_size() for p in u.parameters()) for u in units]}


def _steps(model, batches, world: int, precision: str = "fp32") -> dict:
    """STEPS AdamW steps, each over all of this rank's batches as accumulated micro-batches."""
    from west.train.step import plan_step, train_step

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    grad_dtypes: set = set()
    opt.register_step_pre_hook(lambda o, a, k: grad_dtypes.update(
        str(p.grad.dtype) for g in o.param_groups for p in g["params"] if p.grad is not None))
    losses = []
    for _ in range(STEPS):
        res = train_step(model, batches, plan_step(batches, len(batches)), opt, sched,
                         device=torch.device("cpu"), world_size=world, precision=precision)
        assert res.status == "ok", res
        losses.append(res.loss)
    state_dtypes = {str(v.dtype) for s in opt.state.values() for v in s.values() if v.dim() > 0}
    return {"losses": losses, "params": _full_state(model), "grad_dtypes": sorted(grad_dtypes),
            "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "state_dtypes": sorted(state_dtypes)}


def _trainer(env: dict, info, batches, dataset, kill_at: int = -1, kill_note=None):
    from west.models.speech_llm import SpeechLLM
    from west.train.config import RunConfig, TrainConfig
    from west.train.loop import Trainer

    train = TrainConfig(lr=1e-3, warmup_steps=1, max_steps=TRAIN_STEPS, save_every=2, keep_last=3,
                        tensorboard=False, progress_bar=False, log_every=1000, seed=1, fsdp=True,
                        max_epochs=0, save_at_epoch_end=False)
    (env["dir"] / "run").mkdir(parents=True, exist_ok=True)
    run = RunConfig(output_dir=str(env["dir"] / "run"), train_data="unused", resume="auto")
    torch.manual_seed(0)
    model = SpeechLLM(env["cfg"]).train()
    return Trainer(train, run, model, ListData(batches, kill_at=kill_at, dummy=dataset.dummy_batch,
                                                       kill_note=kill_note), info)


def _rank_setup(rank: int, world: int, port: int, env: dict):
    from transformers import AutoTokenizer

    from west.data.config import DataConfig
    from west.data.dataset import build_dataloader

    info = init_gloo(rank, world, port)
    tok = AutoTokenizer.from_pretrained(env["llm"])
    loader, dataset = build_dataloader(env["list"], tok, DataConfig(**DATA), env["cfg"].speech_shape(),
                                       rank, world, seed=3, epoch=0, training=True)
    return info, list(loader), dataset


def _worker(rank: int, world: int, port: int, env: dict) -> None:
    from torch.distributed.tensor import DTensor

    from west.models.llm import decoder_layers
    from west.models.mlp_checkpoint import checkpoint_mlps
    from west.models.speech_llm import SpeechLLM
    from west.train.distributed import wrap_model

    info, batches, dataset = _rank_setup(rank, world, port, env)

    def model(ckpt: bool = False):
        torch.manual_seed(0)
        m = SpeechLLM(env["cfg"]).train()
        if ckpt:
            m.gradient_checkpointing_enable()
        return m

    res: dict = {"micro": len(batches)}
    real = torch._C._get_accelerator
    torch._C._get_accelerator = lambda: torch.device("cuda")  # as on a GPU machine: FSDP2's default mesh
    try:
        fsdp = wrap_model(model(), info, fsdp=True)  # a CPU run (info.device) must shard on a CPU mesh
    finally:
        torch._C._get_accelerator = real
    res["tree"] = _tree(fsdp)
    probe = UnitProbe(fsdp)
    res["fsdp"] = _steps(fsdp, batches, world)
    res["probe"] = {"max_gathered": probe.max_gathered, "max_gathered_bytes": probe.max_gathered_bytes,
                    "calls": probe.calls, "inner_sharded": probe.inner_sharded, "dtypes": sorted(probe.dtypes)}
    res["ddp"] = _steps(wrap_model(model(), info), batches, world)
    ckpt = wrap_model(model(ckpt=True), info, fsdp=True)
    probe = UnitProbe(ckpt)
    res["fsdp_ckpt"] = {**_steps(ckpt, batches, world), "calls": probe.calls, "inner_sharded": probe.inner_sharded}
    bf16 = wrap_model(model(), info, fsdp=True, precision="bf16")
    probe = UnitProbe(bf16)
    res["fsdp_bf16"] = {**_steps(bf16, batches, world, "bf16"), "fwd_dtypes": sorted(probe.dtypes)}
    res["ddp_bf16"] = _steps(wrap_model(model(), info), batches, world, "bf16")
    for name, fsdp_on in (("frozen_fsdp", True), ("frozen_ddp", False), ("frozen_fsdp_mlp", True)):  # seed_gpu.yaml's
        m = model()
        m.llm.requires_grad_(False)
        if name.endswith("_mlp"):   # model.llm.checkpoint_scope mlp: the MLPs keep their input only
            checkpoint_mlps(decoder_layers(m.llm))
        m = wrap_model(m, info, fsdp=fsdp_on)
        res[name] = _steps(m, batches, world)
        llm = [p for n, p in m.named_parameters() if ".llm." in f".{n}"]
        res[name].update(n_llm=len(llm), llm_grads=sum(p.grad is not None for p in llm),
                         llm_shards=sum(isinstance(p, DTensor) for p in llm))
    full = _trainer({**env, "dir": env["dir"] / "full"}, info, batches, dataset)
    full.fit()
    res["trainer"] = {"losses": full.losses, "params": _full_state(full.model)}
    torch.save(res, env["dir"] / f"rank{rank}.pt")
    killed = _trainer({**env, "dir": env["dir"] / "killed"}, info, batches, dataset, kill_at=KILL_AT,
                      kill_note=env["dir"] / f"kill_rank{rank}.txt")
    killed.fit()  # SIGKILL inside: never returns


def _resume_worker(rank: int, world: int, port: int, env: dict) -> None:
    from west.checkpoint.integrity import find_latest
    from west.train.distributed import cleanup

    info, batches, dataset = _rank_setup(rank, world, port, env)
    root = env["dir"] / "killed" / "run" / "checkpoints"
    latest = find_latest(root)
    assert latest is not None, f"no usable checkpoint in {root}: {sorted(p.name for p in root.glob('*'))}"
    resumed = _trainer({**env, "dir": env["dir"] / "killed"}, info, batches, dataset)
    summary = resumed.fit()
    torch.save({"latest": latest.name, "summary": summary, "losses": resumed.losses,
                "params": _full_state(resumed.model)}, env["dir"] / f"resumed{rank}.pt")
    cleanup()


@pytest.fixture(scope="module")
def results(tmp_path_factory, corpus):
    from west.models.tiny_llm import build_tiny_llm

    from helpers.corpus import transcript

    d = tmp_path_factory.mktemp("fsdp")
    texts = [transcript(i) for i in range(200)] + ["Transcribe the speech."]
    llm = build_tiny_llm(texts, d / "llm", vocab_size=400, hidden_size=64, intermediate_size=128,
                         num_layers=4, num_heads=4, num_kv_heads=2)
    env = {"llm": str(llm), "list": str(write_lists(corpus["rows"], d / "lists", N_UTTS).jsonl), "dir": d,
           "cfg": model_config(str(llm))}
    with pytest.raises(mp.ProcessExitedException) as killed:
        run_ranks(_worker, env)
    notes = {p.name: p.read_text() for p in d.glob("kill_rank*.txt")}
    assert notes, f"no rank reached its planned SIGKILL, yet one died: {killed.value} (killed by the machine?)"
    ranks = rank_results(d)
    run_ranks(_resume_worker, env)
    resumed = rank_results(d, stem="resumed")
    return {"ranks": ranks, "killed": killed.value, "resumed": resumed, "dir": d}


def _assert_params_close(got: dict, ref: dict, rtol: float, what: str) -> None:
    assert got.keys() == ref.keys() and len(ref) > 50, what
    for k, v in ref.items():
        torch.testing.assert_close(got[k], v, rtol=rtol, atol=rtol * max(v.abs().max().item(), 1e-3),
                                   msg=f"{what}: {k}")


def test_every_block_and_layer_is_a_sharded_unit(results):
    for r in results["ranks"]:
        tree = r["tree"]
        assert r["micro"] >= 1
        assert tree["n_units"] == tree["n_blocks"] + tree["n_layers"] == 8
        assert tree["units_fsdp"] and tree["root_fsdp"]
        assert tree["not_shards"] == []  # every parameter, units' and root's, is a Shard(0) DTensor
        assert tree["mesh_devices"] == ["cpu"]  # though torch's accelerator said cuda while wrapping
        assert tree["local_bytes"] <= 0.6 * tree["full_bytes"]
    t0, t1 = (r["tree"] for r in results["ranks"])
    assert t0["local_bytes"] + t1["local_bytes"] == t0["full_bytes"]  # the shards tile the model
    # The units hold most of the weights, and forward gathers one unit at a time (the root
    # stays gathered through forward): peak gathered bytes = root + one unit, not the model.
    units = sum(t0["unit_bytes"])
    assert units > 0.5 * t0["full_bytes"]
    probe = results["ranks"][0]["probe"]
    assert probe["max_gathered"] == 1
    root = t0["full_bytes"] - units
    assert probe["max_gathered_bytes"] <= root + max(t0["unit_bytes"]) < 0.8 * t0["full_bytes"]


def test_fsdp_steps_equal_ddp_fp32(results):
    for r in results["ranks"]:
        assert r["fsdp"]["losses"] == pytest.approx(r["ddp"]["losses"], rel=1e-5)
        assert r["fsdp"]["losses"][-1] < r["fsdp"]["losses"][0]  # it trains
    r0 = results["ranks"][0]
    _assert_params_close(r0["fsdp"]["params"], r0["ddp"]["params"], 1e-5, "fsdp vs ddp")
    assert r0["probe"]["dtypes"] == ["torch.float32"] and r0["fsdp"]["grad_dtypes"] == ["torch.float32"]


def test_bf16_policy_gathers_bf16_keeps_fp32_master_weights(results):
    for r in results["ranks"]:
        got, ref = r["fsdp_bf16"], r["ddp_bf16"]
        assert got["fwd_dtypes"] == ["torch.bfloat16"]  # units compute with bf16 weights
        for key in ("param_dtypes", "grad_dtypes", "state_dtypes"):  # shards, reduced grads, AdamW
            assert got[key] == ["torch.float32"], key
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-2)  # DDP + autocast bf16
        assert got["losses"] != r["fsdp"]["losses"]  # really computed in bf16


@pytest.mark.parametrize("name", ["frozen_fsdp", "frozen_fsdp_mlp"])
def test_frozen_llm_stays_sharded_and_matches_ddp(results, name):
    """frozen_fsdp_mlp: the same under checkpoint_scope mlp (its backward reads the gathered weights)."""
    for r in results["ranks"]:
        got, ref = r[name], r["frozen_ddp"]
        assert got["n_llm"] > 20 and got["llm_shards"] == got["n_llm"] and got["llm_grads"] == 0
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        assert got["losses"] != r["fsdp"]["losses"]  # the LLM really stayed frozen
    r0 = results["ranks"][0]
    _assert_params_close(r0[name]["params"], r0["frozen_ddp"]["params"], 1e-5, "frozen")


def test_activation_checkpointing_composes_with_fsdp(results):
    for r in results["ranks"]:
        ckpt, plain = r["fsdp_ckpt"], r["fsdp"]
        # every unit ran again in backward (recomputed), with its weights gathered each time
        assert ckpt["calls"] == 2 * r["probe"]["calls"] > 0
        assert ckpt["inner_sharded"] == r["probe"]["inner_sharded"] == 0
        assert ckpt["losses"] == pytest.approx(plain["losses"], rel=1e-6)
    r0 = results["ranks"][0]
    _assert_params_close(r0["fsdp_ckpt"]["params"], r0["fsdp"]["params"], 1e-5, "ckpt vs plain")


def test_kill_9_then_resume_matches_uninterrupted(results):
    assert results["killed"].signal_name == "SIGKILL" or results["killed"].exit_code == -signal.SIGKILL
    for rank, r in enumerate(results["resumed"]):
        full = results["ranks"][rank]["trainer"]
        assert r["latest"] == "step_00000002"
        assert r["summary"]["step"] == TRAIN_STEPS
        assert len(full["losses"]) == TRAIN_STEPS
        assert r["losses"] == full["losses"][2:]  # bit for bit
    full = results["ranks"][0]["trainer"]["params"]
    got = results["resumed"][0]["params"]
    assert got.keys() == full.keys()
    for k, v in full.items():
        assert torch.equal(got[k], v), k
