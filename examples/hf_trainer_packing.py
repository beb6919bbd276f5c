#!/usr/bin/env python3
"""west's packing in a plain ``transformers.Trainer`` run: padded vs packed on the CPU, about a minute.

A tiny random Qwen2 (built from its config, nothing downloaded) trains one epoch on synthetic
tokenized samples of varied length, first with the usual padded batches, then with west's
packed rows (``west.hf.PackedTrainer`` + ``use_packed_attention``). Printed: real tokens/s,
the share of computed tokens that are padding, the losses; then, by arithmetic with west's
planner, how much of the compute is real tokens at a few average lengths (when packing helps).

    python examples/hf_trainer_packing.py [--samples 256] [--pack_length 2048] [--batch_size 8]
    python examples/hf_trainer_packing.py --trainer sft    # TRL's SFTTrainer, padded vs PackingMixin
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch.utils.data import Dataset
from transformers import AutoModelForCausalLM, Qwen2Config, Trainer, TrainingArguments

from west.hf import PackedTrainer, use_packed_attention
from west.packing import pack

PAD, VOCAB = 0, 1000


class Synthetic(Dataset):
    def __init__(self, lengths: np.ndarray, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.items = [{"input_ids": rng.integers(1, VOCAB, int(n)).tolist()} for n in lengths]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        item = self.items[i]
        return {"input_ids": item["input_ids"], "labels": item["input_ids"]}


COMPUTED = {"padded": 0}   # tokens the padded batches hand the model, counted as they are collated


def pad_collate(features):
    width = max(len(f["input_ids"]) for f in features)
    COMPUTED["padded"] += width * len(features)
    ids = torch.full((len(features), width), PAD)
    mask = torch.zeros_like(ids)
    for r, f in enumerate(features):
        ids[r, :len(f["input_ids"])] = torch.tensor(f["input_ids"])
        mask[r, :len(f["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def lognormal_lengths(n: int, mean: float, cap: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.lognormal(np.log(mean) - 0.18, 0.6, n)   # sigma 0.6: a long right tail, mean ≈ ``mean``
    return np.clip(x.round(), 8, cap).astype(np.int64)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, pad_token_id=PAD)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")


def run(trainer_cls, dataset, out: str, **kw) -> tuple[float, float]:
    args = TrainingArguments(output_dir=out, num_train_epochs=1, learning_rate=1e-3, report_to=[],
                             save_strategy="no", logging_steps=10**6, use_cpu=True, seed=0,
                             per_device_train_batch_size=kw.pop("batch_size", 1), remove_unused_columns=False,
                             disable_tqdm=True)
    trainer = trainer_cls(args=args, train_dataset=dataset, **kw)
    t0 = time.perf_counter()
    result = trainer.train()
    return time.perf_counter() - t0, result.training_loss


def sft_trainers():
    """TRL's SFTTrainer (padded to each batch's longest, as its own collator pads; ours counts the
    tokens) and the same with west's PackingMixin, taking the pre-tokenized samples as they are
    (a word-level tokenizer over the ids only names pad and eos)."""
    from datasets import Dataset as HFDataset  # optional: TRL's
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    from west.hf import PackingMixin

    class PackedSFTTrainer(PackingMixin, SFTTrainer):
        pass

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({str(i): i for i in range(VOCAB)},
                                                                             unk_token="1")),
                                  pad_token=str(PAD), eos_token="1")

    def make(trainer_cls, args, train_dataset, **kw):
        keep = ("output_dir", "num_train_epochs", "learning_rate", "report_to", "save_strategy", "logging_steps",
                "use_cpu", "seed", "per_device_train_batch_size", "remove_unused_columns", "disable_tqdm")
        conf = SFTConfig(**{k: getattr(args, k) for k in keep}, packing=False, max_length=None, bf16=False)
        data = HFDataset.from_list([{"input_ids": x["input_ids"]} for x in train_dataset.items])
        return trainer_cls(args=conf, train_dataset=data, processing_class=tok, **kw)

    return (lambda **kw: make(SFTTrainer, **kw)), (lambda **kw: make(PackedSFTTrainer, **kw))


def utilisation_table(pack_length: int, batch_size: int, n: int = 20000) -> list[tuple]:
    """Real tokens / computed tokens: padded to max_length, padded to the batch's longest, packed."""
    rows = []
    for mean in (256, 512, 1024):
        lengths = lognormal_lengths(n, mean, pack_length, seed=1)
        real = int(lengths.sum())
        to_max = real / (n * pack_length)
        batches = np.random.default_rng(2).permutation(n).reshape(-1, batch_size)
        to_longest = real / int(sum(lengths[b].max() * len(b) for b in batches))
        packed = real / (len(pack(lengths, pack_length)) * pack_length)
        rows.append((mean, to_max, to_longest, packed))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--mean_length", type=int, default=200)
    p.add_argument("--pack_length", type=int, default=2048)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--out", default="/tmp/west_hf_packing")
    p.add_argument("--trainer", choices=["trainer", "sft"], default="trainer",
                   help="transformers.Trainer (PackedTrainer), or TRL's SFTTrainer (with PackingMixin)")
    a = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    lengths = lognormal_lengths(a.samples, a.mean_length, a.pack_length)
    data = Synthetic(lengths)
    real = int(lengths.sum())

    padded_cls, packed_cls = sft_trainers() if a.trainer == "sft" else (Trainer, PackedTrainer)
    padded_s, padded_loss = run(padded_cls, data, f"{a.out}/padded", model=model(), data_collator=pad_collate,
                                batch_size=a.batch_size)
    packed = PackedTrainer(args=TrainingArguments(output_dir=f"{a.out}/probe", report_to=[], use_cpu=True),
                           model=model(), train_dataset=data, pack_length=a.pack_length, pad_token_id=PAD)
    rows = len(packed.get_train_dataloader())
    packed_s, packed_loss = run(packed_cls, data, f"{a.out}/packed", model=use_packed_attention(model()),
                                pack_length=a.pack_length, pad_token_id=PAD)
    padded_tokens = COMPUTED["padded"]
    print(f"{a.samples} samples, mean length {lengths.mean():.0f} (max {lengths.max()}), {real} real tokens")
    print(f"{'':8} {'time s':>7} {'real tok/s':>10} {'padding share':>14} {'loss':>6}")
    print(f"{'padded':8} {padded_s:7.1f} {real / padded_s:10.0f} {1 - real / padded_tokens:14.1%} {padded_loss:6.3f}")
    print(f"{'packed':8} {packed_s:7.1f} {real / packed_s:10.0f} {0.0:14.1%} {packed_loss:6.3f}   "
          f"({rows} rows of <= {a.pack_length} tokens; rows end at their last sample)")
    print(f"packed / padded: {padded_s / packed_s:.2f}x real tokens per second")
    print(f"\nshare of computed tokens that are real (20,000 lognormal lengths, rows of {a.pack_length}):")
    print(f"{'mean length':>11} {'padded to max':>14} {'padded, batch ' + str(a.batch_size):>16} {'packed':>8}")
    for mean, to_max, to_longest, pk in utilisation_table(a.pack_length, a.batch_size):
        print(f"{mean:11d} {to_max:14.1%} {to_longest:16.1%} {pk:8.1%}")


if __name__ == "__main__":
    main()
