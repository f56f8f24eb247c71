"""Turn a model name (folder, hub id or preset) into a loaded model and its tokenizer."""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from flashnext.models import build_model
from flashnext.models.quantize import (dense_int4_targets, quantize_dense_int4, quantize_experts_int4,
                                       use_int4_weights)
from flashnext.models.layers.rope import RotaryEmbedding
from flashnext.tokenizer import Tokenizer
from flashnext.weights.checkpoint import load_checkpoint
from flashnext.weights.config import ModelConfig, load_config

if TYPE_CHECKING:
    from flashnext.cache.expert_cache import ExpertCache

log = logging.getLogger("flashnext.engine")


@dataclass
class LoadedModel:
    model: torch.nn.Module
    config: ModelConfig
    tokenizer: Tokenizer
    path: Path
    seconds: float
    weight_bytes: int
    expert_cache: ExpertCache | None = None   # --expert-vram-gb (docs/expert_cache.md)


def preset_cache_dir() -> Path:
    return Path(os.environ.get("FLASHNEXT_CACHE", Path.home() / ".cache" / "flashnext")) / "presets"


def resolve_model(name: str) -> Path:
    """A folder as is; a preset name is synthesised once into the cache; anything else is a hub id."""
    from flashnext.weights.presets import PRESETS

    if Path(name).is_dir():
        return Path(name)
    if name in PRESETS:
        from flashnext.weights.synth import synthesize

        out = preset_cache_dir() / f"{name}-bf16"
        if not (out / "config.json").exists():
            log.info("synthesising preset %s into %s", name, out)
            tmp = out.with_name(out.name + f".tmp{os.getpid()}")
            synthesize(name, tmp, dtype="bf16", seed=0)
            tmp.rename(out)
        return out
    from flashnext.weights.hub import resolve_model_path

    return resolve_model_path(name)


QUANTIZE_CHOICES = (None, "int4")


def load_model(name: str, device, dtype: torch.dtype, quantize: str | None = None, parallel=None,
               expert_vram_gb: float | None = None, expert_cache_policy: str = "lfu-decay") -> LoadedModel:
    """`quantize="int4"` replaces the dense projections and routed experts by INT4 ones after loading (RTN;
    docs/int4.md). `parallel` (a flashnext.parallel.ParallelPlan) shards the model for one rank right after
    loading, before quantising; the returned config then has the rank's local head counts (docs/parallel.md)."""
    if quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"--quantize {quantize!r} is not supported; choose int4 or leave it unset")
    start = time.perf_counter()
    path = resolve_model(name)
    cfg = load_config(path)
    model = build_model(cfg, device="meta", dtype=dtype)
    expected = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    # 4-bit dense projections of a GPTQ/AutoRound checkpoint stay packed (docs/int4.md).
    packed = frozenset(f"{module}.weight" for module in dense_int4_targets(model))
    weights = load_checkpoint(path, expected, dtype=dtype, device=device, progress=True, packed_int4=packed)
    derived = {k: v for k, v in model.state_dict().items() if v.device.type != "meta"}
    for key, value in derived.items():
        if key in weights and not torch.equal(weights[key].cpu(), value):
            raise ValueError(f"{path}: {key} differs from what config.json derives (ngram settings or seed?)")
    kept_packed = use_int4_weights(model, weights)
    if kept_packed:
        log.info("keeping %d int4 dense projections of the checkpoint packed", len(kept_packed))
    model.load_state_dict({**weights, **derived}, strict=True, assign=True)
    # Non-persistent buffers (RoPE frequencies) were built on "meta": rebuild them on the device.
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.inv_freq = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta).inv_freq
    model = model.to(device)
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    if parallel is not None and parallel.world > 1:
        from flashnext.parallel.shard import shard_model

        del weights  # it holds the whole tensors: drop it so they are freed once sharded
        shard_model(model, parallel.rank, parallel.world, tp=parallel.tp, ep=parallel.ep)
        cfg = model.cfg
        nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    if quantize == "int4":
        weights = None  # it still holds the bf16 projections: drop it so they are freed once replaced
        dense, experts = quantize_dense_int4(model), quantize_experts_int4(model)
        log.info("quantised %d dense projections and %d routed-expert sets to int4 (RTN, group 128)", len(dense),
                 len(experts))
        nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    expert_cache = None
    if expert_vram_gb is not None:
        # TODO(real sizes): the experts are still quantised on the device first, so the whole model must fit once.
        from flashnext.cache.expert_cache import install_expert_cache

        expert_cache = install_expert_cache(model, int(expert_vram_gb * (1 << 30)), expert_cache_policy)
        nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    tokenizer = Tokenizer.from_dir(path)
    return LoadedModel(model.eval(), cfg, tokenizer, path, time.perf_counter() - start, nbytes, expert_cache)
