"""west.lab.stack_samples and tools/stack_summary.py on py-spy's raw format (lines written as
py-spy 0.4 writes them with --native --threads; py-spy itself is not needed here)."""
import json

import pytest

from west.lab.stack_samples import library, parse_raw, summarize, table

from helpers.e2e import import_tool

STEP = "main (profile_step.py:177);PassRunner.step (west/bench/runner.py:50);train_step (west/train/step.py:221)"
RAW = "\n".join([
    # the model's build: outside any step, left out
    "thread (24388): MainThread;0x7fc99784524a (libc.so.6);<module> (profile_step.py:41);"
    "_find_and_load (<frozen importlib._bootstrap>:1176) 40",
    # forward: a Linear through autocast down to the driver's launch
    f"thread (24388): MainThread;{STEP};queue_step (west/train/step.py:174);"
    "SpeechLLM.forward (west/models/speech_llm.py:232);at::autocast::WrapFunction_<...>::call (libtorch_cpu.so);"
    "cudaLaunchKernel (libcudart.so.12);0x7f00aa (libcuda.so.1) 6",
    f"thread (24388): MainThread;{STEP};queue_step (west/train/step.py:175);"
    "SpeechLLM.forward (west/models/speech_llm.py:240);Qwen2Model.forward (transformers/models/qwen2/modeling_qwen2.py:380);"
    "_PyEval_EvalFrameDefault (libpython3.12.so.1.0) 4",
    # backward, run on the launching thread
    f"thread (24388): MainThread;{STEP};queue_step (west/train/step.py:175);Tensor.backward (torch/_tensor.py:623);"
    "torch::autograd::Engine::execute (libtorch_cpu.so);malloc (libc.so.6) 8",
    f"thread (24388): MainThread;{STEP};take_gil (libpython3.12.so.1.0) 2",
    "thread (24393): tqdm_monitor;Thread.run (threading.py:1012) 3",
])


def test_parse_keeps_threads_frames_and_counts_and_refuses_other_text():
    stacks = parse_raw(RAW + "\n\n")
    assert len(stacks) == 6 and stacks[0].thread == "thread (24388): MainThread"
    assert stacks[1].frames[-1] == "0x7f00aa (libcuda.so.1)" and stacks[1].count == 6
    assert parse_raw("a (x.py:1);b (libc.so.6) 3")[0].thread == ""   # no --threads: no thread frame
    with pytest.raises(ValueError, match="line 2"):
        parse_raw("a (x.py:1) 3\nnot a stack")
    assert [library(f) for f in ("f (west/x.py:3)", "g (<frozen os>:1)", "0x1 (libcuda.so.1)", "h (?)", "bare")] == [
        "python", "python", "libcuda", "?", "?"]


def test_summary_in_milliseconds_per_step_of_the_samples_inside_train_step():
    res = summarize(parse_raw(RAW), rate_hz=100.0, steps=2)
    # a sample at 100 Hz is 10 ms, over 2 steps 5 ms per step: the steps' 20 samples are 100 ms per step
    assert res["samples"] == 20 and res["samples_outside_steps"] == 43 and res["ms_per_step"] == pytest.approx(100.0)
    assert dict(res["by_library"]) == pytest.approx({"libcuda": 30.0, "libpython3.12": 30.0, "libc": 40.0})
    parts = dict(res["categories"])
    assert parts["CUDA driver and runtime (launches, copies, events)"] == pytest.approx(30.0)
    assert parts["autocast's casts"] == pytest.approx(30.0)
    assert parts["autograd engine (backward)"] == pytest.approx(40.0)
    assert parts["waiting for the GIL"] == pytest.approx(10.0) and parts["garbage collector"] == 0
    funcs = dict(res["python"])   # by function, lines merged; frames in every sample (train_step) dropped
    assert funcs["SpeechLLM.forward (west/models/speech_llm.py)"] == pytest.approx(50.0)
    assert funcs["Qwen2Model.forward (transformers/models/qwen2/modeling_qwen2.py)"] == pytest.approx(20.0)
    assert funcs["queue_step (west/train/step.py)"] == pytest.approx(90.0)   # not in the GIL sample
    assert "train_step (west/train/step.py)" not in funcs and "PassRunner.step (west/bench/runner.py)" not in funcs
    text = table(res)
    assert text.startswith("20 samples in 2 steps at 100 Hz: 100.0 ms per step")
    assert "| `libc` | 40.0 | 40 % |" in text and "| `autograd engine (backward)` | 40.0 | 40 % |" in text
    with pytest.raises(ValueError, match="positive"):
        summarize(parse_raw(RAW), rate_hz=0, steps=2)


def test_stack_summary_cli_writes_json_and_says_when_no_step_was_sampled(tmp_path, capsys):
    stack_summary = import_tool("stack_summary")
    raw = tmp_path / "stacks.txt"
    raw.write_text(RAW, encoding="utf-8")
    assert stack_summary.main([str(raw), "--rate", "100", "--steps", "2", "--out", str(tmp_path / "s.json")]) == 0
    assert json.loads((tmp_path / "s.json").read_text(encoding="utf-8"))["ms_per_step"] == pytest.approx(100.0)
    assert "| library (own time) |" in capsys.readouterr().out
    raw.write_text(RAW.splitlines()[0], encoding="utf-8")
    assert stack_summary.main([str(raw), "--rate", "100", "--steps", "2"]) == 1
    assert "no sample inside train_step" in capsys.readouterr().out


def test_late_readback_steps_count_and_a_focus_splits_a_function_by_callee_and_leaf():
    late = "main (train.py:1);Trainer.fit (west/train/loop.py:263);queue_train_step (west/train/late_readback.py:80)"
    proj = f"{late};queue_step (west/train/step.py:174);Projector.forward (west/models/projector.py:66)"
    raw = "\n".join([
        f"thread (1): MainThread;{proj};group_frames (west/models/projector.py:46);to_device (west/batch.py:128);"
        "cudaHostAlloc (libcudart.so.12);0x7f01 (libcuda.so.1) 6",
        f"thread (1): MainThread;{proj};group_frames (west/models/projector.py:46);take_gil (libpython3.12.so.1.0) 3",
        f"thread (1): MainThread;{proj};Module._call_impl (torch/nn/modules/module.py:1775);"
        "cudaLaunchKernel (libcudart.so.12) 1",
        f"thread (1): MainThread;{proj} 2",
        f"thread (1): MainThread;{late};SpeechLLM._embed (west/models/speech_llm.py:170) 8",
    ])
    res = summarize(parse_raw(raw), rate_hz=100.0, steps=1, focus=("Projector.forward", "Missing.fn"))
    assert res["samples"] == 20   # queue_train_step's samples are the step's
    f = res["focus"]["Projector.forward"]
    assert f["ms_per_step"] == pytest.approx(120.0)
    assert dict(f["callees"]) == pytest.approx({"group_frames (west/models/projector.py)": 90.0,
                                                "Module._call_impl (torch/nn/modules/module.py)": 10.0, "(own)": 20.0})
    assert dict(f["leaves"]) == pytest.approx({"0x7f01 (libcuda.so.1)": 60.0, "take_gil (libpython3.12.so.1.0)": 30.0,
                                               "cudaLaunchKernel (libcudart.so.12)": 10.0,
                                               "Projector.forward (west/models/projector.py:66)": 20.0})
    assert res["focus"]["Missing.fn"]["ms_per_step"] == 0
    text = table(res)
    assert "`Projector.forward`: 120.0 ms per step" in text
    assert "| `group_frames (west/models/projector.py)` | 90.0 | 75 % |" not in text   # shares are of the step
    assert "| `group_frames (west/models/projector.py)` | 90.0 | 45 % |" in text


def test_threads_busy_time_leaves_out_waits_for_work_but_not_waits_for_a_lock():
    pin = "thread (7): pin_memory;Thread.run (threading.py:1012);_pin_memory_loop (torch/utils/data/_utils/pin_memory.py:55)"
    nvml = "thread (9): nvml-sampler;Thread.run (threading.py:1012);NvmlSampler._run (west/train/gpu_monitor.py:115)"
    raw = "\n".join([
        f"{pin};Queue.get (multiprocessing/queues.py:113);__GI___poll (libc.so.6) 50",           # waiting for a batch
        f"{pin};_rebuild_tensor (torch/multiprocessing/reductions.py:40);memcpy (libc.so.6) 20",  # unpickling: busy
        f"{pin};Tensor.pin_memory (torch/_tensor.py:1);take_gil (libpython3.12.so.1.0);"
        "__futex_abstimed_wait_common64 (libc.so.6) 5",                                          # the GIL: contention
        f"{nvml};Event.wait (threading.py:629);PyThread_acquire_lock_timed (libpython3.12.so.1.0);"
        "sem_clockwait (libc.so.6) 70",                                                          # its interval: idle
        f"{nvml};NvmlSampler.sample (west/train/gpu_monitor.py:100);nvmlDeviceGetProcessUtilization "
        "(libnvidia-ml.so.1);ioctl (libc.so.6) 4",
        "thread (1): MainThread;main (train.py:1);readline (io.py:3) 2",                         # a Python leaf: busy
    ])
    rows = {r["thread"]: r for r in summarize(parse_raw(raw), rate_hz=10.0, steps=1)["threads"]}
    pin_row, nvml_row = rows["thread (7): pin_memory"], rows["thread (9): nvml-sampler"]
    assert pin_row["sampled_s"] == pytest.approx(7.5) and pin_row["busy_s"] == pytest.approx(2.5)
    assert dict(pin_row["busy_in"]) == pytest.approx({"memcpy (libc.so.6)": 2.0,
                                                      "__futex_abstimed_wait_common64 (libc.so.6)": 0.5})
    assert nvml_row["busy_s"] == pytest.approx(0.4) and nvml_row["busy_in"][0][0] == "ioctl (libc.so.6)"
    assert rows["thread (1): MainThread"]["busy_s"] == pytest.approx(0.2)
    res = summarize(parse_raw(raw + "\n" + RAW), rate_hz=10.0, steps=1)
    assert [r["thread"] for r in res["threads"]][0] == "thread (24388): MainThread"   # busiest first
    assert "| `thread (7): pin_memory` | 2.5 | 7.5 | `memcpy (libc.so.6)` 2.0 s;" in table(res)


def test_a_stripped_libc_leaf_is_read_through_to_the_wait_above_it():
    from west.lab.stack_samples import idle
    wait = ("Event.wait (threading.py:629)", "PyThread_acquire_lock_timed (libpython3.11.so.1.0)",
            "0x7f04ca2ae116 (libc.so.6)", "0x7f04ca2a3f16 (libc.so.6)")
    assert idle(wait) and not idle(("0x7f04ca2a3f16 (libc.so.6)",)) and not idle(())
    assert not idle(("take_gil (libpython3.12.so.1.0)", "0x7f04ca2a3f16 (libc.so.6)"))
    assert not idle(("at::native::index_select_out_cpu_ (libtorch_cpu.so)",))   # "select" inside a name: work
