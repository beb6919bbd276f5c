"""west's packing inside transformers.Trainer: one packed step equals the unpacked step (loss and
gradients), several steps with gradient accumulation follow the same losses, and no sample sees
another (tiny random Qwen2 and Llama built from their configs; nothing downloaded)."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader
from transformers import Trainer

from west.hf import PackedBatchSampler, PackedTrainer
from west.packing import pack_sequences

from helpers.hf import PAD, VOCAB, Tokenized, args, model_for, pad_collate, weights

pytestmark = pytest.mark.usefixtures("one_torch_thread")

class GroupedPaddedTrainer(Trainer):
    """The unpacked reference: the same groups of samples per micro-batch as the packed run, padded."""

    def __init__(self, *args, pack_length: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.pack_length = pack_length

    def get_train_dataloader(self) -> DataLoader:
        lengths = [len(x["input_ids"]) for x in self.train_dataset.items]
        sampler = PackedBatchSampler(lengths, self.pack_length, seed=self.args.seed)
        return DataLoader(self.train_dataset, batch_sampler=sampler, collate_fn=pad_collate)


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_one_packed_step_equals_the_unpacked_step(kind, tmp_path):
    data = Tokenized(12)
    total = sum(len(x["input_ids"]) for x in data.items)
    start = weights(model_for(kind, packed=False))

    ref_model = model_for(kind, packed=False)
    ref = Trainer(model=ref_model, args=args(tmp_path / "ref", max_steps=1, per_device_train_batch_size=12),
                  train_dataset=data, data_collator=pad_collate)
    ref.train()
    packed_model = model_for(kind, packed=True)
    got = PackedTrainer(model=packed_model, args=args(tmp_path / "packed", max_steps=1), train_dataset=data,
                        pack_length=total, pad_token_id=PAD)   # one row holds all 12 samples
    got.train()
    assert len(got.packed_sampler) == 1
    assert got.state.log_history[0]["loss"] == pytest.approx(ref.state.log_history[0]["loss"], rel=1e-5)
    for name, w0 in start.items():   # SGD with lr 1: the update is the gradient
        g_ref = w0 - dict(ref_model.named_parameters())[name].detach()
        g_packed = w0 - dict(packed_model.named_parameters())[name].detach()
        assert torch.allclose(g_packed, g_ref, rtol=1e-4, atol=1e-6), name


def test_steps_with_accumulation_follow_the_unpacked_losses(tmp_path):
    data = Tokenized(40, seed=1)
    kw = dict(max_steps=4, gradient_accumulation_steps=2, learning_rate=0.05)
    ref = GroupedPaddedTrainer(model=model_for("qwen2", packed=False), args=args(tmp_path / "ref", **kw),
                               train_dataset=data, pack_length=96)
    ref.train()
    got = PackedTrainer(model=model_for("qwen2", packed=True), args=args(tmp_path / "packed", **kw),
                        train_dataset=data, pack_length=96, pad_token_id=PAD)
    got.train()
    ref_losses = [h["loss"] for h in ref.state.log_history if "loss" in h]
    got_losses = [h["loss"] for h in got.state.log_history if "loss" in h]
    assert len(got_losses) == 4 and got_losses == pytest.approx(ref_losses, rel=1e-4)


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_no_sample_sees_another(kind):
    model = model_for(kind, packed=True).eval()
    seqs = [x["input_ids"] for x in Tokenized(3, seed=2).items]
    packed = pack_sequences(seqs, max_length=sum(map(len, seqs)), pad_token_id=PAD)
    changed = [list(s) for s in seqs]
    changed[1] = [(t % (VOCAB - 1)) + 1 for t in reversed(changed[1])]
    packed2 = pack_sequences(changed, max_length=sum(map(len, seqs)), pad_token_id=PAD)
    with torch.no_grad():
        a = model(**packed.model_inputs()).logits[0]
        b = model(**packed2.model_inputs()).logits[0]
        alone = {i: model(input_ids=torch.tensor([seqs[i]])).logits[0] for i in range(3)}
    for i, start, end in packed.boundaries[0]:
        assert torch.allclose(a[start:end], alone[i], atol=1e-5), f"sample {i} differs from its own run"
        if i != 1:
            assert torch.equal(a[start:end], b[start:end]), f"sample {i} saw sample 1"
    i1 = next((s, e) for i, s, e in packed.boundaries[0] if i == 1)
    assert not torch.equal(a[slice(*i1)], b[slice(*i1)])


def test_trl_sft_trainer_with_the_mixin_equals_the_unpacked_step(tmp_path):
    """TRL's SFTTrainer through the same PackingMixin (skipped where TRL is not installed)."""
    pytest.importorskip("trl")
    from datasets import Dataset as HFDataset
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    from west.hf import PackingMixin

    class PackedSFTTrainer(PackingMixin, SFTTrainer):
        pass

    data = Tokenized(12)
    total = sum(len(x["input_ids"]) for x in data.items)
    start = weights(model_for("qwen2", packed=False))
    ref_model = model_for("qwen2", packed=False)
    ref = Trainer(model=ref_model, args=args(tmp_path / "ref", max_steps=1, per_device_train_batch_size=12),
                  train_dataset=data, data_collator=pad_collate)
    ref.train()
    vocab = {str(i): i for i in range(VOCAB)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="63")),
                                  pad_token=str(PAD), eos_token="1")
    sft_args = {k: v for k, v in args(tmp_path / "sft", max_steps=1).to_dict().items()
                if k in {"output_dir", "learning_rate", "optim", "lr_scheduler_type", "weight_decay", "max_grad_norm",
                         "report_to", "save_strategy", "logging_steps", "use_cpu", "seed", "remove_unused_columns",
                         "disable_tqdm", "max_steps"}}
    model = model_for("qwen2", packed=True)
    sft = PackedSFTTrainer(model=model, args=SFTConfig(**sft_args, packing=False, max_length=None, bf16=False),
                           train_dataset=HFDataset.from_list(data.items), processing_class=tok,
                           pack_length=total, pad_token_id=PAD)
    sft.train()
    assert sft.state.log_history[0]["loss"] == pytest.approx(ref.state.log_history[0]["loss"], rel=1e-5)
    for name, w0 in start.items():
        g_ref = w0 - dict(ref_model.named_parameters())[name].detach()
        assert torch.allclose(w0 - dict(model.named_parameters())[name].detach(), g_ref, rtol=1e-4, atol=1e-6), name
