import os
import sys

# The oracle helpers import as plain modules from the tests folder.
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

# Tiny test models run fastest on one thread, and far faster when other processes share the CPU
# (scripts/test.sh sets OMP_NUM_THREADS=1 for the server subprocesses the same way).
torch.set_num_threads(1)
