"""``train.cuda_graphs``: the frozen LLM decoder's forward and backward captured once as CUDA graphs
and replayed every step, so that for the decoder the host launches two graphs instead of thousands
of kernels (on one H100 at the seed's shapes the step is paced by the host: GPU busy ~70 %).

Every packed row is padded to one shape (west.models.static_decoder: P = data.pack_tokens tokens,
``train.graph_segments`` boundaries, ``train.graph_max_seqlen`` the longest segment), so one graph
serves the whole run; a row that does not fit runs eagerly and is counted. The encoder, projector,
loss and optimizer stay eager (their shapes change with every pack). On a CPU there is nothing to
capture: the padded rows run eagerly, which is what the tests compare against the unpadded step.
"""
from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

from west.models.static_decoder import StaticDecoder, StaticShape
from west.ranks import unwrap


def static_decoder_for(model: nn.Module, tokens: int, segments: int, max_seqlen: int, precision: str,
                       device: torch.device, warmup_iters: int = 3) -> StaticDecoder:
    """Route ``model``'s packed training rows through its decoder at one static shape; on CUDA,
    capture that decoder's forward and backward (``model`` already on ``device``)."""
    shape = StaticShape(tokens, segments, max_seqlen)
    speech_llm = unwrap(model)
    static = speech_llm.use_static_decoder(shape)
    if device.type == "cuda":
        was_training = speech_llm.training
        speech_llm.train()   # recorded as it trains (no dropout in the frozen decoder either way)
        capture(static, speech_llm.llm.get_input_embeddings().weight, precision, warmup_iters)
        speech_llm.train(was_training)
    return static


def capture(static: StaticDecoder, embedding: torch.Tensor, precision: str, warmup_iters: int = 3) -> None:
    """``static.replay`` := the decoder's forward + backward as CUDA graphs (torch.cuda.make_graphed_callables),
    recorded on a row of padding at the static shape. bf16 autocast runs inside the graph with its
    weight-cast cache off, as graph capture requires; the frozen weights are the graph's constants."""
    sample = static.sample_inputs(embedding.shape[1], embedding.dtype, embedding.device)
    max_seqlen = static.shape.max_seqlen

    def decode(embeds: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        cast = (torch.autocast(device_type="cuda", dtype=torch.bfloat16, cache_enabled=False)
                if precision == "bf16" else contextlib.nullcontext())
        with cast:
            return static.decoder(embeds, position_ids, cu_seqlens, None, max_seqlen)

    static.replay = graphed(decode, sample, warmup_iters, "train.cuda_graphs", f"the LLM decoder at {static.shape}")


def graphed(fn, sample: tuple, warmup_iters: int, key: str, what: str):
    """``torch.cuda.make_graphed_callables(fn, sample)``; a failure names the config key that asked
    for it and what was being captured, not only where inside torch it failed."""
    try:
        return torch.cuda.make_graphed_callables(fn, sample, num_warmup_iters=warmup_iters)
    except Exception as e:
        alloc = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        hint = (f" or with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False (now {alloc!r}: some torch builds "
                "capture badly with expandable segments)" if "expandable_segments:True" in alloc else "")
        raise RuntimeError(f"{key}: capturing {what} failed ({type(e).__name__}: {e}); train without it "
                           f"({key} false){hint}") from e
