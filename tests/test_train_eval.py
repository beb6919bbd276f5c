"""Dev evaluation during training and the best checkpoints (west.train.evaluate, west.checkpoint.training).

Checked: the dev loss is the training objective summed over the whole dev list (equal to
an offline sum of model(batch) per utterance) and greedy CER equals west-decode's on the
same utterances; evaluation leaves the training losses bit-identical (CPU, dropout on,
eval_every 2 with decoding); evaluation steps are never repeated and epochs.jsonl carries
the epoch-end figures; keep_best survives kill -9 and resume (ranked from meta.json on
disk); 2 gloo ranks (DDP and FSDP2, one rank decoding nothing) give the 1-rank figures;
a missing / empty dev list and cv_cer without decoding fail naming the key; the epoch
and final lines are sentences.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from west.train.distributed import DistInfo

from helpers.corpus import write_jsonl
from helpers.e2e import read_jsonl, tiny_llm, train_argv
from helpers.fakes import ListData, TokenModel, dummy_batch, make_batches
from helpers.ranks import init_gloo, rank_results, run_child, run_ranks

DEV = slice(12, 19)   # 7 dev utterances (odd: 2 ranks cannot split them evenly), then one bad line
N_DECODE = 3
MAX_NEW = 6


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny shapes; the same arithmetic in every process


@pytest.fixture(scope="module")
def env(tmp_path_factory, corpus):
    d = tmp_path_factory.mktemp("eval")
    rows = corpus["rows"]
    bad = {"key": "gone", "wav": str(d / "missing.wav"), "txt": "hello", "duration": 1.0}
    return SimpleNamespace(
        dir=d, llm=tiny_llm(tmp_path_factory), rows=rows[DEV],
        train=write_jsonl(d / "train.list", rows[:8]), dev=write_jsonl(d / "dev.list", [*rows[DEV], bad]),
        first=write_jsonl(d / "first.list", rows[DEV][:N_DECODE]))


def config(env, out: Path, *extra: str):
    from west.bin.train import parse_train_args

    return parse_train_args(train_argv(env.llm, env.train, out, "--cv_data", str(env.dev), "--pack_tokens", "200",
                                       "--model.encoder.dropout", "0.1", "--train.eval_max_new_tokens",
                                       str(MAX_NEW), *extra))


def evaluate_once(cfg, info: DistInfo, fsdp: bool = False) -> dict:
    """A fresh model (the run's seed), wrapped like a run wraps it, evaluated once."""
    from west.models.llm import load_tokenizer
    from west.train.build import build_model
    from west.train.distributed import wrap_model
    from west.train.evaluate import build_evaluator

    tok = load_tokenizer(cfg.model.llm.path)
    model = wrap_model(build_model(cfg.model, cfg.train.seed), info, fsdp=fsdp).train()
    return build_evaluator(cfg, tok, cfg.model.speech_shape(), info).evaluate(model)


# ----------------------------------------------------------------------------- one process

@pytest.fixture(scope="module")
def one_rank(env):
    from west.models.llm import load_tokenizer
    from west.train.build import build_model
    from west.train.evaluate import build_evaluator

    cfg = config(env, env.dir / "one", "--train.eval_decode_utts", str(N_DECODE))
    tok = load_tokenizer(cfg.model.llm.path)
    model = build_model(cfg.model, cfg.train.seed).train()
    ev = build_evaluator(cfg, tok, cfg.model.speech_shape(), DistInfo())
    rng = torch.get_rng_state()
    recs = [ev.evaluate(model), ev.evaluate(model)]
    state = {"training": model.training, "rng_kept": torch.equal(torch.get_rng_state(), rng)}
    one = evaluate_once(config(env, env.dir / "one1", "--train.eval_decode_utts", "1"), DistInfo())
    return SimpleNamespace(cfg=cfg, tok=tok, model=model, rec=recs[0], again=recs[1], one=one, **state)


def test_dev_loss_equals_offline_per_utterance_sum(env, one_rank):
    from west.data.dataset import build_dataloader

    r, cfg = one_rank, one_rank.cfg
    conf = dataclasses.replace(cfg.data, batch_type="static", batch_size=1)
    loader, _ = build_dataloader(str(env.dev), r.tok, conf, cfg.model.speech_shape(), training=False)
    loss = ce = 0.0
    tokens = correct = utts = 0
    r.model.eval()
    with torch.no_grad():
        for batch in loader:   # one utterance per batch, model in eval mode: the offline reference
            out = r.model(batch)
            loss += float(out["loss_sum"].double())
            ce += float(out["ce_sum"].double())
            tokens += out["n_tokens"]
            correct += out["n_correct"]
            utts += len(batch.keys)
    r.model.train()
    rec = r.rec
    assert utts == len(env.rows) == rec["cv_utts"] and rec["cv_tokens"] == tokens > 0
    assert rec["cv_loss"] == pytest.approx(loss / tokens, rel=1e-5)
    assert rec["cv_ce"] == pytest.approx(ce / tokens, rel=1e-5)   # tiny_cpu.yaml trains a CTC head too
    assert rec["cv_acc"] == correct / tokens
    assert rec["cv_skipped_inputs"] == {"missing_file": 1}         # the bad line, counted like training data
    assert r.training and r.rng_kept                               # train() again, global RNG untouched
    assert {k: v for k, v in r.again.items() if k != "eval_s"} == {k: v for k, v in rec.items() if k != "eval_s"}


def test_dev_cer_equals_west_decode(env, one_rank, tmp_path):
    from west.infer.decode import decode_list
    from west.infer.scoring import detect_mode, error_rate

    r = one_rank
    r.model.eval()
    decode_list(r.model, r.tok, r.cfg.data, str(env.first), str(tmp_path / "hyp.jsonl"), batch_size=16,
                max_new_tokens=MAX_NEW, progress=False)
    r.model.train()
    rows = read_jsonl(tmp_path / "hyp.jsonl")
    refs, hyps = {x["key"]: x["ref"] for x in rows}, {x["key"]: x["hyp"] for x in rows}
    cer = error_rate(refs, hyps, "cer")
    assert r.rec["cv_decoded_utts"] == N_DECODE == len(rows)
    assert r.rec["cv_cer"] == cer.errors / cer.ref_tokens
    assert ("cv_wer" in r.rec) == (detect_mode(refs) == "wer")
    first = error_rate({k: refs[k] for k in list(refs)[:1]}, hyps, "cer")
    assert r.one["cv_decoded_utts"] == 1 and r.one["cv_cer"] == first.errors / first.ref_tokens


# ----------------------------------------------------------------------------- west-train runs

@pytest.fixture(scope="module")
def runs(env):
    """The same 5 steps with and without dev evaluation (eval_every 2, decoding, keep_best 1)."""
    from west.bin.train import main

    base = ["--pack_tokens", "200", "--max_steps", "5", "--model.encoder.dropout", "0.1"]
    with_eval = ["--cv_data", str(env.dev), "--train.eval_every", "2", "--train.eval_decode_utts", "2",
                 "--train.eval_max_new_tokens", "4", "--train.keep_best", "1", "--train.keep_last", "1"]
    out = {}
    for name, extra in (("plain", []), ("eval", with_eval)):
        d = env.dir / f"run_{name}"
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert main(train_argv(env.llm, env.train, d, *base, *extra)) == 0
        out[name], out[f"{name}_stdout"] = d, printed.getvalue()
    return out


def test_training_losses_bit_identical_with_and_without_eval(runs):
    from safetensors.torch import load_file

    plain = read_jsonl(runs["plain"] / "train_log.jsonl")
    steps = [x for x in read_jsonl(runs["eval"] / "train_log.jsonl") if "event" not in x]
    assert [x["step"] for x in steps] == [x["step"] for x in plain] == [1, 2, 3, 4, 5]
    assert [x["loss"] for x in steps] == [x["loss"] for x in plain]
    assert [x["grad_norm"] for x in steps] == [x["grad_norm"] for x in plain]
    a = load_file(runs["plain"] / "checkpoints" / "step_00000005" / "model.safetensors")
    b = load_file(runs["eval"] / "checkpoints" / "step_00000005" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_eval_steps_logs_and_best_checkpoint(runs):
    d = runs["eval"]
    evals = [x for x in read_jsonl(d / "train_log.jsonl") if x.get("event") == "eval"]
    epochs = read_jsonl(d / "epochs.jsonl")
    ends, total = [], 0
    for e in epochs:
        total += e["steps"]
        ends.append(total)
    want = sorted({2, 4, 5, *ends})   # eval_every, every epoch end, the last step; each once
    assert [x["step"] for x in evals] == want
    for x in evals:
        assert {"epoch", "cv_loss", "cv_acc", "cv_tokens", "cv_utts", "cv_ce", "cv_cer", "cv_decoded_utts",
                "eval_s"} <= set(x) and x["cv_utts"] == 7 and x["cv_decoded_utts"] == 2
    by_step = {x["step"]: x for x in evals}
    for e, end in zip(epochs, ends):   # the epoch summary carries its epoch-end evaluation
        assert e["cv_loss"] == by_step[end]["cv_loss"] and e["cv_cer"] == by_step[end]["cv_cer"]
    best = min(evals, key=lambda x: (x["cv_loss"], x["step"]))
    kept = sorted(p.name for p in (d / "checkpoints").iterdir())
    assert kept == sorted({f"step_{best['step']:08d}", "step_00000005"})   # keep_last 1 + keep_best 1
    meta = json.loads((d / "checkpoints" / kept[0] / "meta.json").read_text())
    assert meta["eval"]["cv_loss"] == by_step[int(kept[0][5:])]["cv_loss"]
    out = runs["eval_stdout"]
    assert f"best dev loss {best['cv_loss']:.3g}" in out and f"at step {best['step']} (checkpoint " in out
    assert "west-train: done after 5 steps" in out and "; 0 bad steps" in out


# ----------------------------------------------------------------------------- best-k and kill -9

class FakeDev:
    """Fixed dev batches for the fake model (the DevLoss protocol)."""

    def __init__(self) -> None:
        self.batches = make_batches(3, seed=99, prefix="dev")

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)

    def dummy_batch(self):
        return dummy_batch()

    def skipped_counts(self) -> dict:
        return {}


def fake_trainer(out: Path, kill_at: int = -1):
    """Dev loss after every step, best at steps 4 and 6 of 12 (lr 0.1 overshoots): keep_last 1 +
    keep_best 2 keep steps 4, 6 and the newest."""
    from west.train.config import RunConfig, TrainConfig
    from west.train.evaluate import Evaluator
    from west.train.loop import Trainer

    train = TrainConfig(lr=0.1, warmup_steps=0, max_epochs=3, save_every=0, save_at_epoch_end=False, keep_last=1,
                        keep_best=2, eval_every=1, tensorboard=False, progress_bar=False, log_every=1000, seed=1,
                        nvml=False)
    return Trainer(train, RunConfig(output_dir=str(out), train_data="x"), TokenModel(seed=0, dropout=0.2),
                   ListData(make_batches(4), kill_at), DistInfo(),
                   Evaluator(FakeDev(), None, DistInfo()))


def fit_killed(out: Path, kill_at: int, threads: int) -> None:
    """The child's run (module-level: a spawned child imports it), with the parent's thread count."""
    torch.set_num_threads(threads)
    fake_trainer(out, kill_at=kill_at).fit()


def test_best_checkpoints_survive_kill_9_and_resume(tmp_path, capsys):
    full_dir, killed_dir = tmp_path / "full", tmp_path / "killed"
    for d in (full_dir, killed_dir):
        d.mkdir()
    full = fake_trainer(full_dir)
    summary = full.fit()
    evals = [x for x in read_jsonl(full_dir / "train_log.jsonl") if "event" in x]
    assert [x["step"] for x in evals] == list(range(1, 13))
    ranked = sorted(evals, key=lambda x: (x["cv_loss"], x["step"]))
    best2 = sorted(x["step"] for x in ranked[:2])
    assert best2[-1] < 11   # the best ones are not simply the newest: pruning by recency would lose them
    kept = sorted(p.name for p in (full_dir / "checkpoints").iterdir())
    assert kept == [f"step_{s:08d}" for s in (*best2, 12)]
    assert summary["best"]["step"] == ranked[0]["step"] and summary["best"]["checkpoint"]

    # killed while fetching step 7's batch: the latest checkpoint is step 6
    assert run_child(fit_killed, killed_dir, 6, torch.get_num_threads()) == -signal.SIGKILL
    resumed = fake_trainer(killed_dir)
    again = resumed.fit()
    assert sorted(p.name for p in (killed_dir / "checkpoints").iterdir()) == kept
    assert again["best"]["step"] == summary["best"]["step"] and again["best"]["cv_loss"] == summary["best"]["cv_loss"]
    log = read_jsonl(killed_dir / "train_log.jsonl")
    assert [x["cv_loss"] for x in log if "event" in x] == [x["cv_loss"] for x in evals]
    assert resumed.losses == full.losses[6:]
    for step in (*best2, 12):
        meta = json.loads((killed_dir / "checkpoints" / f"step_{step:08d}" / "meta.json").read_text())
        assert meta["eval"]["cv_loss"] == evals[step - 1]["cv_loss"]


def test_prune_ranks_meta_on_disk(tmp_path):
    from west.checkpoint import training as ck

    for step, loss in ((1, 3.0), (2, float("nan")), (3, 1.0), (4, 2.0), (5, 1.0), (6, None), (7, 5.0)):
        d = ck.step_dir(tmp_path, step)
        d.mkdir()
        (d / "meta.json").write_text(json.dumps({"step": step, **({"eval": {"cv_loss": loss}} if loss else {})}))
    assert [p.name[-1] for p in ck.best_checkpoints(tmp_path, 2)] == ["3", "5"]   # ties: the older first
    ck.prune(tmp_path, keep_last=2, keep_best=3)
    assert [p.name[-1] for p in ck.list_checkpoints(tmp_path)] == ["3", "4", "5", "6", "7"]
    ck.prune(tmp_path, keep_last=1)
    assert [p.name[-1] for p in ck.list_checkpoints(tmp_path)] == ["7"]


# ----------------------------------------------------------------------------- two ranks

def _rank_worker(rank: int, world: int, port: int, env: SimpleNamespace) -> None:
    from west.train.distributed import cleanup

    info = init_gloo(rank, world, port)
    out = {"ddp": evaluate_once(config(env, env.dir / "ddp", "--train.eval_decode_utts", str(N_DECODE)), info),
           # one utterance to decode on two ranks: rank 1 feeds generate a dummy prompt (synced_gpus)
           "fsdp": evaluate_once(config(env, env.dir / "fsdp", "--train.eval_decode_utts", "1"), info, fsdp=True)}
    torch.save(out, env.dir / f"eval_rank{rank}.pt")
    cleanup()


@pytest.fixture(scope="module")
def two_ranks(env, one_rank):
    run_ranks(_rank_worker, env)
    return rank_results(env.dir, stem="eval_rank")


@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_two_ranks_give_the_one_rank_figures(two_ranks, one_rank, wrap):
    ref = one_rank.rec if wrap == "ddp" else one_rank.one
    for r in two_ranks:   # reduced: the same figures on both ranks
        got = r[wrap]
        assert got["cv_utts"] == ref["cv_utts"] and got["cv_tokens"] == ref["cv_tokens"]
        assert got["cv_loss"] == pytest.approx(ref["cv_loss"], rel=1e-5)
        assert got["cv_skipped_inputs"] == ref["cv_skipped_inputs"]
        assert got["cv_decoded_utts"] == ref["cv_decoded_utts"]
    if wrap == "fsdp":   # the one utterance decoded alone in both: the same hypothesis
        assert two_ranks[0]["fsdp"]["cv_cer"] == ref["cv_cer"]


# ----------------------------------------------------------------------------- config errors

@pytest.mark.parametrize("case, key, text", [
    ("missing", "run.cv_data", "no such file"),
    ("empty", "run.cv_data", "no usable utterance"),
    ("malformed", "run.cv_data", "malformed_line=2"),
    ("cer_without_decoding", "train.best_metric", "train.eval_decode_utts"),
    ("best_without_dev", "train.keep_best", "--cv_data"),
])
def test_bad_dev_settings_fail_naming_the_key(env, tmp_path, capsys, case, key, text):
    from west.bin.train import main

    dev = {"missing": tmp_path / "none.list", "empty": write_jsonl(tmp_path / "empty.list", []),
           "malformed": write_jsonl(tmp_path / "bad.list", ["{not json", '{"key": 1}'])}.get(case, env.dev)
    extra = {"cer_without_decoding": ["--train.best_metric", "cv_cer"],
             "best_without_dev": ["--train.keep_best", "2"]}.get(case, [])
    argv = train_argv(env.llm, env.train, tmp_path / "out", *extra)
    if case != "best_without_dev":
        argv += ["--cv_data", str(dev)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"west-train: error: {key}:" in err and text in err, err
    assert not (tmp_path / "out").exists()   # before anything was written


def test_dev_list_emptied_by_filters_fails_naming_the_key(env, tmp_path, capsys):
    from west.bin.train import main

    argv = train_argv(env.llm, env.train, tmp_path / "out", "--cv_data", str(env.first), "--pack_tokens", "200",
                      "--data.max_duration", "0.2", "--data.min_duration", "0.0", "--max_steps", "1")
    assert main(argv) == 2
    assert "run.cv_data: no usable utterance" in capsys.readouterr().err


# ----------------------------------------------------------------------------- sentences

def test_epoch_and_final_lines_are_sentences():
    from west.train.metrics import done_sentence, epoch_sentence

    epoch = {"epoch": 2, "steps": 80, "wall_s": 72.4, "loss": 2.3111, "utterances": 1500, "skipped_steps": 0,
             "skipped_inputs": {}, "cv_loss": 2.1012, "cv_cer": 0.0849, "cv_utts": 100, "cv_decoded_utts": 100}
    assert epoch_sentence(epoch) == ("epoch 2: 80 steps in 1.2 min, train loss 2.31 per token, 1,500 utterances; "
                                     "dev loss 2.1, dev CER 8.5 % on 100 utterances; skipped inputs: none")
    summary = {"step": 450, "epoch": 6, "wall_s": 426, "skipped_steps": 0, "failed_saves": 0,
               "best": {"step": 400, "metric": "cv_cer", "cv_cer": 0.082, "cv_loss": 2.05, "checkpoint": "D/s"}}
    assert done_sentence(summary) == ("done after 450 steps (6 epochs, 7.1 min); best dev CER 8.2 % (loss 2.05) "
                                      "at step 400 (checkpoint D/s); 0 bad steps")
    plain = {"step": 3, "epoch": 0, "partial_epoch_steps": 3, "wall_s": 2.0, "skipped_steps": 1,
             "best": None, "checkpoints": "D/checkpoints"}
    assert done_sentence(plain) == ("done after 3 steps (part of the first epoch, 2.0 s); "
                                    "checkpoints in D/checkpoints; 1 bad step")
    assert done_sentence({**plain, "checkpoint": None}) == ("done after 3 steps (part of the first epoch, 2.0 s); "
                                                            "no checkpoint saved; 1 bad step")


def test_bf16_weights_decode_under_autocast(env):
    """FSDP2's bf16 policy hands the forward bf16 weights while features stay fp32: dev decoding
    runs under the run's autocast like the dev loss, so it works (it raised a dtype mismatch)."""
    from west.models.llm import load_tokenizer
    from west.train.build import build_model
    from west.train.evaluate import build_evaluator

    cfg = config(env, env.dir / "bf16", "--train.eval_decode_utts", "1", "--train.precision", "bf16")
    model = build_model(cfg.model, cfg.train.seed).to(torch.bfloat16).train()
    rec = build_evaluator(cfg, load_tokenizer(cfg.model.llm.path), cfg.model.speech_shape(), DistInfo()).evaluate(model)
    assert rec["cv_decoded_utts"] == 1 and math.isfinite(rec["cv_loss"])
