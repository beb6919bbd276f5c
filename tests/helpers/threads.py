"""One intra-op thread for a block: tiny shapes run faster, immune to a busy shared CPU, and two
processes compare the same arithmetic."""
from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def torch_threads(n: int = 1) -> Iterator[None]:
    import torch  # heavy: conftest imports this module before any test needs torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
