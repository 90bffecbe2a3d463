"""Kernel tests run under the Triton interpreter on CPU machines, natively when a GPU is present."""

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first `import triton`

# the shared cache builder (int2_cache.py) sits beside the tests; pytest runs with --import-mode=importlib
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
