"""tools/qwen2_audio_padding.py: the packed-vs-30 s difference sits on the utterance's last frame
(its convolutions see the padding) and the FLOP table comes from the tower arithmetic."""
from __future__ import annotations

import json

import pytest

from helpers.e2e import import_tool

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_padding_tool_tables(tmp_path, capsys):
    tool = import_tool("qwen2_audio_padding")
    assert tool.main(["--out", str(tmp_path / "pad.json")]) == 0
    out = json.loads((tmp_path / "pad.json").read_text())
    even = [r for r in out["difference"] if r["tower_frames"] * 4 == r["mel_frames"]]   # an even conv frame count
    assert even and all(r["last_frame_rel"] > 10 * r["max_other_frame_rel"] for r in even)
    assert all(r["cosine"] > 0.99 for r in out["difference"])
    savings = [r["saving"] for r in out["flops_qwen2_audio_7b"]]
    assert savings == sorted(savings, reverse=True) and savings[-1] < 0.1 < 0.8 < savings[2]
    assert "87 % removed" in capsys.readouterr().out
