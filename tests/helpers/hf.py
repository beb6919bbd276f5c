"""Tiny Hugging Face causal LMs and tokenized samples for west.hf's Trainer tests."""
from __future__ import annotations

import torch
from torch.utils.data import Dataset
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, TrainingArguments

from west.hf import use_packed_attention

VOCAB, PAD = 64, 0
CONFIGS = {
    "qwen2": lambda: Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                 attention_dropout=0.0, pad_token_id=PAD),
    "llama": lambda: LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                 attention_dropout=0.0, pad_token_id=PAD),
}


class Tokenized(Dataset):
    """Samples with a prompt (labels -100) and an answer, of varied lengths."""

    def __init__(self, n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(n):
            length = int(torch.randint(4, 40, (1,), generator=g))
            ids = torch.randint(1, VOCAB, (length,), generator=g).tolist()
            prompt = int(torch.randint(0, length - 1, (1,), generator=g))   # 0: every token a label
            self.items.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


def pad_collate(features: list[dict]) -> dict:
    """The usual unpacked batch: right padding, labels -100 there, a 2-D attention mask."""
    width = max(len(f["input_ids"]) for f in features)
    ids = torch.full((len(features), width), PAD)
    labels = torch.full((len(features), width), -100)
    mask = torch.zeros((len(features), width), dtype=torch.long)
    for r, f in enumerate(features):
        n = len(f["input_ids"])
        ids[r, :n], labels[r, :n], mask[r, :n] = torch.tensor(f["input_ids"]), torch.tensor(f["labels"]), 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def model_for(kind: str, packed: bool):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[kind](), dtype=torch.float32, attn_implementation="sdpa")
    return use_packed_attention(model) if packed else model


def args(tmp_path, **kw) -> TrainingArguments:
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=1, learning_rate=1.0, optim="sgd",
                lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, report_to=[],
                save_strategy="no", logging_steps=1, use_cpu=True, seed=0, dataloader_num_workers=0,
                remove_unused_columns=False, disable_tqdm=True)
    return TrainingArguments(**{**base, **kw})


def weights(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}
