import os

import torch

# Every rank the harness starts is one process on a 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Without a GPU the Triton kernels run in Triton's CPU interpreter (must be set before triton loads).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
