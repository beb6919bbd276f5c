"""west's packing for Hugging Face training (transformers ``Trainer``; TRL's ``SFTTrainer`` through
the same mixin): a batch sampler that plans packed rows with west's bin packer, balanced across
ranks and resumable; a collator that lays each planned group out as one packed row; and the
attention registration that makes a causal LM attend per sample, after checking that west computes
its attention exactly (softcapping, sinks and sliding windows included; anything else refused,
naming the setting, before any data is read).

    from west.hf import PackedTrainer, use_packed_attention
    model = use_packed_attention(AutoModelForCausalLM.from_pretrained(path))
    trainer = PackedTrainer(model=model, args=args, train_dataset=ds, pack_length=4096)

Modules: ``sampler`` (PackedBatchSampler), ``collator`` (PackedCollator), ``trainer``
(PackingMixin, PackedTrainer, use_packed_attention), ``support`` (what is exact, what is refused).
"""
from west.hf.collator import PackedCollator
from west.hf.sampler import PackedBatchSampler
from west.hf.trainer import PackedTrainer, PackingMixin, use_packed_attention

__all__ = ["PackedBatchSampler", "PackedCollator", "PackedTrainer", "PackingMixin", "use_packed_attention"]
