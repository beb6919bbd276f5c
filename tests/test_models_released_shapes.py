"""The published shapes the GPU suite times with random weights (tools/make_random_released.py) are the
released models' sizes: each configuration, built on the meta device (no weights), has the parameter
counts the releases publish, so a GPU call never times a mis-shaped model."""
import pytest
import torch

from west.models.whisper_encoder import hf_part

from helpers.speech import tiny_qwen2_5_omni_dir, tiny_qwen2_audio_dir, tiny_qwen3_asr_dir


def _counts(model, tower) -> tuple[float, float]:
    """(audio tower parameters, the language model's parameters outside its embeddings), in billions."""
    lm = hf_part(model, "language_model") if hasattr(model, "language_model") or hasattr(model.model, "language_model") \
        else model.model
    inner = sum(p.numel() for n, p in lm.named_parameters() if "embed_tokens" not in n)
    return sum(p.numel() for p in tower.parameters()) / 1e9, inner / 1e9


@pytest.mark.parametrize("kind", ["qwen2_audio", "qwen3_asr", "qwen2_5_omni"])
def test_release_shapes_have_the_published_sizes(tmp_path, kind):
    from transformers import AutoTokenizer

    if kind == "qwen2_audio":
        from transformers import Qwen2AudioForConditionalGeneration as cls

        from west.models.random_qwen2_audio import qwen2_audio_config as make
        path, shape, tower_b, llm_b, mels = tiny_qwen2_audio_dir(tmp_path), "7b", 0.637, 6.53, 128
    elif kind == "qwen3_asr":
        from transformers import Qwen3ASRForConditionalGeneration as cls

        from west.models.random_qwen3_asr import qwen3_asr_config as make
        path, shape, tower_b, llm_b, mels = tiny_qwen3_asr_dir(tmp_path), "1.7b", 0.31, 1.41, 128
    else:
        from transformers import Qwen2_5OmniThinkerForConditionalGeneration as cls

        from west.models.random_qwen2_5_omni import thinker_config as make
        path, shape, tower_b, llm_b, mels = tiny_qwen2_5_omni_dir(tmp_path), "7b", 0.64, 6.53, 128
    conf = make(AutoTokenizer.from_pretrained(path), shape=shape)
    with torch.device("meta"):
        model = cls(conf)
    tower, llm = _counts(model, hf_part(model))
    assert llm == pytest.approx(llm_b, rel=0.02)          # Qwen2-7B / Qwen2.5-7B: 6.53 B; Qwen3-1.7B: 1.4 B
    assert tower == pytest.approx(tower_b, rel=0.05)      # Whisper-large-v3's encoder; Qwen3-ASR's 0.3 B AuT
    assert conf.audio_config.num_mel_bins == mels
    with pytest.raises(ValueError, match="shape 'huge'"):
        make(AutoTokenizer.from_pretrained(path), shape="huge")
