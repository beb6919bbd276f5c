"""Batch-mode benchmark: the same model and utterances trained in every batch mode.

``west.bench.benchmark.run_benchmark`` measures, ``west.bench.report`` renders the tables
and chart; ``west-benchmark`` (west/bin/benchmark.py) is the command line. Around them:
``op_counter`` (dispatched operators per step), ``sizing`` with ``memory_search``,
``trial_batches``, ``memory`` and ``peak`` (every mode at its largest size under a memory
budget, the seed's method, and MFU against a measured matrix-product peak).
"""
