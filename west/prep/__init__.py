"""Corpus preparation: Kaldi-style data dirs -> west data lists.

Shared by the preparation tools (tools/make_data_list.py, tools/prepare_aishell.py), so
that one writer of the list format exists and the tools stay thin command lines.
"""
