"""Models: packed Conformer encoder, projector, SpeechLLM over a stock HF causal LM.

Entry points (import the submodules; this package stays light on purpose):
* ``west.models.speech_llm.SpeechLLM`` / ``west.models.config.SpeechLLMConfig``
* ``west.models.hf_attention.register`` (the ``west_varlen`` attention for HF models)
* ``west.models.attention`` (packed-attention backends and the float64 reference)
See docs/exactness.md for how packing is kept exact.
"""
