#!/usr/bin/env python3
"""A randomly initialised LLM of a published Qwen2 shape, written as a Hugging Face directory.

The seed experiment's LLM is Qwen2-1.5B; no weights can be downloaded here, so this builds
``Qwen2ForCausalLM`` from the published configuration values (vocabulary 151,936) with random
weights and saves it with ``save_pretrained`` next to a tokenizer copied from ``--tokenizer``
(any HF tokenizer dir, e.g. the recipe's exp/tiny_llm; its ids must lie below the vocabulary).
Step time, memory and checkpoint size then match the real model's; the loss does not.

    python tools/make_seed_llm.py exp/seed_llm --tokenizer exp/tiny_llm --shape qwen2-1.5b

``--config_only`` writes config.json and the tokenizer without weights: enough for what only needs
the shapes (tools/step_roofline.py builds the model on the meta device).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

# Published config.json values (Qwen/Qwen2-*): the architecture only, no weights.
SHAPES = {
    "qwen2-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                       num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False,
                     vocab_size=152064),
    # The benchmark's LLM-heavy configuration (recipes/aishell/conf/bench_llm_heavy.yaml): a
    # ~10M Qwen2 whose forward FLOPs dwarf the tiny encoder's on a CPU; vocabulary = the tokenizer's.
    "bench-10m": dict(hidden_size=384, intermediate_size=1152, num_hidden_layers=6, num_attention_heads=6,
                      num_key_value_heads=2, tie_word_embeddings=True, vocab_size=None),
    # The seed's depth at a tiny width (recipes/aishell/conf/seed_depth_tiny.yaml): Qwen2-1.5B's 28
    # layers with GQA, for counting the operators a step dispatches (tools/seed_depth_ops.sh) on a CPU.
    "seed-depth-tiny": dict(hidden_size=96, intermediate_size=256, num_hidden_layers=28, num_attention_heads=6,
                            num_key_value_heads=2, tie_word_embeddings=True, vocab_size=None),
}
COMMON = dict(vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
              hidden_act="silu", attention_dropout=0.0, initializer_range=0.02, use_sliding_window=False)


def build(out: Path, tokenizer_dir: str, shape: str, dtype: str, seed: int, device: str = "cpu",
          config_only: bool = False) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    dims = {**COMMON, **SHAPES[shape]}
    if dims["vocab_size"] is None:
        dims["vocab_size"] = -(-len(tok) // 64) * 64
    conf = Qwen2Config(**dims,
                       pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    if len(tok) > conf.vocab_size:
        raise SystemExit(f"--tokenizer {tokenizer_dir} has {len(tok)} tokens, more than {shape}'s {conf.vocab_size}")
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.device("meta" if config_only else device):   # a GPU draws 1.5B random weights in seconds, a CPU in a minute
        model = AutoModelForCausalLM.from_config(conf, dtype=getattr(torch, dtype))
    out.mkdir(parents=True, exist_ok=True)
    if config_only:
        conf.save_pretrained(str(out))
    else:
        model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    n = sum(p.numel() for p in model.parameters())
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    return {"params": n, "bytes": size, "seconds": time.perf_counter() - t0}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="directory to write (config.json, safetensors, tokenizer)")
    p.add_argument("--tokenizer", required=True, help="HF tokenizer directory to copy")
    p.add_argument("--shape", default="qwen2-1.5b", choices=sorted(SHAPES))
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="where to draw the weights (cuda: much faster)")
    p.add_argument("--config_only", action="store_true", help="config.json and the tokenizer, no weights")
    a = p.parse_args(argv)
    r = build(a.out, a.tokenizer, a.shape, a.dtype, a.seed, a.device, a.config_only)
    if a.config_only:
        print(f"make_seed_llm: {a.shape}'s config.json and tokenizer in {a.out}, no weights "
              f"({r['params'] / 1e6:,.1f} M parameters)")
        return 0
    print(f"make_seed_llm: {a.shape} with random weights, {r['params'] / 1e6:,.1f} M parameters, "
          f"{r['bytes'] / 2**30:.2f} GiB of {a.dtype} safetensors in {a.out} ({r['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
