"""Batch-mode benchmark: the same model and utterances trained in every batch mode.

``west.bench.benchmark.run_benchmark`` measures, ``west.bench.report`` renders the tables
and chart; ``west-benchmark`` (west/bin/benchmark.py) is the command line.
"""
