"""train.compile: the compiled blocks compute what eager does, and pack rows of new lengths do
not recompile once dynamo has marked the sizes dynamic (inductor on the CPU)."""
import copy

import pytest
import torch

from west.models.speech_llm import SpeechLLM
from west.train.compile import compilations, compile_regions

from helpers.speech import make_sample, packed_batch, padded_batch, tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _batches():
    g = torch.Generator().manual_seed(3)

    def sample(frames, answer):
        feats = torch.randn(frames, 80, generator=g)
        return make_sample([("text", [5, 6]), ("speech", feats), ("answer", list(range(7, 7 + answer)))])

    out = []
    sizes = [[(60, 3), (90, 5)], [(44, 2), (130, 4), (70, 6)], [(100, 3)], "padded", [(52, 5), (61, 2), (75, 3), (88, 4)],
             [(47, 2), (66, 3), (99, 5), (58, 2), (71, 4)], [(83, 6), (120, 2)]]
    for i, utts in enumerate(sizes):
        if utts == "padded":
            out.append(padded_batch([sample(80, 4), sample(57, 2)]))
            continue
        ss = [sample(f, a) for f, a in utts]
        out.append(packed_batch(ss, sum(len(s.ids) for s in ss) + 3 + i))
    return out


def _run(model, batches):
    losses, grads = [], []
    for b in batches:
        model.zero_grad(set_to_none=True)
        out = model(b)
        out["loss_sum"].backward()
        losses.append(float(out["loss_sum"].detach()))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    return losses, grads


def test_compiled_blocks_match_eager_and_stop_recompiling():
    torch.manual_seed(0)
    eager = SpeechLLM(tiny_config()).eval()
    compiled = copy.deepcopy(eager)
    assert compile_regions(compiled) == len(eager.encoder.blocks) + len(eager.llm.model.layers)
    assert list(compiled.state_dict()) == list(eager.state_dict())   # checkpoints see the same names
    batches = _batches()
    want_loss, want_grads = _run(eager, batches)
    before = compilations()
    got_loss, got_grads = _run(compiled, batches[:5])     # packs of 1-4 utterances and a padded batch
    warmed = compilations()
    more_loss, more_grads = _run(compiled, batches[5:])   # packs of new lengths and utterance counts
    assert warmed > before                                # it did compile
    assert compilations() == warmed, "a pack row of new lengths recompiled"
    for want, got in zip(want_loss, got_loss + more_loss):
        assert abs(want - got) <= 1e-4 * abs(want)
    for want, got in zip(want_grads, got_grads + more_grads):
        assert want.keys() == got.keys()
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=1e-3, atol=1e-5, msg=n)
