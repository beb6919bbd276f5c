"""SpeechLLM: encoder (west.models.encoders) -> Projector -> spliced into a stock HF causal LM.

One forward for every batch mode (see west/batch.py):
* speech: the encoder runs padded (N, T, F)+feat_lens or packed (ΣT, F)+feat_cu_seqlens;
  projected frames overwrite the placeholder embeddings at ``speech_spans``;
* LLM: padded rows pass ``attention_mask`` (causal + padding mask; with west_varlen plain
  causal, exact for right padding); packed rows pass ``cu_seq_lens_*`` so attention stays
  inside each sample (west_varlen, flash-attn 2) or rely on position-id detection (stock
  eager/sdpa). Always ``use_cache=False``.
* host syncs: lengths, spans, boundaries and label positions are read from the batch's host
  copy (``Batch.host``) and index tensors reach the device by non-blocking copies, so a
  forward never waits for the GPU (tests/test_models_sync_free.py runs it on the meta device).
* loss: labels are pre-shifted, so CE(logits[t], labels[t]) with no shift; only
  label positions are projected to the vocabulary (the decoder's last hidden states at
  those positions times the output embedding: no (R, L, vocab) logits are ever built).
  With ``ctc_weight > 0`` a CTC head on the encoder output adds
  ``ctc_weight * CTC`` (summed over utterances, like the CE over tokens), so the
  step's per-token normalisation and the mode equivalence are unchanged.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from west.batch import Batch, to_device
from west.models.config import POSTERIOR_TYPES, ConformerConfig, SpeechLLMConfig
from west.models.ctc import segment_ctc
from west.models.encoders import encoder_class
from west.models.fused_norm import fuse_rms_norms
from west.models.hf_attention import ATTN_NAME, packed_kwargs
from west.models.llm import LoraInputCasts, apply_lora, decoder_layers, llm_checkpointing, load_llm
from west.models.loss import linear_cross_entropy
from west.models.projector import CompactPosteriorProjector, LinearProjector, PosteriorProjector, Projector
from west.models.shared_prefix import KeyRows


def build_encoder(cfg: ConformerConfig, attn_backend: str = "auto") -> nn.Module:
    """The encoder of ``model.encoder.type``, from its entry in west.models.encoders."""
    return encoder_class(cfg.type).from_config(cfg, attn_backend)


def freeze_encoder_blocks(encoder: nn.Module, n: int) -> None:
    """Freeze the encoder's front end and its first ``n`` blocks (what that means: the encoder's
    ``freeze_blocks``). The rest, and the final norm, stay as they are: a pretrained encoder's low
    blocks keep their acoustics."""
    encoder.freeze_blocks(n)


class SpeechLLM(nn.Module):
    def __init__(self, cfg: SpeechLLMConfig, llm: Optional[nn.Module] = None):
        super().__init__()
        self.cfg = cfg
        self.encoder = build_encoder(cfg.encoder, cfg.llm.attn_backend)
        self.shape = cfg.speech_shape()
        llm = llm if llm is not None else load_llm(cfg.llm)
        hidden = llm.config.get_text_config().hidden_size
        if cfg.projector.type in POSTERIOR_TYPES:
            kind = CompactPosteriorProjector if cfg.projector.type == "ctc_compact" else PosteriorProjector
            self.projector = kind(cfg.projector)
        else:
            kind = LinearProjector if cfg.projector.type == "linear" else Projector
            self.projector = kind(self.encoder.output_dim, hidden, cfg.projector)
        released = self.encoder.pretrained_projector()   # a released model's own projector
        if released is not None:
            self.projector.load_state_dict(released)
        if cfg.freeze_encoder:
            self.encoder.requires_grad_(False)
        freeze_encoder_blocks(self.encoder, cfg.freeze_encoder_blocks)
        if cfg.freeze_llm or cfg.lora is not None:
            llm.requires_grad_(False)
        if cfg.llm.fused_norm:
            fuse_rms_norms(llm)
        if cfg.llm.gradient_checkpointing:
            llm_checkpointing(llm, cfg.llm)
        self.llm = apply_lora(llm, cfg.lora) if cfg.lora is not None else llm
        self.lora_casts = LoraInputCasts(self.llm) if cfg.lora is not None else None   # matched to autocast per call
        self.ctc_head: Optional[nn.Linear] = None
        self.blank_embedding: Optional[nn.Parameter] = None
        if cfg.ctc_weight > 0:   # classes: the LLM vocabulary [, then an extra blank]
            vocab = llm.config.get_text_config().vocab_size
            if cfg.ctc_blank is not None and cfg.ctc_blank >= vocab:
                raise ValueError(f"model.ctc_blank {cfg.ctc_blank} is outside the LLM vocabulary ({vocab})")
            extra = cfg.ctc_blank is None
            self.ctc_head = nn.Linear(self.encoder.output_dim, vocab + extra)
            if extra and cfg.projector.type in POSTERIOR_TYPES:
                self.blank_embedding = nn.Parameter(torch.zeros(hidden))

    def gradient_checkpointing_enable(self) -> None:
        """Recompute activations in backward: encoder blocks and LLM layers (trainer hook)."""
        self.encoder.gradient_checkpointing = True
        llm_checkpointing(self._base_llm(), self.cfg.llm)

    def fsdp_units(self) -> list[nn.Module]:
        """Modules FSDP2 shards one by one: each encoder block and each LLM decoder layer.

        Embeddings, head, projector and norms stay in the root unit (tied input/output
        embeddings must share one unit), so peak memory is one layer's full weights."""
        return [*self.encoder.fsdp_units(), *decoder_layers(self._base_llm())]

    # ------------------------------------------------------------------ shapes
    def num_speech_tokens(self, n_frames: int) -> int:
        return self.shape.slots(n_frames)

    # ------------------------------------------------------------------ inputs
    def encode_speech(self, batch: Batch) -> Optional[torch.Tensor]:
        """(Σ slots, H) projected speech embeddings in ``batch.feats`` order (None if no speech)."""
        out = self._encode(batch)
        return None if out is None else out[0]

    def _encode(self, batch: Batch):
        """(projected embeddings, encoder frames (Σ T', D), their lengths, CTC logits or None) or None."""
        if batch.feats is None or batch.speech_spans is None or batch.speech_spans.shape[0] == 0:
            return None
        host = batch.host   # lengths and spans are read on the host: no device sync
        if not batch.encoder_packed and batch.feat_lens is None:
            raise ValueError("padded encoder feats need batch.feat_lens")
        x, layout = self.encoder.forward_flat(batch.feats, **batch.encoder_inputs())
        rows = layout.real_rows()
        if rows is not None:
            x = x.index_select(0, rows)
        expected = self.projector.output_lengths(layout.lengths)
        spans = host.speech_spans.detach().cpu()
        if spans.shape[0] != len(expected) or spans[:, 2].tolist() != expected:
            raise ValueError(
                f"speech_spans lengths {spans[:, 2].tolist()} != encoder+projector output {expected} "
                f"({self.shape}); keys={batch.keys}")
        if isinstance(self.projector, PosteriorProjector):
            logits = self.ctc_head(x)
            extra = (self.ctc_blank_id,) if isinstance(self.projector, CompactPosteriorProjector) else ()
            speech = self.projector(logits, layout.lengths, self._ctc_class_embeddings(), *extra)
            return speech, x, layout.lengths, logits
        return self.projector(x, layout.lengths), x, layout.lengths, None

    @property
    def ctc_blank_id(self) -> int:
        """Class index of the CTC blank (the extra last class unless model.ctc_blank names a token)."""
        return self.cfg.ctc_blank if self.cfg.ctc_blank is not None else self.ctc_head.out_features - 1

    def _ctc_class_embeddings(self) -> torch.Tensor:
        """(CTC classes, H): the LLM's input embedding of every class (blank: its own vector)."""
        table = self.llm.get_input_embeddings().weight
        if self.blank_embedding is not None:
            table = torch.cat([table, self.blank_embedding[None].to(table.dtype)])
        return table[: self.ctc_head.out_features]
    def embed(self, batch: Batch) -> torch.Tensor:
        """LLM input embeddings (R, L, H) with speech spliced in at ``speech_spans``."""
        return self._embed(batch)[0]

    def _embed(self, batch: Batch):
        """(embeddings, encoder output as in :meth:`_encode` or None)."""
        embeds = self.llm.get_input_embeddings()(batch.input_ids)
        encoded = self._encode(batch)
        if encoded is None:
            return embeds, None
        speech = encoded[0]
        spans = batch.host.speech_spans.detach().cpu()   # index arithmetic on the host, then one copy each
        lens = spans[:, 2]
        rows = torch.repeat_interleave(spans[:, 0], lens)
        first = torch.repeat_interleave(spans[:, 1] - torch.cumsum(lens, 0) + lens, lens)
        cols = first + torch.arange(rows.numel())
        if rows.numel() and (int(cols.max()) >= embeds.shape[1] or int(rows.max()) >= embeds.shape[0]):
            raise ValueError(f"speech_spans point outside input_ids {tuple(batch.input_ids.shape)}; keys={batch.keys}")
        rows, cols = to_device(rows, embeds.device), to_device(cols, embeds.device)
        return embeds.index_put((rows, cols), speech.to(embeds.dtype)), encoded

    def _decode(self, embeds: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The LLM decoder's last hidden state. Packed rows attend per segment (:meth:`decode_packed`). Padded rows get
        plain causal attention where it is exact (right padding: a real token never sees a pad)
        instead of a padding mask. Models whose masks come as a per-layer-type mapping (Qwen2/3,
        Gemma2 …) get that mapping with no mask in it, so transformers does not build one, nor
        read position ids back from the device to look for packed rows."""
        if self.lora_casts is not None:
            self.lora_casts.match(embeds.device.type)
        if batch.is_packed:
            args = (embeds, batch.position_ids, batch.cu_seqlens, self._host_cu(batch), batch.max_seqlen)
            return self.decode_packed(*args, keys=self._key_rows(batch))
        no_mask = self._no_mask()
        return self._base_llm().get_decoder()(
            inputs_embeds=embeds, position_ids=batch.position_ids, use_cache=False,
            attention_mask=no_mask if no_mask is not None else batch.attention_mask).last_hidden_state

    @staticmethod
    def _host_cu(batch: Batch) -> torch.Tensor:
        """The packed batch's host cu_seqlens, checked against its token count."""
        total, host_cu = batch.input_ids.numel(), batch.host.cu_seqlens
        if int(host_cu[-1]) != total:
            raise ValueError(f"cu_seqlens ends at {int(host_cu[-1])}, batch has {total} tokens")
        return host_cu

    @staticmethod
    def _key_rows(batch: Batch) -> Optional[KeyRows]:
        """Each segment's keys where the row's samples share a prompt prefix (data.shared_prefix)."""
        if batch.key_index is None:
            return None
        host = batch.host   # checked on the host copy once per batch, as cu_seqlens is (_host_cu)
        if int(host.key_cu_seqlens[-1]) != host.key_index.numel():
            raise ValueError(f"key_cu_seqlens ends at {int(host.key_cu_seqlens[-1])}, key_index has "
                             f"{host.key_index.numel()} rows; keys={batch.keys}")
        return KeyRows(batch.key_index, batch.key_cu_seqlens, int(batch.key_max_seqlen), host.key_index,
                       host.key_cu_seqlens)

    def _no_mask(self) -> Optional[dict]:
        conf = self._base_llm().config
        # stock attention implementations need transformers' own mask (or its packed-row detection)
        west = getattr(conf, "_attn_implementation", None) == ATTN_NAME
        return {t: None for t in set(conf.layer_types)} if west and getattr(conf, "layer_types", None) else None

    def _packed_kwargs(self, cu: torch.Tensor, host_cu: Optional[torch.Tensor], max_seqlen: Optional[int],
                       keys: Optional[KeyRows] = None) -> dict:
        west = getattr(self._base_llm().config, "_attn_implementation", None) == ATTN_NAME
        kw = packed_kwargs(cu, max_seqlen, self.cfg.llm.attn_backend, west_extras=west, host_cu_seqlens=host_cu,
                           keys=keys)
        return dict(attention_mask=self._no_mask(), **kw)

    def decode_packed(self, embeds: torch.Tensor, position_ids: torch.Tensor, cu: torch.Tensor,
                      host_cu: Optional[torch.Tensor], max_seqlen: Optional[int],
                      keys: Optional[KeyRows] = None) -> torch.Tensor:
        """The LLM decoder's last hidden state on one packed row (1, L, d)."""
        return self._base_llm().get_decoder()(inputs_embeds=embeds, position_ids=position_ids, use_cache=False,
                                              **self._packed_kwargs(cu, host_cu, max_seqlen, keys)).last_hidden_state

    def _base_llm(self) -> nn.Module:
        return self.llm.get_base_model() if hasattr(self.llm, "get_base_model") else self.llm

    # ------------------------------------------------------------------ training
    def forward(self, batch: Batch) -> dict:
        """-> dict(loss_sum=summed CE over label tokens [+ ctc_weight * summed CTC], n_tokens=int (host),
        n_correct (0-d tensor on the device: reading it is the caller's sync), ce_sum, and with a CTC
        head ctc_sum / ctc_utts / ctc_infeasible)."""
        embeds, encoded = self._embed(batch)
        host_where = batch.label_positions()                         # found on the host copy of the labels
        vocab = self._base_llm().get_output_embeddings().weight.shape[0]
        host_target = batch.host.labels.reshape(-1)[host_where]
        if bool(((host_target < 0) | (host_target >= vocab)).any()):   # checked here, on the host copy
            raise ValueError(f"labels {sorted(set(host_target[(host_target < 0) | (host_target >= vocab)].tolist()))[:5]} "
                             f"are outside the LLM's vocabulary [0, {vocab}); keys={batch.keys}")
        where = to_device(host_where, embeds.device)
        target = batch.labels.to(embeds.device).reshape(-1).index_select(0, where)
        ce_sum, n_correct = self._label_loss(embeds, batch, where, target)
        out = dict(loss_sum=ce_sum, ce_sum=ce_sum.detach(), n_tokens=int(where.numel()), n_correct=n_correct)
        if self.ctc_head is not None:
            ctc = self.ctc_loss(batch, encoded)
            out.update(loss_sum=ce_sum + self.cfg.ctc_weight * ctc["ctc_sum"],
                       ctc_sum=ctc["ctc_sum"].detach(), ctc_utts=ctc["ctc_utts"],
                       ctc_infeasible=ctc["ctc_infeasible"])
        return out

    def _label_loss(self, embeds: torch.Tensor, batch: Batch, where: torch.Tensor,
                    target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed CE, correct argmax count) over the label positions ``where`` (flat indices): the
        LLM's decoder, then its output embedding on those positions only (transformers releases
        differ in whether ``logits_to_keep`` takes a mask). Both stay on the device."""
        base = self._base_llm()
        conf = base.config
        if getattr(conf, "final_logit_softcapping", None) or getattr(conf, "logit_scale", None):
            raise NotImplementedError(f"{type(base).__name__} post-processes its logits; west's loss path "
                                      "projects hidden states with the output embedding only")
        hidden = self._decode(embeds, batch)
        h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, where)
        head = base.get_output_embeddings()
        if type(head) is not nn.Linear:
            raise NotImplementedError(f"{type(base).__name__}'s output embedding is a {type(head).__name__}; "
                                      "west's loss multiplies by a plain Linear's weight")
        return linear_cross_entropy(h, head.weight, target, bias=head.bias, chunk_rows=self.cfg.loss_chunk_rows,
                                    impl=self.cfg.loss)

    def ctc_loss(self, batch: Batch, encoded) -> dict:
        """Summed CTC of every speech segment that has a transcript (blank: :attr:`ctc_blank_id`,
        which must be a token transcripts never contain, e.g. the pad token).

        A transcript of K tokens with R adjacent repeats needs K + R encoder frames;
        a segment with fewer cannot be aligned, adds 0 and is counted in ``ctc_infeasible``."""
        zero = self.ctc_head.weight.sum() * 0.0   # keeps the head in the graph (DDP) on any batch
        lens = batch.host.ctc_target_lens
        if encoded is None or lens is None or int(lens.sum()) == 0:
            return dict(ctc_sum=zero, ctc_utts=0, ctc_infeasible=0)
        _, x, frames, logits = encoded
        if lens.shape[0] != len(frames):
            raise ValueError(f"{lens.shape[0]} CTC targets for {len(frames)} speech segments; keys={batch.keys}")
        logits = logits if logits is not None else self.ctc_head(x)
        total, utts, infeasible = segment_ctc(logits, frames, lens.tolist(), batch.host.ctc_targets.tolist(),
                                              self.ctc_blank_id)
        return dict(ctc_sum=total + zero, ctc_utts=utts, ctc_infeasible=infeasible)

    # ------------------------------------------------------------------ decoding
    @torch.no_grad()
    def generate(
        self,
        batch: Batch,
        max_new_tokens: int = 128,
        num_beams: int = 1,
        eos_token_id: Optional[int | list] = None,
        pad_token_id: Optional[int] = None,
        **generate_kwargs,
    ) -> list[list[int]]:
        """Greedy (num_beams=1) or beam search from prompts in a padded batch (one per row,
        right padded, no transcript). Returns new token ids per row, cut before the first eos."""
        if batch.is_packed:
            raise ValueError("generate() needs a padded batch (one prompt per row), got a packed one")
        embeds = self.embed(batch)
        r, length = batch.input_ids.shape
        mask = batch.attention_mask if batch.attention_mask is not None else torch.ones_like(batch.input_ids)
        mask = mask.to(embeds.device).long()
        # right -> left padding: generation appends after the last column.
        shift = length - mask.sum(1, keepdim=True)
        idx = (torch.arange(length, device=embeds.device)[None, :] - shift) % length
        embeds = embeds.gather(1, idx[..., None].expand(-1, -1, embeds.shape[-1]))
        mask = mask.gather(1, idx)
        gen_cfg = self._base_llm().generation_config
        eos = eos_token_id if eos_token_id is not None else gen_cfg.eos_token_id
        pad = pad_token_id if pad_token_id is not None else gen_cfg.pad_token_id
        pad = pad if pad is not None else _first(eos)
        if self.lora_casts is not None:
            self.lora_casts.match(embeds.device.type)
        out = self.llm.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=max_new_tokens,
                                num_beams=num_beams, do_sample=False, eos_token_id=eos, pad_token_id=pad,
                                use_cache=True, **generate_kwargs)
        stops = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
        results = []
        for row in out.tolist():
            cut = next((i for i, t in enumerate(row) if t in stops), len(row))
            results.append(row[:cut])
        return results


def _first(x):
    return x[0] if isinstance(x, (list, tuple)) else x
