"""west's packing for Hugging Face training (transformers ``Trainer``; TRL's ``SFTTrainer`` through
the same mixin): a batch sampler that plans packed rows with west's bin packer, balanced across
ranks and resumable; a collator that lays each planned group out as one packed row; and the
attention registration that makes any causal LM attend per sample.

    from west.hf import PackedTrainer, use_packed_attention
    model = use_packed_attention(AutoModelForCausalLM.from_pretrained(path))
    trainer = PackedTrainer(model=model, args=args, train_dataset=ds, pack_length=4096,
                            pad_token_id=tokenizer.pad_token_id)

Modules: ``sampler`` (PackedBatchSampler), ``collator`` (PackedCollator), ``trainer``
(PackingMixin, PackedTrainer, use_packed_attention).
"""
from west.hf.collator import PackedCollator
from west.hf.sampler import PackedBatchSampler
from west.hf.trainer import PackedTrainer, PackingMixin, use_packed_attention

__all__ = ["PackedBatchSampler", "PackedCollator", "PackedTrainer", "PackingMixin", "use_packed_attention"]
