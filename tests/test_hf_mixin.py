"""What PackingMixin and PackedCollator refuse before any data is read (TRL's own packing or
truncation, rows already packed, a streaming dataset, token ids that are not non-negative
integers), what they accept (numpy ids, no pad token), how Trainer counts a packed GPT-2's
tokens, and evaluation on padded batches."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import Trainer

from west.hf import PackedCollator, PackedTrainer, use_packed_attention

from helpers.hf import PAD, Tokenized, args, model_for, pad_collate
from helpers.hf_archs import tiny_model

FEATS = [{"input_ids": [3, 4, 5], "labels": [3, 4, 5]}, {"input_ids": [7, 8], "labels": [-100, 8]}]


def test_numpy_and_torch_ids_give_the_row_python_lists_give():
    want = PackedCollator(PAD)(FEATS)
    for conv in (np.array, lambda x: np.array(x, dtype=np.int32), torch.tensor):
        got = PackedCollator(PAD)([{k: conv(v) for k, v in f.items()} for f in FEATS])
        assert all(torch.equal(got[k], want[k]) for k in ("input_ids", "labels", "position_ids", "cu_seq_lens_q"))


@pytest.mark.parametrize("ids, why", [([1.0, 2.0], "integer"), ([True, False], "integer"), ([3, -1], "negative"),
                                      (["1", "2"], "integer")])
def test_ids_that_are_not_non_negative_integers_are_refused(ids, why):
    with pytest.raises(ValueError, match=why):
        PackedCollator(PAD)([{"input_ids": ids}])


def test_no_pad_token_is_needed_unless_rows_are_rounded_up():
    row = PackedCollator()(FEATS)   # a Llama-style tokenizer has no pad token
    assert row["input_ids"].shape == (1, 5)
    with pytest.raises(ValueError, match="pad_to_multiple_of=8 pads rows: it needs a pad_token_id"):
        PackedCollator(pad_to_multiple_of=8)


def test_packed_trainer_trains_without_a_pad_token(tmp_path):
    trainer = PackedTrainer(model=model_for("llama", packed=True), args=args(tmp_path, max_steps=1),
                            train_dataset=Tokenized(6), pack_length=128)
    trainer.train()
    assert trainer.state.global_step == 1


def _hf(items):
    from datasets import Dataset

    return Dataset.from_list(items)


@pytest.mark.parametrize("extra, column", [("position_ids", "position_ids"), ("seq_lengths", "seq_lengths")])
def test_a_dataset_packed_already_is_refused(tmp_path, extra, column):
    pytest.importorskip("datasets")
    items = [dict(x, **{extra: list(range(len(x["input_ids"])))}) for x in Tokenized(4).items]
    with pytest.raises(ValueError, match=rf"{column}.*packed already"):
        PackedTrainer(model=model_for("qwen2", packed=True), args=args(tmp_path, max_steps=1),
                      train_dataset=_hf(items), pack_length=128)


def test_a_streaming_dataset_is_refused_up_front(tmp_path):
    pytest.importorskip("datasets")
    stream = _hf(Tokenized(4).items).to_iterable_dataset()
    with pytest.raises(ValueError, match="streaming"):
        PackedTrainer(model=model_for("qwen2", packed=True), args=args(tmp_path, max_steps=1),
                      train_dataset=stream, pack_length=128)


def _sft_args(tmp_path, **kw):
    from trl import SFTConfig

    base = {k: v for k, v in args(tmp_path, max_steps=1).to_dict().items()
            if k in {"output_dir", "learning_rate", "optim", "report_to", "save_strategy", "use_cpu", "seed",
                     "remove_unused_columns", "disable_tqdm", "max_steps"}}
    return SFTConfig(**{**base, "bf16": False, **kw})


@pytest.mark.parametrize("kw, setting", [(dict(packing=True, max_length=None), "packing=True"),
                                         (dict(packing=False, max_length=1024), "max_length=1024")])
def test_trl_packing_or_truncation_is_refused_before_the_data_is_read(tmp_path, kw, setting):
    pytest.importorskip("trl")
    from trl import SFTTrainer

    from west.hf import PackingMixin

    class PackedSFTTrainer(PackingMixin, SFTTrainer):
        pass

    class Unreadable(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            raise AssertionError("the dataset was read")

    with pytest.raises(ValueError, match=setting):
        PackedSFTTrainer(model=model_for("qwen2", packed=True), args=_sft_args(tmp_path, **kw),
                         train_dataset=Unreadable(), pack_length=128)


@pytest.mark.parametrize("call, message", [
    (dict(inputs=[[1, 2], [3] * 9]), r"inputs\[1\] has 9 tokens, more than max_length 8"),
    (dict(inputs=[[1, 2]], masks=[[0, 0]]), r"inputs\[0\] is empty \(after dropping"),
    (dict(inputs=[[1, 2]], labels=[[1]]), r"labels\[0\] has 1 tokens but inputs\[0\] has 2"),
])
def test_concatenate_and_pack_names_its_own_arguments(call, message):
    from west.packing import concatenate_and_pack

    with pytest.raises(ValueError, match=message):
        concatenate_and_pack(**call, max_length=8, pad_token_id=0)


def test_gpt2_packed_loss_is_the_true_per_token_mean(tmp_path):
    """GPT-2 has no loss_type, so Trainer counts every label that is not -100: padded, each sample's
    first label too (nothing predicts it); packed, those labels are -100 already."""
    data = Tokenized(6, seed=3)
    data.items = [dict(x, labels=x["input_ids"]) for x in data.items]   # every first label counted padded
    total = sum(len(x["input_ids"]) for x in data.items)
    predicted = sum(len(x["input_ids"]) - 1 for x in data.items)
    with torch.no_grad():
        batch = pad_collate(data.items)
        logits = tiny_model("gpt2")(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        summed = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(),
                                                   ignore_index=-100, reduction="sum").item()
    packed = PackedTrainer(model=use_packed_attention(tiny_model("gpt2")), args=args(tmp_path / "p", max_steps=1),
                           train_dataset=data, pack_length=total)
    packed.train()
    padded = Trainer(model=tiny_model("gpt2"), args=args(tmp_path / "u", max_steps=1, per_device_train_batch_size=6),
                     train_dataset=data, data_collator=pad_collate)
    padded.train()
    assert packed.state.log_history[0]["loss"] == pytest.approx(summed / predicted, rel=1e-5)
    assert padded.state.log_history[0]["loss"] == pytest.approx(summed / (predicted + len(data)), rel=1e-5)


def test_evaluation_runs_unpacked_and_equals_stock(tmp_path):
    data = Tokenized(6, seed=4)
    west = PackedTrainer(model=model_for("qwen2", packed=True), args=args(tmp_path / "p", per_device_eval_batch_size=3),
                         train_dataset=data, eval_dataset=data, data_collator=pad_collate, pack_length=128)
    stock = Trainer(model=model_for("qwen2", packed=False), args=args(tmp_path / "u", per_device_eval_batch_size=3),
                    eval_dataset=data, data_collator=pad_collate)
    assert west.evaluate()["eval_loss"] == pytest.approx(stock.evaluate()["eval_loss"], rel=1e-6)
