"""Random-weight models built straight in memory on the device, with no checkpoint on disk.

Full-size Flash-Next (177B parameters) cannot be synthesised to disk (173 GB) nor hold its routed experts in bf16
(240 GB), so `build_synthetic_model` builds the model on "meta" and materialises it tensor by tensor where it will
run: INT4 targets (routed experts, and the dense projections of flashnext.models.quantize.INT4_PROJECTIONS) get
random packed codes and random scales directly, never a 16-bit copy; everything else is drawn on the device like
weights/synth.py draws it; the PLE n-gram table is filled chunk by chunk on the device and copied into pinned host
memory (or kept on the device), in the model dtype or as float8_e4m3fn with one fp32 scale (the FP8 release's
format, 51 GB instead of 102 GB).

The values follow the same distributions as `synthesize` (`_init`), not the same numbers: the generators run on
the device and INT4 codes are drawn directly instead of quantising a drawn tensor. Zero-mean throughout, scale
signs included (PERF.md: positive-only scales route every token to the same few experts).
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
import zlib
from pathlib import Path

import torch
from torch import nn

from flashnext.models import build_model
from flashnext.models.layers.int4_experts import Int4Experts, expert_group_size
from flashnext.models.layers.int4_linear import Int4Linear
from flashnext.models.layers.moe import Experts
from flashnext.models.layers.rope import RotaryEmbedding
from flashnext.models.layers.row_table import RowTable, choose_placement
from flashnext.weights.pinned import host_empty
from flashnext.models.quantize import dense_int4_targets, group_size_for
from flashnext.weights.config import ModelConfig
from flashnext.weights.int4_layout import Int4Weight
from flashnext.weights.presets import generation_config, get_preset
from flashnext.weights.synth import _generator, _init, _write_tokenizer, arch_of, random_tensor

log = logging.getLogger("flashnext.weights")

BF16_EXPERTS_LIMIT = 8 << 30  # refuse to draw more routed-expert bytes than this in 16 bits
GROUP_SIZE = 128
# Uniform codes q in 0..15 give E[(q - 8)^2] = 21.5; |scale| uniform in [0.5, 1.5]·s gives E[scale^2] = 13/12·s^2.
_CODE_SECOND_MOMENT = 21.5 * 13 / 12
_FP8 = torch.float8_e4m3fn
_FP8_MAX = 448.0
_TABLE_CHUNK = 1 << 27  # table elements drawn at once: a 512 MB fp32 temporary on the device
_EXPERTS_PER_CHUNK = 64


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_int4(name: str, num_out: int, num_in: int, group: int, *, experts: int | None, seed: int,
                device: torch.device) -> Int4Weight:
    """Symmetric INT4 weight(s) [E?, N, K] whose dequantised values have mean 0 and the std `_init` gives `name`:
    uniform nibbles and scales of random sign and magnitude, drawn in chunks of experts."""
    lead = () if experts is None else (experts,)
    _, _, std = _init(name, (*lead, num_out, num_in))
    generator = _generator(seed, name + "#int4", device)
    qweight = torch.empty(*lead, num_in // 8, num_out, dtype=torch.int32, device=device)
    scales = torch.empty(*lead, num_in // group, num_out, dtype=torch.bfloat16, device=device)
    chunks = zip(qweight.split(_EXPERTS_PER_CHUNK), scales.split(_EXPERTS_PER_CHUNK)) if lead else [(qweight, scales)]
    for q, s in chunks:
        q.random_(-(1 << 31), 1 << 31, generator=generator)  # all 32 bits uniform: eight uniform nibbles
        sign = torch.randint(0, 2, s.shape, generator=generator, device=device).mul_(2).sub_(1)
        magnitude = torch.rand(s.shape, generator=generator, device=device).add_(0.5)
        s.copy_(magnitude.mul_(sign).mul_(std / math.sqrt(_CODE_SECOND_MOMENT)))
    return Int4Weight(qweight, scales, None, None, group)


def _materialise_experts(model: nn.Module, seed: int, device: torch.device) -> int:
    nbytes = 0
    for name, module in [(n, m) for n, m in model.named_modules() if isinstance(m, Experts)]:
        num_experts, two_i, hidden = module.gate_up_proj.shape
        gate_up = random_int4(f"{name}.gate_up_proj", two_i, hidden, expert_group_size(hidden, GROUP_SIZE),
                              experts=num_experts, seed=seed, device=device)
        down = random_int4(f"{name}.down_proj", hidden, two_i // 2, expert_group_size(two_i // 2, GROUP_SIZE),
                           experts=num_experts, seed=seed, device=device)
        owner, _, child = name.rpartition(".")
        setattr(model.get_submodule(owner), child, Int4Experts(gate_up, down))
        nbytes += sum(t.numel() * t.element_size() for w in (gate_up, down) for t in w.tensors().values())
    return nbytes


def _materialise_dense_int4(model: nn.Module, seed: int, device: torch.device) -> int:
    """Int4Linear for every INT4 target whose shape allows it (quantize_dense_int4's rule); others stay 16-bit."""
    nbytes = 0
    for full in dense_int4_targets(model):
        owner, _, child = full.rpartition(".")
        linear = getattr(model.get_submodule(owner), child)
        group = group_size_for(linear.in_features, GROUP_SIZE)
        if group is None or linear.out_features % 8:
            continue
        if linear.bias is not None:
            raise ValueError(f"{full} has a bias: synthetic weights have no rule for biases")
        weight = random_int4(f"{full}.weight", linear.out_features, linear.in_features, group, experts=None,
                             seed=seed, device=device)
        setattr(model.get_submodule(owner), child, Int4Linear(weight))
        nbytes += sum(t.numel() * t.element_size() for t in weight.tensors().values())
    return nbytes


def _materialise_table(name: str, table: RowTable, *, seed: int, device: torch.device, dtype: torch.dtype,
                       store: torch.dtype, placement: str) -> None:
    """Draw the table chunk by chunk on the device; copy each chunk where the table lives (pinned host memory for
    "host" on a GPU: the copy is one DMA). fp8 storage: one scale of 8σ/448, as a release's amax/448 would be."""
    num_rows, dim = table.weight.shape
    _, mean, std = _init(name, (num_rows, dim))
    scale = std * 8 / _FP8_MAX if store == _FP8 else None
    pin = placement == "host" and device.type == "cuda"
    start = time.perf_counter()
    out = (host_empty((num_rows, dim), store, pin) if placement == "host"
           else torch.empty(num_rows, dim, dtype=store, device=device))
    pinned_s = time.perf_counter() - start
    generator = _generator(seed, name, device)
    chunk_rows = max(1, _TABLE_CHUNK // dim)
    next_report = 0.1
    for first in range(0, num_rows, chunk_rows):
        rows = min(chunk_rows, num_rows - first)
        values = torch.randn(rows, dim, generator=generator, device=device).mul_(std).add_(mean)
        if scale is not None:
            values = values.div_(scale).clamp_(-_FP8_MAX, _FP8_MAX)
        out[first: first + rows].copy_(values.to(store))
        if (first + rows) / num_rows >= next_report and num_rows > 100 * chunk_rows:
            log.info("PLE table: %3.0f%% of %.1f GB", 100 * (first + rows) / num_rows,
                     out.numel() * out.element_size() / 1e9)
            next_report += 0.1
    _sync(device)
    seconds = time.perf_counter() - start
    nbytes = out.numel() * out.element_size()
    log.info("PLE table %s [%d, %d] %s on %s: %.1f GB in %.1f s (%.1f s to pin), %.1f GB/s", name, num_rows, dim,
             store, "pinned host memory" if pin else placement, nbytes / 1e9, seconds, pinned_s,
             nbytes / 1e9 / max(seconds, 1e-9))
    table.set_weight(out, None if scale is None else torch.tensor(scale), placement)
    table.compute_dtype = dtype


def _materialise_rest(model: nn.Module, seed: int, device: torch.device, dtype: torch.dtype, cfg: ModelConfig) -> int:
    """Every parameter still on "meta" drawn like synth.py; RoPE frequencies rebuilt; other buffers were derived."""
    nbytes = 0
    for module_name, module in model.named_modules():
        for leaf, param in list(module._parameters.items()):
            if param is None or param.device.type != "meta":
                continue
            name = f"{module_name}.{leaf}" if module_name else leaf
            value = random_tensor(name, tuple(param.shape), seed=seed, dtype=dtype, device=device)
            module._parameters[leaf] = nn.Parameter(value, requires_grad=False)
            nbytes += value.numel() * value.element_size()
        if isinstance(module, RotaryEmbedding):
            module.inv_freq = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta).inv_freq.to(device)
        for leaf, buffer in module._buffers.items():
            assert buffer is None or buffer.device.type != "meta", f"no synthetic value for buffer {module_name}.{leaf}"
    return nbytes


def build_synthetic_model(cfg: ModelConfig, device, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                          int4: bool = True, ple_placement: str = "host",
                          ple_dtype: torch.dtype | None = None) -> nn.Module:
    """A ready-to-run random-weight model (eval, no grad) on `device`; see the module doc.

    int4: routed experts → Int4Experts and the dense INT4 targets → Int4Linear (symmetric, group 128 or the
    largest fitting one), as `--quantize int4` would make them; else all 16-bit (refused when the routed experts
    alone would exceed BF16_EXPERTS_LIMIT). ple_placement: "host" | "device" | "auto" (host above 4 GiB).
    ple_dtype: the table's storage, `dtype` when None, or torch.float8_e4m3fn (one fp32 scale)."""
    device = torch.device(device)
    start = time.perf_counter()
    model = build_model(cfg, device="meta", dtype=dtype)
    expert_params = sum(p.numel() for m in model.modules() if isinstance(m, Experts) for p in m.parameters())
    if not int4 and expert_params * dtype.itemsize > BF16_EXPERTS_LIMIT:
        raise ValueError(f"the routed experts of this model take {expert_params * dtype.itemsize / 2**30:.0f} GiB in "
                         f"{dtype}; synthesise them as INT4 instead (--quantize int4)")
    phases = []

    def phase(label: str, fn) -> None:
        t0 = time.perf_counter()
        nbytes = fn()
        _sync(device)
        seconds = time.perf_counter() - t0
        phases.append(f"{label} {nbytes / 1e9:.1f} GB in {seconds:.1f} s")
        log.info("synthetic %s: %.2f GB in %.1f s (%.1f GB/s)", label, nbytes / 1e9, seconds,
                 nbytes / 1e9 / max(seconds, 1e-9))

    if int4:
        phase("int4 experts", lambda: _materialise_experts(model, seed, device))
        phase("int4 dense projections", lambda: _materialise_dense_int4(model, seed, device))
    store = ple_dtype or dtype
    for name, table in [(n, m) for n, m in model.named_modules() if isinstance(m, RowTable)]:
        placement = choose_placement(ple_placement, table.weight.numel() * store.itemsize)
        _materialise_table(f"{name}.weight", table, seed=seed, device=device, dtype=dtype, store=store,
                           placement=placement)
    phase("16-bit tensors", lambda: _materialise_rest(model, seed, device, dtype, cfg))
    model = model.to(device)  # the PLE hash constants were derived on the CPU; a host table stays where it is
    log.info("synthetic model built in %.1f s: %s", time.perf_counter() - start, "; ".join(phases))
    return model.eval().requires_grad_(False)


def synthetic_tokenizer_dir(preset_or_config: str | dict | ModelConfig, cache_dir: str | Path | None = None,
                            tool_format: str | None = None) -> Path:
    """A folder with only the tokenizer, config.json and generation_config.json of a preset (or config), written
    once into the preset cache (FLASHNEXT_CACHE/presets): what the engine needs besides the weights."""
    if isinstance(preset_or_config, str):
        config, name = get_preset(preset_or_config), preset_or_config
    else:
        config = preset_or_config.raw if isinstance(preset_or_config, ModelConfig) else preset_or_config
        name = f"{arch_of(config)}-{zlib.crc32(json.dumps(config, sort_keys=True).encode()):08x}"
    if cache_dir is None:
        cache_dir = Path(os.environ.get("FLASHNEXT_CACHE", Path.home() / ".cache" / "flashnext")) / "presets"
    out = Path(cache_dir) / f"{name}-tokenizer"
    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(tmp, config, tool_format or ("hermes" if arch_of(config) == "qwen3_next" else "qwen3_coder"))
    (tmp / "generation_config.json").write_text(json.dumps(generation_config(config), indent=2) + "\n")
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tmp.rename(out)
    return out
