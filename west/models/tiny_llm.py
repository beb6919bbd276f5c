"""Build a small tokenizer + random Qwen2 checkpoint on disk.

No weights can be downloaded on the reference machines, so the CPU recipe and
the tests train a byte-level BPE tokenizer on their own transcripts, build a
Qwen2 causal LM from a config with random weights, and save both with
``save_pretrained``. Everything downstream then loads them by path with
``from_pretrained`` — exactly the path a real Qwen2 checkpoint takes.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

# Qwen2-style chat template: the data pipeline renders prompts through it.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|speech|>"]
SPEECH_TOKEN = "<|speech|>"


def build_tokenizer(texts: Iterable[str], out_dir: str | Path, vocab_size: int = 1000):
    """Train a byte-level BPE on ``texts`` and save it as a Hugging Face tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", SPEECH_TOKEN],
    )
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(str(out_dir))
    return hf


def build_tiny_qwen2(
    out_dir: str | Path,
    vocab_size: int,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 32768,
    seed: int = 0,
):
    """Create a randomly initialised Qwen2ForCausalLM from a config and save it."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        attention_dropout=0.0,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(str(out_dir))
    return model


def build_tiny_llm(texts: Iterable[str], out_dir: str | Path, vocab_size: int = 1000, **model_kwargs) -> Path:
    """Tokenizer + tiny Qwen2 in one directory, loadable with ``from_pretrained(out_dir)``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(texts, out_dir, vocab_size=vocab_size)
    build_tiny_qwen2(out_dir, vocab_size=len(tok), **model_kwargs)
    return out_dir
