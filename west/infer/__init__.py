"""Inference: restore a trained model, decode a data list, score the hypotheses.

``west.infer.decode`` generates, ``west.infer.scoring`` computes CER/WER;
``west-decode`` (west/bin/decode.py) is the command line.
"""
