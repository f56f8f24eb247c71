"""Turn a model name (folder, hub id or preset) into a loaded model and its tokenizer."""
from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from flashnext.models import build_model
from flashnext.models.quantize import (dense_int4_targets, int4_expert_keys, quantize_dense_int4, quantize_experts_int4,
                                       use_int4_weights)
from flashnext.models.layers.rope import RotaryEmbedding
from flashnext.models.decode_forms import attach_decode_forms
from flashnext.models.stacked import stack_projections
from flashnext.models.layers.row_table import RowTable, choose_placement
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


MEM_PREFIX = "mem:"  # mem:<preset>: random weights built on the device, no checkpoint (weights/synth_device.py)


def resolve_model(name: str) -> Path:
    """A folder as is; a preset name is synthesised once into the cache; "mem:<preset>" is a folder with only the
    preset's config and tokenizer (its weights are built in memory by load_model); anything else is a hub id."""
    from flashnext.weights.presets import PRESETS

    if Path(name).is_dir():
        return Path(name)
    if name.startswith(MEM_PREFIX):
        from flashnext.weights.synth_device import synthetic_tokenizer_dir

        try:
            return synthetic_tokenizer_dir(name[len(MEM_PREFIX):], preset_cache_dir())
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
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
# A mem: model stores its PLE table as float8_e4m3fn with one scale (the FP8 release's format) when the table
# would exceed this in the model dtype: full-size Flash-Next's is 102 GB in bf16, 51 GB in fp8.
MEM_PLE_FP8_ABOVE = 16 << 30


def load_model(name: str, device, dtype: torch.dtype, quantize: str | None = None, parallel=None,
               expert_vram_gb: float | None = None, expert_cache_policy: str = "lfu-decay", *,
               ple_placement: str = "auto", expert_prefetch: bool = True) -> LoadedModel:
    """`quantize="int4"` replaces the dense projections and routed experts by INT4 ones after loading (RTN;
    docs/int4.md). `parallel` (a flashnext.parallel.ParallelPlan) shards the model for one rank right after
    loading, before quantising; the returned config then has the rank's local head counts (docs/parallel.md).
    `ple_placement` ("auto" | "device" | "host"; auto = host above 4 GiB) says where the PLE n-gram table lives:
    "host" keeps it in pinned host memory, read row by row by the GPU (flashnext/models/layers/row_table.py).
    `name` "mem:<preset>" builds a random-weight model straight on the device instead of reading a checkpoint."""
    if quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"--quantize {quantize!r} is not supported; choose int4 or leave it unset")
    choose_placement(ple_placement, 0)  # a bad value fails before anything is loaded
    start = time.perf_counter()
    if name.startswith(MEM_PREFIX):
        model, cfg, path, nbytes = _build_in_memory(name, device, dtype, quantize, parallel, ple_placement)
    else:
        model, cfg, path, nbytes = _load_checkpoint_model(name, device, dtype, quantize, parallel, ple_placement,
                                                          experts_on_host=expert_vram_gb is not None)
    expert_cache = None
    if expert_vram_gb is not None:
        from flashnext.cache.expert_cache import install_expert_cache

        expert_cache = install_expert_cache(model, int(expert_vram_gb * (1 << 30)), expert_cache_policy,
                                            device=device, prefetch=expert_prefetch)
        nbytes = _state_bytes(model, device)
    stacked = stack_projections(model)  # last: the weights are where they stay (models/stacked.py)
    decode_forms, decode_form_bytes = attach_decode_forms(model, dtype)
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()   # the stacked parts' own copies, freed: the KV planner reads the driver's free memory
    log.info("stacked %d groups of projections that share an input; %d INT4 projections with a tinygemm decode form "
             "(%.2f GB more)", stacked, decode_forms, decode_form_bytes / 1e9)
    tokenizer = Tokenizer.from_dir(path)
    return LoadedModel(model.eval(), cfg, tokenizer, path, time.perf_counter() - start, nbytes, expert_cache)


def _state_bytes(model: torch.nn.Module, device) -> int:
    """Bytes of the weights on `device` (a PLE table in host memory is not counted against a GPU; a tied head, which
    is the embedding's tensor itself, once)."""
    kind = torch.device(device).type
    held = {s.data_ptr(): s.nbytes() for s in (t.untyped_storage() for t in model.state_dict().values()
                                                 if t.device.type == kind)}
    return sum(held.values())


def _build_in_memory(name: str, device, dtype, quantize, parallel, ple_placement):
    from flashnext.weights.synth_device import build_synthetic_model

    if parallel is not None and parallel.world > 1:
        raise ValueError(f"{name} is built whole on one device; tensor/expert parallel needs a checkpoint folder "
                         "or a preset name")
    path = resolve_model(name)
    cfg = load_config(path)
    # Sizes are primes just above the base, so the table holds about base × ple_embed_dim values per PLE layer.
    table_bytes = cfg.ngram_vocab_size_base * cfg.ple_embed_dim * dtype.itemsize if cfg.ple_layers else 0
    ple_dtype = torch.float8_e4m3fn if table_bytes > MEM_PLE_FP8_ABOVE else None
    log.info("building %s in memory (%s%s)", name, "int4" if quantize == "int4" else dtype,
             ", PLE table fp8" if ple_dtype else "")
    model = build_synthetic_model(cfg, device, dtype, seed=0, int4=quantize == "int4", ple_placement=ple_placement,
                                  ple_dtype=ple_dtype)
    return model, cfg, path, _state_bytes(model, device)


def _move_to(model: torch.nn.Module, device, keep_host_experts: bool) -> None:
    """model.to(device), except routed experts that an expert cache keeps in host memory."""
    from flashnext.models.layers.int4_experts import Int4Experts
    from flashnext.models.layers.moe import Experts

    device = torch.device(device)
    for module in model.modules():
        if not (keep_host_experts and isinstance(module, (Experts, Int4Experts))):
            module._apply(lambda t: t.to(device), recurse=False)


def _place_ple_tables(model: torch.nn.Module, ple_placement: str) -> None:
    for name, table in model.named_modules():
        if isinstance(table, RowTable) and choose_placement(ple_placement, table.nbytes) == "host":
            t0 = time.perf_counter()
            table.to_host()
            log.info("PLE table %s (%.1f GB) moved to %s host memory in %.1f s", name, table.nbytes / 1e9,
                     "pinned" if table.weight.is_pinned() else "pageable", time.perf_counter() - t0)


def _load_checkpoint_model(name, device, dtype, quantize, parallel, ple_placement, experts_on_host=False):
    """experts_on_host (an expert cache will hold them): the routed experts are read into host memory and
    quantised there chunk by chunk on the device, so the model never has to fit the device whole."""
    path = resolve_model(name)
    cfg = load_config(path)
    model = build_model(cfg, device="meta", dtype=dtype)
    expected = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    # 4-bit dense projections and routed experts of a GPTQ/AutoRound checkpoint stay packed (docs/int4.md).
    packed = frozenset([f"{module}.weight" for module in dense_int4_targets(model)] + int4_expert_keys(model))
    host = set(int4_expert_keys(model)) if experts_on_host else set()
    # A PLE table bound for host memory is read there directly (102 GB in bf16: it could not pass through the GPU).
    for key, (shape, _) in expected.items():
        if key.endswith("ngram_embedding.weight"):
            if choose_placement(ple_placement, math.prod(shape) * dtype.itemsize) == "host":
                host.add(key)
    # Expert parallel: each rank reads only its own routed experts (most of the model), so a model that fits
    # the GPUs together loads although no single GPU could hold it whole.
    expert_range = None
    if parallel is not None and parallel.ep > 1 and cfg.num_experts:
        from flashnext.parallel.shard import check_divisible, local_experts_on_meta

        check_divisible(cfg, 1, parallel.ep)
        per_rank = cfg.num_experts // parallel.ep
        expert_range = (parallel.rank * per_rank, per_rank)
        local_experts_on_meta(model, per_rank)   # `expected` keeps the checkpoint's full expert counts
    # Several ranks: one host copy of a host-bound PLE table, read by rank 0 and mapped by the others.
    share = _table_share(parallel, host, expected, dtype)
    try:
        into, not_read = share.begin() if share else ({}, frozenset())
        weights = load_checkpoint(path, expected, dtype=dtype, device=device, progress=True, packed_int4=packed,
                                  host_names=frozenset(host), expert_range=expert_range, into=into, not_read=not_read)
        if share:
            share.after_load(weights)
        derived = {k: v for k, v in model.state_dict().items() if v.device.type != "meta"}
        for key, value in derived.items():
            if key in weights and not torch.equal(weights[key].cpu(), value):
                raise ValueError(f"{path}: {key} differs from what config.json derives (ngram settings or seed?)")
        kept_packed = use_int4_weights(model, weights)
        if kept_packed:
            log.info("keeping %d int4 projections / expert sets of the checkpoint packed", len(kept_packed))
        model.load_state_dict({**weights, **derived}, strict=True, assign=True)
        # Non-persistent buffers (RoPE frequencies) were built on "meta": rebuild them on the device.
        for module in model.modules():
            if isinstance(module, RotaryEmbedding):
                module.inv_freq = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta).inv_freq
        weights = None  # the table's device copy is freed once it moves; the model holds every other tensor
        _place_ple_tables(model, ple_placement)
        _move_to(model, device, keep_host_experts=experts_on_host)
        nbytes = _state_bytes(model, device)
        if parallel is not None and parallel.world > 1:
            from flashnext.parallel.shard import shard_model

            shard_model(model, parallel.rank, parallel.world, tp=parallel.tp, ep=parallel.ep)
            cfg = model.cfg
            nbytes = _state_bytes(model, device)
        if quantize == "int4":
            dense, experts = quantize_dense_int4(model), quantize_experts_int4(model, compute_device=device)
            log.info("quantised %d dense projections and %d routed-expert sets to int4 (RTN, group 128)", len(dense),
                     len(experts))
            nbytes = _state_bytes(model, device)
    except BaseException:
        if share:
            share.discard()   # rank 0: no 100 GB file left in /dev/shm by a failed load
        raise
    if share:
        share.finish()
    return model, cfg, path, nbytes


def _table_share(parallel, host: set[str], expected: dict, dtype: torch.dtype):
    """This rank's TableShare of the PLE table when several ranks would each hold it in host memory."""
    if parallel is None or parallel.world == 1 or not parallel.ple_share:
        return None
    keys = [k for k in host if k.endswith("ngram_embedding.weight")]
    if len(keys) != 1:   # every preset has one; several would need a share each, named alike on every rank
        return None
    key = keys[0]
    from flashnext.weights.shared_table import TableShare

    return TableShare(parallel.ple_share, key, expected[key][0], dtype, parallel.rank, parallel.world)
