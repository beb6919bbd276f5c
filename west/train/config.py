"""The ``run`` (where a run reads and writes) and ``train`` (how it optimises) sections; keys: docs/config.md."""
from __future__ import annotations

import os
from typing import Optional

from west.infer.scoring import NORMALIZERS
from west.schema import section, setting
from west.train.preempt import is_catchable


@section("run")
class RunConfig:
    output_dir: str = ""
    train_data: list[str] = setting([])  # --train_data a.list,b.list; YAML: paths or {path, weight}
    cv_data: str = ""                      # --cv_data LIST: dev list evaluated during training; "" = none
    resume: str = setting("auto", rule=(lambda v, _: v in ("auto", "never", "must") or os.path.isdir(v),
                                        "must be auto, never, must or an existing checkpoint dir"))
    audit: bool = False


@section("train")
class TrainConfig:
    seed: int = 42
    lr: float = setting(1e-4, gt=0)
    lr_encoder: Optional[float] = setting(None, gt=0)    # peak lr per module; None = train.lr
    lr_projector: Optional[float] = setting(None, gt=0)
    lr_llm: Optional[float] = setting(None, gt=0)
    projector_warmup_steps: int = setting(0, min=0, rule=(  # steps that move only the projector side
        lambda v, t: v == 0 or t.max_steps == 0 or v < t.max_steps, "must be < train.max_steps"))
    min_lr_ratio: float = setting(0.0, min=0, max=1)  # cosine floor as a fraction of lr
    warmup_steps: int = setting(100, min=0)
    max_steps: int = setting(0, min=0, rule=(      # 0 = no step limit (max_epochs decides)
        lambda v, t: v > 0 or t.max_epochs > 0, "must be > 0 when train.max_epochs is 0 (the run would never end)"))
    max_epochs: int = setting(1, min=0)             # 0 = no epoch limit (max_steps decides)
    accum_steps: int = setting(1, min=1)            # micro-batches per optimizer step (per rank)
    grad_clip: float = setting(1.0, min=0)          # max global grad norm; 0 = off (norm still logged)
    weight_decay: float = setting(0.01, min=0)
    betas: list[float] = setting([0.9, 0.999], rule=(lambda v, _: len(v) == 2 and all(0 <= b < 1 for b in v),
                                                     "must be two numbers in [0, 1)"))
    eps: float = 1e-8
    precision: str = setting("fp32", choices=("fp32", "bf16"))  # bf16: autocast, master weights stay fp32
    grad_checkpointing: bool = False
    compile: bool = False                           # regional torch.compile of the repeated blocks
    encoder_graphs: str = setting("false", choices=("false", "true", "auto"))  # the Conformer's blocks as CUDA
    #   graphs, fwd + bwd, rows padded; auto: true where that runs (one CUDA process, bf16; the start says why not)
    encoder_graph_rows: int = setting(0, min=0)     # encoder_graphs: rows per pack; 0 = the planned packs' most
    encoder_graph_segments: int = setting(0, min=0)  # encoder_graphs: segment slots (utterances + padding); 0 = planned
    encoder_graph_max_len: int = setting(0, min=0)   # encoder_graphs: the longest utterance, in frames; 0 = planned
    fsdp: bool = False                              # FSDP2 fully_shard instead of DDP
    late_readback: bool = setting(False, rule=(     # the step's figures read back one step late: no host wait
        lambda v, t: not (v and t.fsdp), "not with train.fsdp (its sharded parameters take no fused AdamW; "
        "seed_gpu.yaml sets it: add --train.late_readback false)"))
    find_unused_parameters: bool = False
    device: str = setting("auto", choices=("auto", "cpu", "cuda"))
    dist_timeout_s: int = setting(1800, gt=0)       # no collective waits longer than this
    max_bad_steps: int = setting(10, min=1)         # NaN/inf steps in a row before stopping
    log_every: int = setting(10, min=1)             # console/TensorBoard period (jsonl: every step)
    save_every: int = setting(1000, min=0)          # steps between checkpoints; 0 = epoch ends only
    save_at_epoch_end: bool = True
    save_at_end: bool = True                        # a run that ends normally saves its last step
    keep_last: int = setting(3, min=1)
    preempt_signals: list[str] = setting(["SIGTERM", "SIGUSR1"], rule=(  # [] = off (west.train.preempt)
        lambda v, _: all(is_catchable(s) for s in v),
        "must be signal names such as SIGTERM, SIGUSR1, or [] for none (SIGKILL and SIGSTOP cannot be caught)"))
    save_frozen_llm: bool = False                   # false: the frozen LLM is referred to by path and SHA-256
    eval_every: int = setting(0, min=0)             # steps between dev evaluations; 0 = epoch ends only
    eval_decode_utts: int = setting(0, min=0)       # greedy-decode the first N dev utterances (CER/WER)
    eval_max_new_tokens: int = setting(64, min=1)
    eval_normalizer: str = setting("none", choices=tuple(NORMALIZERS))  # text normalizer of the dev CER/WER
    #   (west.infer.scoring; also west-decode's default for the run)
    keep_best: int = setting(0, min=0)              # also keep the N best checkpoints by best_metric
    best_metric: str = setting("cv_loss", choices=("cv_loss", "cv_cer", "cv_wer"), rule=(
        lambda v, t: v == "cv_loss" or t.eval_decode_utts > 0, "cv_cer and cv_wer need dev decoding: "
        "train.eval_decode_utts > 0"))
    tensorboard: bool = True
    progress_bar: bool = True
    nvml: bool = True                               # GPU busy %/memory sampler on CUDA
    monitor_interval_s: float = setting(0.2, gt=0)
    profile: bool = False                           # torch.profiler trace to DIR/profile
    profile_wait: int = setting(5, min=0)
    profile_active: int = setting(5, min=1)
