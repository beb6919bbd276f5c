"""Build a small tokenizer + random Qwen2 checkpoint on disk.

No weights can be downloaded on the reference machines, so the CPU recipe and
the tests train a byte-level BPE tokenizer on their own transcripts, build a
Qwen2 causal LM from a config with random weights, and save both with
``save_pretrained``. Everything downstream then loads them by path with
``from_pretrained`` — exactly the path a real Qwen2 checkpoint takes.
"""
from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Iterable, Sequence

from west.shapes import SPEECH_MARKER

# Qwen2-style chat template: the data pipeline renders prompts through it.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|speech|>"]
SPEECH_TOKEN = "<|speech|>"
PAD_ID = 0   # "<|endoftext|>" is the first special token: the pad, and the CTC blank of conf/tiny_cpu.yaml


def build_tokenizer(texts: Iterable[str], out_dir: str | Path, vocab_size: int = 1000):
    """Train a byte-level BPE on ``texts`` and save it as a Hugging Face tokenizer.

    Every Han character is its own pre-token, so Chinese is tokenized into
    characters (the AIShell convention, and what Qwen2 does for common
    characters) and merges never straddle two characters; other text gets
    ordinary byte-level BPE words."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers  # heavy
    from transformers import PreTrainedTokenizerFast  # heavy

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{Han}"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
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
    assert hf.pad_token_id == PAD_ID, hf.pad_token_id
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
    initializer_range: float | None = None,
):
    """Create a randomly initialised Qwen2ForCausalLM from a config and save it.

    ``initializer_range`` defaults to 1/sqrt(hidden_size) (Qwen2's 0.02 is tuned for
    widths in the thousands; at 64 it makes every layer a near-identity at init)."""
    import torch  # heavy
    from transformers import AutoModelForCausalLM, Qwen2Config  # heavy

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
        initializer_range=initializer_range if initializer_range is not None else hidden_size ** -0.5,
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


def speech_stream(ids: Sequence[int], blank: int, rng, max_blanks: int = 5, compact: bool = False) -> list[int]:
    """What the LLM is pretrained to read in place of speech: every token once or twice, each
    followed by 1..max_blanks blanks; ``compact``: the tokens once each, then as many blanks
    as make up the same length (the ``ctc_compact`` projector's layout)."""
    stream: list[int] = []
    for t in ids:
        stream += [t] * rng.randint(1, 2) + [blank] * rng.randint(1, max_blanks)
    return list(ids) + [blank] * (len(stream) - len(ids)) if compact else stream


def pretrain_transcriber(llm_dir: str | Path, texts: Sequence[str], steps: int = 1500, lr: float = 3e-3,
                         batch_size: int = 16, prompt: str = "<|speech|>Transcribe the speech.",
                         max_blanks: int = 5, compact: bool = False, seed: int = 0,
                         progress: bool = True) -> dict:
    """Text-only pretraining of the tiny LLM in ``llm_dir`` (overwritten), so that it plays
    the part a pretrained Qwen2 plays: reading token-like input and repeating it.

    Each example is the recipe's chat prompt with the speech marker replaced by a
    CTC-like stream of the transcript: every token once or twice, each followed by
    1..``max_blanks`` pad tokens (the blank). The answer is the clean transcript plus
    the end token; only the answer is scored. With ``projector.type: ctc_posterior``
    and ``model.ctc_blank`` = the pad id, speech later reaches the LLM as exactly such
    a stream of (soft) token embeddings. With ``compact`` the stream is the tokens once
    each, then as many pad tokens as the CTC-like stream would have had: what the
    ``ctc_compact`` projector sends (one soft token per CTC segment, blank rows after).
    Returns the mean loss / answer-token accuracy of the
    first and the last tenth of the steps."""
    import torch  # heavy
    import torch.nn.functional as F  # heavy
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy

    tok = AutoTokenizer.from_pretrained(str(llm_dir))
    model = AutoModelForCausalLM.from_pretrained(str(llm_dir), dtype=torch.float32)
    rendered = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True)
    if rendered.count(SPEECH_MARKER) != 1:
        raise ValueError(f"prompt {prompt!r} must contain {SPEECH_MARKER!r} once")
    before, after = (tok(p, add_special_tokens=False)["input_ids"] for p in rendered.split(SPEECH_MARKER))
    blank, eos = tok.pad_token_id, tok.eos_token_id
    corpus = [ids for ids in tok(list(texts), add_special_tokens=False)["input_ids"] if ids]
    if not corpus:
        raise ValueError("pretrain_transcriber needs at least one non-empty text")
    rng = random.Random(seed)
    torch.manual_seed(seed)

    def example(ids: list[int]) -> tuple[list[int], list[int]]:
        x = before + speech_stream(ids, blank, rng, max_blanks, compact) + after + ids + [eos]
        first = len(x) - len(ids) - 2          # predicts the first answer token
        y = [-100] * first + x[first + 1:] + [-100]
        return x, y

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * (0.5 + 0.5 * 0.5 * (1 + math.cos(math.pi * s / steps))))
    model.train()
    hist: list[tuple[float, float]] = []
    bar = range(steps)
    if progress:
        from tqdm import tqdm  # heavy
        bar = tqdm(bar, desc="pretrain tiny LLM", unit="step", disable=None, mininterval=2.0)
    for _ in bar:
        pairs = [example(corpus[rng.randrange(len(corpus))]) for _ in range(batch_size)]
        width = max(len(x) for x, _ in pairs)
        x = torch.full((batch_size, width), blank)
        y = torch.full((batch_size, width), -100)
        mask = torch.zeros(batch_size, width, dtype=torch.long)
        for i, (xi, yi) in enumerate(pairs):
            x[i, :len(xi)], y[i, :len(yi)], mask[i, :len(xi)] = torch.tensor(xi), torch.tensor(yi), 1
        logits = model(input_ids=x, attention_mask=mask, use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        keep = y != -100
        hist.append((loss.item(), float((logits.argmax(-1)[keep] == y[keep]).float().mean())))
        if progress:
            bar.set_postfix(loss=f"{hist[-1][0]:.3f}", acc=f"{hist[-1][1]:.3f}", refresh=False)
    model.save_pretrained(str(llm_dir))
    k = max(1, len(hist) // 10)
    head, tail = hist[:k], hist[-k:]
    return {"steps": steps, "first_loss": sum(h[0] for h in head) / k, "loss": sum(h[0] for h in tail) / k,
            "first_acc": sum(h[1] for h in head) / k, "acc": sum(h[1] for h in tail) / k}
