"""LoRA through the CLI as a user runs it: west-train with --model.lora on the tiny recipe, kill -9,
resume (bit-exact), west-decode from the lean checkpoint (base LLM by path + adapters),
west-export (merged Hugging Face LLM), and the refusals: resuming without model.lora or with
another rank, decoding against other base LLM bytes."""
from __future__ import annotations

import shutil
import subprocess
from types import SimpleNamespace

import pytest
import torch

from helpers.e2e import KILL_HOOK, PYTHON, ROOT, read_jsonl, subprocess_env, tiny_llm, train_argv, write_lists
from helpers.threads import torch_threads

N_UTTS = 9
KILL_AFTER = 3  # the latest checkpoint is step 2
LORA = ["--model.lora", "{r: 8, alpha: 16, target_modules: [q_proj, v_proj]}"]  # dropout 0.05: RNG replayed
RUN = ["--batch_type", "pack", "--pack_tokens", "200", "--max_steps", "5", "--train.save_every", "2", *LORA]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
    """The killed run in a subprocess while the uninterrupted one runs in this process; then the
    resume, in this process too (one intra-op thread everywhere: bit-exact across processes)."""
    from west.bin.train import main

    d = tmp_path_factory.mktemp("lora_e2e")
    llm, lists = tiny_llm(tmp_path_factory), write_lists(corpus["rows"], d / "lists", N_UTTS)
    hook = d / "kill_after.py"
    hook.write_text(KILL_HOOK)
    full, killed = d / "full", d / "killed"
    log = d / "killed.log"
    proc = subprocess.Popen([PYTHON, str(hook), str(KILL_AFTER), *train_argv(llm, lists.jsonl, killed, *RUN)],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, env=subprocess_env(), cwd=ROOT)
    with torch_threads():
        rc_full = main(train_argv(llm, lists.jsonl, full, *RUN))
        rc_killed = proc.wait(timeout=300)
        killed_steps = [x["step"] for x in read_jsonl(killed / "train_log.jsonl")]
        rc_resumed = main(train_argv(llm, lists.jsonl, killed, *RUN))
    return SimpleNamespace(d=d, llm=llm, list=lists.jsonl, full=full, killed=killed, rc=(rc_full, rc_killed, rc_resumed),
                           killed_steps=killed_steps, log=log.read_text(errors="replace"))


def test_lora_kill_9_resume_is_bit_exact_and_checkpoints_are_lean(runs):
    from safetensors.torch import load_file

    assert runs.rc == (0, -9, 0), runs.log
    assert runs.killed_steps == [1, 2, 3]
    a, b = read_jsonl(runs.full / "train_log.jsonl"), read_jsonl(runs.killed / "train_log.jsonl")
    assert [x["step"] for x in b] == [1, 2, 3, 4, 5]  # step 3 logged, killed, replayed from step 2
    assert [x["loss"] for x in b] == [x["loss"] for x in a]
    assert [x["grad_norm"] for x in b] == [x["grad_norm"] for x in a]
    for rel in ("model.safetensors", "adapter/adapter_model.safetensors"):
        x = load_file(runs.full / "checkpoints" / "step_00000005" / rel)
        y = load_file(runs.killed / "checkpoints" / "step_00000005" / rel)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), rel
    ckpt = runs.full / "checkpoints" / "step_00000005"
    assert not any(k.startswith("llm.") for k in load_file(ckpt / "model.safetensors"))
    assert "checkpoint:" in runs.log and "referred to by path" in runs.log


def test_resume_without_lora_or_with_another_rank_is_refused(runs, capsys, tmp_path):
    from west.bin.train import main

    run_dir = tmp_path / "run"  # a copy: west-train writes its config.yaml before it reads the checkpoint
    shutil.copytree(runs.full, run_dir)
    for extra, want in ((["--model.lora", "none"], "this run has no model.lora"),
                        (["--model.lora.r", "4"], "model.lora.r differs")):
        argv = train_argv(runs.llm, runs.list, run_dir, *RUN, "--max_steps", "7", *extra)
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert "trained with LoRA r=8, alpha=16" in err and want in err, err
    # The refused launches replaced DIR/config.yaml; decoding rebuilds the checkpoint's own model.
    from west.infer.load import load_for_decoding

    assert "lora: null" in (run_dir / "config.yaml").read_text() or "r: 4" in (run_dir / "config.yaml").read_text()
    torch.backends.cuda.enable_cudnn_sdp(True)
    model, _, _ = load_for_decoding(str(run_dir), device="cpu")
    assert model.cfg.lora is not None and model.cfg.lora.r == 8
    assert not torch.backends.cuda.cudnn_sdp_enabled()   # decoding keeps cuDNN attention off, as training does
    typo = train_argv(runs.llm, runs.list, tmp_path / "new", *RUN, "--model.lora.target_modules", "[q_proj, vproj]")
    assert main(typo) == 2
    err = capsys.readouterr().err
    assert "model.lora.target_modules: 'vproj' matches no module" in err and "candidates: down_proj" in err, err


def test_decode_lean_checkpoint_then_export_and_decode_the_export(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    from west.bin.decode import main as decode
    from west.bin.export import main as export

    def hyps(ckpt, name):
        out = tmp_path / name / "result.jsonl"
        assert decode(["--checkpoint", str(ckpt), "--data", str(runs.list), "--result", str(out),
                       "--max_new_tokens", "4", "--device", "cpu", "--quiet"]) == 0
        return [r["hyp"] for r in read_jsonl(out)]

    from_ckpt = hyps(runs.full, "ckpt")
    assert len(from_ckpt) == N_UTTS
    assert export(["--checkpoint", str(runs.full), "--out", str(tmp_path / "export")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "export" / "llm")
    assert not any("lora" in n for n in merged.state_dict())
    assert (tmp_path / "export" / "llm" / "tokenizer_config.json").is_file()
    assert hyps(tmp_path / "export", "export") == from_ckpt


def test_decode_against_other_base_llm_bytes_is_refused(runs, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    from west.bin.decode import main as decode

    other = tmp_path / "other_llm"
    shutil.copytree(runs.llm, other)
    w = load_file(other / "model.safetensors")
    name = next(iter(w))
    w[name] = w[name] + 1e-3
    save_file(w, str(other / "model.safetensors"), metadata={"format": "pt"})
    rc = decode(["--checkpoint", str(runs.full), "--data", str(runs.list), "--result", str(tmp_path / "r.jsonl"),
                 "--llm_path", str(other), "--device", "cpu", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and str(other.resolve()) in err and str(runs.llm.resolve()) in err and "--llm_path" in err, err


def test_average_lean_lora_checkpoints(runs, tmp_path):
    """tools/average_checkpoints.py on lean LoRA checkpoints: base from model.llm.path, adapters
    averaged like any weight; the result decodes."""
    import sys

    from safetensors.torch import load_file

    sys.path.insert(0, str(ROOT / "tools"))
    import average_checkpoints as avg

    from west.checkpoint.pretrained import load_speech_llm

    record = avg.average_checkpoints(runs.full, tmp_path / "avg", 2, mode="last")
    assert record["steps"] == [4, 5]
    ckpts = [load_file(runs.full / "checkpoints" / f"step_0000000{s}" / "adapter" / "adapter_model.safetensors")
             for s in (4, 5)]
    model = load_speech_llm(tmp_path / "avg")
    mine = {k: v for k, v in model.llm.state_dict().items() if "lora_A" in k}
    key = next(k for k in ckpts[0] if "layers.0.self_attn.q_proj.lora_A" in k)
    got = next(v for k, v in mine.items() if "layers.0.self_attn.q_proj.lora_A" in k)
    want = ((ckpts[0][key].double() + ckpts[1][key].double()) / 2).float()
    assert torch.equal(got, want)
