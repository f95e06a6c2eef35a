"""Triton kernels, each beside a plain-torch reference with the same contract.

Without a CUDA device the kernels run under Triton's interpreter; ``triton.jit`` reads
``TRITON_INTERPRET`` when a kernel module is imported, so it is set here, before any of them.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
