import os
import sys

# The oracle helpers import as plain modules from the tests folder.
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

# Triton reads TRITON_INTERPRET when a kernel is decorated, which happens when its module is first imported —
# possibly while collecting any test file. On a machine without a GPU every kernel must be the interpreter's
# (a compiled one called from an interpreted kernel fails), so choose it before anything is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tiny test models run fastest on one thread, and far faster when other processes share the CPU
# (scripts/test.sh sets OMP_NUM_THREADS=1 for the server subprocesses the same way).
torch.set_num_threads(1)
