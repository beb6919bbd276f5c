"""west-train always ends: Ctrl-C (SIGINT) or an uncaught exception with DataLoader workers
(whose preemption shield ignores SIGTERM) exits within seconds, on 1 rank and on 2 (torchrun).

Each run is a subprocess of the tiny CPU recipe config with ``data.num_workers`` 1 or 2 and a
hook that, right after step 2 is logged, prints the time and sends SIGINT to its own process or
raises. The bound is on the time from that moment to the end of the whole command (Python's
exit handler waits for the loader workers: once they ignored its SIGTERM, it waited forever).
"""
from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from helpers.e2e import PYTHON, ROOT, subprocess_env, tiny_llm, train_argv, write_lists

BOUND_S = 30.0  # from the interrupt to the command's end; the shield made it unbounded

HOOK = """
import os, signal, sys, time
from west.train import metrics
MODE, RANK = sys.argv[1], int(sys.argv[2])
_log_step = metrics.MetricsLogger.log_step
def log_step(self, rec):
    _log_step(self, rec)
    if rec["step"] == 2 and int(os.environ.get("RANK", "0")) == RANK:  # every rank calls it
        print(f"INTERRUPT AT {time.time()}", flush=True)
        if MODE == "sigint":
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        raise RuntimeError("injected failure")
metrics.MetricsLogger.log_step = log_step
from west.bin.train import main
sys.exit(main(sys.argv[3:]))
"""

CASES = {  # name: (ranks, mode, rank interrupted, num_workers)
    "1 rank, SIGINT, 1 worker": (1, "sigint", 0, 1),
    "1 rank, exception, 2 workers": (1, "raise", 0, 2),
    "2 ranks, SIGINT to rank 1, 2 workers": (2, "sigint", 1, 2),
    "2 ranks, exception on rank 0, 1 worker": (2, "raise", 0, 1),
}


@pytest.fixture(scope="module")
def ended(tmp_path_factory, corpus):
    """Every case side by side: {name: (exit status, seconds from the interrupt to the end, log)}."""
    d = tmp_path_factory.mktemp("exits")
    lists = write_lists(corpus["rows"], d / "lists", 13)
    llm = tiny_llm(tmp_path_factory)
    hook = d / "hook.py"
    hook.write_text(HOOK)
    procs = {}
    for i, (name, (ranks, mode, rank, workers)) in enumerate(CASES.items()):
        argv = train_argv(llm, lists.jsonl, d / f"run{i}", "--batch_type", "static", "--batch_size", "2",
                          "--max_steps", "50", "--data.num_workers", str(workers))
        launch = [PYTHON] if ranks == 1 else [PYTHON, "-m", "torch.distributed.run", "--standalone",
                                              "--nproc_per_node", "2"]
        log = d / f"run{i}.log"
        procs[name] = (subprocess.Popen([*launch, str(hook), mode, str(rank), *argv], stdout=open(log, "w"),
                                        stderr=subprocess.STDOUT, env=subprocess_env(), cwd=ROOT,
                                        start_new_session=True), log)
    out, deadline = {}, time.time() + 300
    while procs:
        for name, (p, log) in list(procs.items()):
            text = log.read_text(errors="replace")
            started = [float(line.split()[-1]) for line in text.splitlines() if line.startswith("INTERRUPT AT")]
            late = started and time.time() - started[0] > BOUND_S + 10
            if p.poll() is not None or late or time.time() > deadline:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)  # hung (torchrun's ranks too): recorded as such
                rc = p.wait()
                out[name] = (rc, time.time() - started[0] if started else None, log.read_text(errors="replace"))
                del procs[name]
        time.sleep(0.2)
    return out


@pytest.mark.parametrize("name", CASES)
def test_interrupted_runs_with_loader_workers_exit_promptly(ended, name):
    rc, seconds, log = ended[name]
    assert seconds is not None, f"never reached step 2:\n{log[-3000:]}"
    assert seconds < BOUND_S, f"still running {seconds:.0f} s after the interrupt:\n{log[-3000:]}"
    assert rc != 0
    assert ("KeyboardInterrupt" if CASES[name][1] == "sigint" else "injected failure") in log


def test_a_run_whose_every_utterance_is_skipped_is_an_error(tmp_path_factory, corpus, capsys):
    """Every wav unreadable: the planned batches become dummies and used to end "done" with status 0."""
    from west.bin.train import main

    from helpers.corpus import write_jsonl
    from helpers.threads import torch_threads

    d = tmp_path_factory.mktemp("all_bad")
    rows = []
    for r in corpus["rows"][:4]:
        bad = d / f"{r['key']}.wav"
        bad.write_bytes(b"RIFF\x24\x00\x00\x00WAVEfmt " + b"\x07" * 40)  # a header that cannot be decoded
        rows.append({**r, "wav": str(bad)})
    data = write_jsonl(d / "bad.list", rows)
    with torch_threads():
        rc = main(train_argv(tiny_llm(tmp_path_factory), data, d / "out", "--batch_type", "static",
                             "--batch_size", "2", "--train.max_epochs", "1"))
    err = capsys.readouterr().err
    assert rc == 2
    assert "epoch 0: every utterance of run.train_data was skipped (corrupt_audio 4): nothing was trained" in err
