#!/usr/bin/env python3
"""WeNet Conformer encoder (final.pt + train.yaml) -> west's Conformer config + safetensors.

    python tools/convert_wenet_checkpoint.py --wenet_dir exp/conformer --out exp/wenet_enc
    python tools/convert_wenet_checkpoint.py --checkpoint final.pt --config train.yaml --out DIR

Writes ``DIR/encoder.safetensors`` (west parameter names), ``DIR/encoder.yaml`` (the
``model.encoder`` section) and, when the model normalised its input, ``DIR/global_cmvn.json``
(for ``data.cmvn``: WeNet applies CMVN inside its encoder, west in the data pipeline).

Only options whose math west's Conformer computes are converted; anything else is refused
(exit code 2) with a message naming the option. WeNet's ``rel_pos`` attention adds
(q+v)·W_pos·pe(j), an encoding of the KEY's position j (no rel_shift), where west's default
adds pe(i−j); the written config sets ``pos_enc: wenet`` so west computes WeNet's term, and
``init`` so west-train loads the weights (docs/models.md, "Converting a WeNet Conformer").
Mapping checked against wenet-e2e/wenet at commit 0154699 (2025-12-19).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from typing import Optional

import torch
import yaml

SUBSAMPLING = {"conv2d": 4, "conv2d6": 6, "conv2d8": 8}   # WeNet input_layer -> west rate
# encoder_conf options west computes only with this value (WeNet's ConformerEncoder defaults
# differ for some: cnn_module_norm defaults to batch_norm, num_blocks to 6).
REQUIRED = {
    "pos_enc_layer_type": "rel_pos", "selfattention_layer_type": "rel_selfattn",
    "normalize_before": True, "macaron_style": True, "use_cnn_module": True, "causal": False,
    "cnn_module_norm": "layer_norm", "activation_type": "swish", "static_chunk_size": 0,
    "positionwise_conv_kernel_size": 1, "query_bias": True, "key_bias": True, "value_bias": True,
    "conv_bias": True, "mlp_bias": True, "mlp_type": "position_wise_feed_forward",
    "layer_norm_type": "layer_norm", "norm_eps": 1e-5, "conv_norm_eps": 1e-5,
    "conv_inner_factor": 2, "final_norm": True, "n_kv_head": None, "head_dim": None,
}
DEFAULTS = {**REQUIRED, "cnn_module_norm": "batch_norm"}   # WeNet's where unset
# Options that change training only (dropout, masks drawn during training) or the kernel used.
IGNORED = {"positional_dropout_rate", "use_dynamic_chunk", "use_dynamic_left_chunk",
           "gradient_checkpointing", "use_sdpa", "n_expert", "n_expert_activated"}
MAPPED = {"output_size", "attention_heads", "linear_units", "num_blocks", "dropout_rate",
          "attention_dropout_rate", "input_layer", "cnn_module_kernel"}

# WeNet encoder tensor (after "encoder.") -> west ConformerEncoder tensor.
BLOCK = {
    "self_attn.linear_q": "attn.linear_q", "self_attn.linear_k": "attn.linear_k",
    "self_attn.linear_v": "attn.linear_v", "self_attn.linear_out": "attn.linear_out",
    "self_attn.linear_pos": "attn.linear_pos", "self_attn.pos_bias_u": "attn.pos_bias_u",
    "self_attn.pos_bias_v": "attn.pos_bias_v",
    "feed_forward_macaron.w_1": "ff1.net.0", "feed_forward_macaron.w_2": "ff1.net.3",  # first half-step
    "feed_forward.w_1": "ff2.net.0", "feed_forward.w_2": "ff2.net.3",                  # last half-step
    "conv_module.pointwise_conv1": "conv.pointwise1", "conv_module.depthwise_conv": "conv.depthwise",
    "conv_module.norm": "conv.norm", "conv_module.pointwise_conv2": "conv.pointwise2",
    "norm_ff_macaron": "norm_ff1", "norm_mha": "norm_attn", "norm_conv": "norm_conv",
    "norm_ff": "norm_ff2", "norm_final": "norm_out",
}
POINTWISE = ("conv.pointwise1.weight", "conv.pointwise2.weight")  # Conv1d (out, in, 1) -> Linear
SKIPPED = ("embed.pos_enc.pe",)   # the fixed sinusoid table (a buffer), recomputed by west


class Refusal(Exception):
    """The checkpoint uses something west's Conformer does not compute; the message names it."""


def encoder_config(conf: dict) -> dict:
    """train.yaml -> ``ConformerConfig`` fields, or Refusal naming the first unsupported option."""
    kind = conf.get("encoder", "conformer")
    if kind != "conformer":
        raise Refusal(f"encoder: {kind!r}: only WeNet's 'conformer' encoder is supported")
    enc = dict(conf.get("encoder_conf") or {})
    unknown = sorted(set(enc) - set(REQUIRED) - IGNORED - MAPPED)
    if unknown:
        raise Refusal(f"encoder_conf.{unknown[0]}: unknown option (not read by this converter; "
                      "it may change the encoder's math)")
    for key, want in REQUIRED.items():
        got = enc.get(key, DEFAULTS[key])
        if got != want and not (isinstance(want, float) and isinstance(got, (int, float))
                                and math.isclose(got, want)):
            raise Refusal(f"encoder_conf.{key}: {got!r} is not supported (west's Conformer computes "
                          f"only {key}={want!r}){_hint(key)}")
    layer = enc.get("input_layer", "conv2d")
    if layer not in SUBSAMPLING:
        raise Refusal(f"encoder_conf.input_layer: {layer!r} is not supported (west subsamples with "
                      f"{', '.join(SUBSAMPLING)})")
    feats = (conf.get("dataset_conf") or {}).get("feats_type", "fbank")
    if feats != "fbank":
        raise Refusal(f"dataset_conf.feats_type: {feats!r}: the encoder was trained on {feats} features and "
                      "west's Conformer reads Kaldi fbank (data.features fbank); converting would feed it the wrong input")
    if "input_dim" not in conf:
        raise Refusal("input_dim: missing from train.yaml (the fbank bins the encoder reads)")
    return dict(
        input_dim=int(conf["input_dim"]), d_model=int(enc.get("output_size", 256)),
        num_heads=int(enc.get("attention_heads", 4)), ffn_dim=int(enc.get("linear_units", 2048)),
        num_blocks=int(enc.get("num_blocks", 6)), conv_kernel=int(enc.get("cnn_module_kernel", 15)),
        subsampling_rate=SUBSAMPLING[layer], dropout=float(enc.get("dropout_rate", 0.1)),
        attn_dropout=float(enc.get("attention_dropout_rate", 0.0)), pos_enc="wenet")


def _hint(key: str) -> str:
    return {"cnn_module_norm": " (a BatchNorm over time cannot become west's per-frame LayerNorm; "
                               "WeNet's default is batch_norm)",
            "causal": " (west's depthwise convolution is centred)",
            "static_chunk_size": " (west attends over the full utterance)"}.get(key, "")


def west_name(key: str, rate: int) -> Optional[str]:
    """West name of the WeNet encoder tensor ``key`` (without ``encoder.``); None if unknown."""
    m = re.fullmatch(r"embed\.conv\.(\d+)\.(weight|bias)", key)
    if m and int(m[1]) < 2 * (3 if rate == 8 else 2) and int(m[1]) % 2 == 0:
        return f"subsampling.conv.{m[1]}.{m[2]}"
    out = "embed.out.0" if rate == 4 else "embed.linear"     # Conv2dSubsampling4 wraps it in a Sequential
    m = re.fullmatch(re.escape(out) + r"\.(weight|bias)", key)
    if m:
        return f"subsampling.out.{m[1]}"
    m = re.fullmatch(r"after_norm\.(weight|bias)", key)
    if m:
        return key
    m = re.fullmatch(r"encoders\.(\d+)\.(.+)\.(weight|bias)", key) or \
        re.fullmatch(r"encoders\.(\d+)\.(self_attn\.pos_bias_[uv])()", key)
    if m and m[2] in BLOCK:
        return f"blocks.{m[1]}.{BLOCK[m[2]]}" + (f".{m[3]}" if m[3] else "")
    return None


def encoder_state(state: dict, rate: int) -> tuple[dict, dict]:
    """WeNet model state dict -> (west encoder tensors, CMVN buffers); Refusal on any unknown tensor."""
    state = {k.removeprefix("module."): v for k, v in state.items()}   # saved from DDP
    out, cmvn = {}, {}
    for key, value in state.items():
        if not key.startswith("encoder."):
            continue                                   # decoder, ctc, ...: not the encoder
        key = key.removeprefix("encoder.")
        if key in ("global_cmvn.mean", "global_cmvn.istd"):
            cmvn[key.split(".")[1]] = value
            continue
        if key in SKIPPED:
            continue
        name = west_name(key, rate)
        if name is None:
            raise Refusal(f"encoder.{key}: a tensor west's Conformer has no place for "
                          f"(shape {tuple(value.shape)})")
        out[name] = value.squeeze(-1) if name.endswith(POINTWISE) else value
    if not out:
        raise Refusal("the checkpoint has no encoder.* tensors (is it a WeNet model state dict?)")
    return out, cmvn


def load_cmvn_file(path: str) -> dict:
    """WeNet's global_cmvn (JSON stats or Kaldi text) -> west's CMVN JSON content."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if text.lstrip().startswith("{"):
        d = json.loads(text)
        return {k: d[k] for k in ("mean_stat", "var_stat", "frame_num")}
    arr = text.split()                                 # "[ sum_0 .. sum_{D-1} count sumsq_0 .. 0 ]"
    if arr[:1] != ["["] or arr[-2:] != ["0", "]"]:
        raise Refusal(f"{path}: neither JSON stats nor Kaldi text CMVN stats")
    dim = (len(arr) - 4) // 2
    vals = [float(x) for x in arr[1:-2]]
    return {"mean_stat": vals[:dim], "var_stat": vals[dim + 1:2 * dim + 1], "frame_num": vals[dim]}


def find_cmvn(conf: dict, buffers: dict, search: list[str]) -> tuple[Optional[dict], str]:
    """The CMVN the model was trained with (checkpoint buffers first), and where it came from."""
    if {"mean", "istd"} <= set(buffers):
        return {"mean": buffers["mean"].float().tolist(), "istd": buffers["istd"].float().tolist()}, \
            "encoder.global_cmvn buffers"
    if conf.get("cmvn") != "global_cmvn":
        return None, "none (the model reads raw fbank)"
    path = (conf.get("cmvn_conf") or {}).get("cmvn_file", "")
    for cand in [path] + [os.path.join(d, p) for d in search for p in (path, os.path.basename(path))]:
        if cand and os.path.isfile(cand):
            return load_cmvn_file(cand), cand
    return None, f"MISSING: train.yaml names {path!r}, not found; pass data.cmvn yourself"


def convert(checkpoint: str, config: str, out_dir: str, write_cmvn: bool = True) -> str:
    """Write encoder.safetensors / encoder.yaml (/ global_cmvn.json); return the summary line."""
    from safetensors.torch import save_file

    from west.models.config import ConformerConfig
    from west.models.conformer import ConformerEncoder

    with open(config, encoding="utf-8") as f:
        conf = yaml.safe_load(f) or {}
    fields = encoder_config(conf)
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise Refusal(f"{checkpoint}: not a state dict ({type(state).__name__})")
    tensors, buffers = encoder_state(state, fields["subsampling_rate"])
    try:
        cfg = ConformerConfig(**fields)
    except ValueError as e:
        raise Refusal(f"train.yaml gives a config west rejects: {e}") from None
    model = ConformerEncoder(cfg)
    try:
        model.load_state_dict(tensors, strict=True)
    except RuntimeError as e:
        raise Refusal(f"the encoder tensors do not fit the config read from {config}: {e}") from None
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              os.path.join(out_dir, "encoder.safetensors"), metadata={"source": os.path.abspath(checkpoint)})
    with open(os.path.join(out_dir, "encoder.yaml"), "w", encoding="utf-8") as f:
        f.write(f"# converted from {checkpoint} ({config}) by tools/convert_wenet_checkpoint.py\n")
        section = {**cfg.to_dict(), "init": os.path.abspath(os.path.join(out_dir, "encoder.safetensors"))}
        yaml.safe_dump({"model": {"encoder": section}}, f, sort_keys=False)
    cmvn, source = find_cmvn(conf, buffers, [os.path.dirname(os.path.abspath(p)) for p in (config, checkpoint)])
    if cmvn is not None and write_cmvn:
        with open(os.path.join(out_dir, "global_cmvn.json"), "w", encoding="utf-8") as f:
            json.dump(cmvn, f)
    params = sum(t.numel() for t in tensors.values())
    return (f"{len(tensors)} tensors ({params / 1e6:.1f}M params): {cfg.num_blocks} blocks, d_model "
            f"{cfg.d_model}, {cfg.num_heads} heads, rate {cfg.subsampling_rate} -> {out_dir}; "
            f"cmvn: {source}")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--wenet_dir", help="a WeNet exp dir holding final.pt and train.yaml")
    p.add_argument("--checkpoint", help="WeNet model state dict (final.pt, avg_N.pt)")
    p.add_argument("--config", help="its train.yaml")
    p.add_argument("--out", required=True, help="output dir")
    p.add_argument("--no_cmvn", action="store_true", help="do not write global_cmvn.json")
    a = p.parse_args(argv)
    if a.wenet_dir:
        ckpt = a.checkpoint or os.path.join(a.wenet_dir, "final.pt")
        config = a.config or os.path.join(a.wenet_dir, "train.yaml")
    elif a.checkpoint and a.config:
        ckpt, config = a.checkpoint, a.config
    else:
        p.error("give --wenet_dir DIR, or both --checkpoint and --config")
    for path in (ckpt, config):
        if not os.path.isfile(path):
            print(f"convert_wenet_checkpoint: no such file: {path}", file=sys.stderr)
            return 2
    try:
        print(convert(ckpt, config, a.out, not a.no_cmvn))
    except Refusal as e:
        print(f"convert_wenet_checkpoint: refused: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
