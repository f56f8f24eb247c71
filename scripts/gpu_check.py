"""On the GPU machine: the reference path on CUDA equals the CPU reference (fp32), and bf16 stays close.

Prints one line per tiny preset; exits non-zero on a mismatch. Run: python3 scripts/gpu_check.py
"""
import sys
import time

import torch

from flashnext.engine.loading import load_model
from flashnext.models.session import Session
from gpu_common import rel

PRESETS = ["tiny-flash-next", "tiny-qwen3-next", "tiny-qwen3.5-moe"]


def main() -> int:
    ok = True
    ids = torch.randint(3, 480, (150,), generator=torch.Generator().manual_seed(0))
    print(f"{'preset':20} {'cuda fp32 vs cpu':>18} {'cuda bf16 vs cpu':>18} {'greedy agree':>13}")
    for name in PRESETS:
        ref_model = load_model(name, "cpu", torch.float32).model
        ref = Session(ref_model, 256).extend(ids, all_logits=True)
        out = {}
        for dtype in (torch.float32, torch.bfloat16):
            model = load_model(name, "cuda", dtype).model
            s = Session(model, 256)
            first = s.extend(ids[:100], all_logits=True)
            steps = torch.stack([s.extend(ids[i:i + 1]) for i in range(100, 150)])
            out[dtype] = torch.cat([first, steps]).float().cpu()
        e32, e16 = rel(out[torch.float32], ref), rel(out[torch.bfloat16], ref)
        agree = (out[torch.bfloat16].argmax(-1) == ref.argmax(-1)).float().mean().item()
        ok &= e32 < 1e-4
        print(f"{name:20} {e32:18.2e} {e16:18.2e} {agree:13.2%}")
    return 0 if ok else 1


if __name__ == "__main__":
    t = time.time()
    code = main()
    print(f"gpu_check {'passed' if code == 0 else 'FAILED'} in {time.time() - t:.1f} s")
    sys.exit(code)
