"""What many test files share, one module per concern (tests/ is on sys.path: ``from helpers.x import y``).

* ``corpus``: noise audio, jsonl lists and transcripts made on the fly;
* ``batches``: the padded and packed row layouts every hand-made Batch uses;
* ``speech``: tiny SpeechLLM configs, speech samples and their batches, LoRA models, a tiny Whisper;
* ``fakes``: a token-level model and resumable list data for the trainer's own tests;
* ``steps``: the reference SGD step the step and DDP tests compare against;
* ``ranks``: processes, ports and gloo groups for multi-rank tests;
* ``threads``: one intra-op thread for a block;
* ``e2e``: the recipe's tiny model and lists for end-to-end runs.
"""
