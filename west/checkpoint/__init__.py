"""Every format west writes weights in, and reading them back: one home.

* ``files``: fsynced writes and the one tied-weight rule for safetensors;
* ``base_llm``: the one way to refer to a frozen base LLM that is not stored (path + fingerprint);
* ``model_state``: what of a model a training checkpoint stores (lean state, LoRA adapters) and
  the checks before loading it;
* ``integrity``: which ``step_*`` dir is whole enough to resume from;
* ``training``: collective, atomic training checkpoints (model, optimizer, schedule, RNG, data);
* ``pretrained``: a SpeechLLM as a directory (``save_speech_llm``) and ``west-export``'s format;
* ``restore``: any of them back as a model + tokenizer, for decoding and export.

Imports models and west.ranks; imported by train, infer, bin and tools, never the reverse.
"""
