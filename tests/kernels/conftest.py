import os

import torch

# Triton kernels run on the CPU only in interpreter mode; the flag is read when kernels/ is first
# imported (at @triton.jit decoration), so set it before the test modules import the kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
