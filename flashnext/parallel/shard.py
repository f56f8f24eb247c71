"""`shard_model`: cut a loaded model down to what one rank of a tensor/expert-parallel group computes.

Tensor parallel (tp = world): every rank keeps a contiguous run of attention heads (and KV heads) and of
GatedDeltaNet key heads with their value heads; the input projections keep those heads' rows
(column-parallel), the output projections those heads' columns (row-parallel), and the mixer's output is
summed over ranks (`ReducedOutput`). Expert parallel (ep = world): every rank keeps a contiguous run of the
routed experts, whole (a 640-wide expert does not split into g128 INT4 tiles; an expert does), and the
routed output is summed over ranks (`LocalExperts`). Everything else — embeddings, norms, router, shared
expert, dense MLPs, PLE, the QSA indexer, lm_head — stays replicated, so logits come out whole on every
rank. The returned config has the local head counts: pools built from it hold only the local heads.
Packed INT4 projections (a GPTQ/AutoRound checkpoint) split the same way: a column-parallel one keeps columns
of its [K/8, N] codes, scales and zeros; a row-parallel one keeps whole input groups, in order (act-order
or a group across ranks is refused with the setting named).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from flashnext.models.layers.attention import GatedAttention
from flashnext.models.layers.gated_delta_net import GatedDeltaNet
from flashnext.models.layers.int4_linear import Int4Linear
from flashnext.models.layers.moe import Experts
from flashnext.parallel.layers import LocalExperts, ReducedOutput
from flashnext.weights.config import ModelConfig


def check_divisible(cfg: ModelConfig, tp: int, ep: int) -> None:
    """Fail with the setting's name when the heads or experts do not divide among the ranks."""
    counts = {"num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_kv_heads,
              "linear_num_key_heads": cfg.linear_num_key_heads, "linear_num_value_heads": cfg.linear_num_value_heads}
    if tp > 1:
        bad = [f"{k} = {v}" for k, v in counts.items() if v % tp]
        if bad:
            raise ValueError(f"--tensor-parallel {tp} must divide the model's head counts; {', '.join(bad)} do not")
    if ep > 1 and cfg.num_experts % ep:
        raise ValueError(f"--expert-parallel {ep} must divide num_experts = {cfg.num_experts}")


def local_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    return dataclasses.replace(
        cfg, num_attention_heads=cfg.num_attention_heads // tp, num_kv_heads=cfg.num_kv_heads // tp,
        linear_num_key_heads=cfg.linear_num_key_heads // tp, linear_num_value_heads=cfg.linear_num_value_heads // tp)


def _part(t: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    return t.chunk(world, dim)[rank]


def _parts(t: torch.Tensor, sizes: list[int], rank: int, world: int, dim: int = 0) -> torch.Tensor:
    """The rank's part of each consecutive section of `t` (e.g. [all q | all k | all v]), concatenated."""
    return torch.cat([_part(s, dim, rank, world) for s in t.split(sizes, dim)], dim)


def _set(module: nn.Module, name: str, value: torch.Tensor) -> None:
    setattr(module, name, nn.Parameter(value.contiguous().clone(), requires_grad=False))


def _rows(linear: nn.Module) -> torch.Tensor:
    """The projection's output row ids: cut like its weight's rows would be, they say which rows a rank keeps."""
    return torch.arange(linear.out_features)


def _keep_rows(linear: nn.Module, rows: torch.Tensor) -> None:
    """Column parallel: keep output rows `rows` of a plain or INT4 projection (INT4: columns of its [K/8, N]
    packed codes, scales and zeros; the input side, act-order included, is untouched)."""
    bias = None if linear.bias is None else linear.bias[rows]
    if isinstance(linear, Int4Linear):
        for name in ("qweight", "scales", "zeros"):
            if getattr(linear, name) is not None:
                setattr(linear, name, getattr(linear, name)[:, rows].contiguous())
        linear.out_features = len(rows)
    elif isinstance(linear, nn.Linear):
        linear.weight = nn.Parameter(linear.weight[rows], requires_grad=False)   # indexing copied them already
        linear.out_features = len(rows)
    else:
        raise ValueError(f"tensor parallel does not know how to split {type(linear).__name__}")
    if bias is not None:
        _set(linear, "bias", bias)


def _row_parallel(linear: nn.Module, rank: int, world: int) -> None:
    """Keep the rank's contiguous share of the inputs; the outputs are partial sums (ReducedOutput adds them)."""
    # The bias is added once: rank 0 keeps it, the others add zeros before the sum.
    if linear.bias is not None and rank > 0:
        _set(linear, "bias", torch.zeros_like(linear.bias))
    share = linear.in_features // world
    if isinstance(linear, Int4Linear):
        g = linear.group_size
        if linear.perm is not None or share % g:
            raise ValueError(f"tensor parallel {world} cannot split an int4 projection's {linear.in_features} "
                             f"inputs (group size {g}{', act-order' if linear.perm is not None else ''}): a rank's "
                             "share must be whole groups in order; use --expert-parallel for this checkpoint")
        first = rank * share
        linear.qweight = linear.qweight[first // 8: (first + share) // 8].contiguous()
        for name in ("scales", "zeros"):
            if getattr(linear, name) is not None:
                setattr(linear, name, getattr(linear, name)[first // g: (first + share) // g].contiguous())
    elif isinstance(linear, nn.Linear):
        _set(linear, "weight", _part(linear.weight, 1, rank, world))
    else:
        raise ValueError(f"tensor parallel does not know how to split {type(linear).__name__}")
    linear.in_features = share


def shard_gated_delta_net(m: GatedDeltaNet, rank: int, world: int) -> None:
    kd, vd = m.key_dim, m.value_dim
    if m.split:
        _keep_rows(m.in_proj_qkv, _parts(_rows(m.in_proj_qkv), [kd, kd, vd], rank, world))
        for proj in (m.in_proj_z, m.in_proj_b, m.in_proj_a):
            _keep_rows(proj, _part(_rows(proj), 0, rank, world))
    else:
        # Fused per key-head group: [Hk, q | k | v·r | z·r] and [Hk, b·r | a·r]; whole groups go to a rank.
        for proj in (m.in_proj_qkvz, m.in_proj_ba):
            _keep_rows(proj, _part(_rows(proj).view(m.num_k_heads, -1), 0, rank, world).flatten())
    _set(m.conv1d, "weight", _parts(m.conv1d.weight, [kd, kd, vd], rank, world))
    m.conv1d.in_channels = m.conv1d.out_channels = m.conv1d.groups = m.conv1d.weight.shape[0]
    _set(m, "dt_bias", _part(m.dt_bias, 0, rank, world))
    _set(m, "A_log", _part(m.A_log, 0, rank, world))
    _row_parallel(m.out_proj, rank, world)
    m.num_k_heads //= world
    m.num_v_heads //= world
    m.key_dim //= world
    m.value_dim //= world


def shard_attention(m: GatedAttention, rank: int, world: int) -> None:
    def heads(linear: nn.Module, count: int) -> None:   # rows are per head: [count, rows_per_head]
        _keep_rows(linear, _part(_rows(linear).view(count, -1), 0, rank, world).flatten())

    heads(m.q_proj, m.num_heads)          # per head [query | gate]
    heads(m.k_proj, m.num_kv_heads)
    heads(m.v_proj, m.num_kv_heads)
    assert m.o_proj.in_features == m.num_heads * m.head_dim
    _row_parallel(m.o_proj, rank, world)
    m.num_heads //= world
    m.num_kv_heads //= world


def local_experts_on_meta(model: nn.Module, count: int) -> None:
    """Before loading a checkpoint for expert parallel: every routed expert set of the (meta) model holds
    `count` experts, the rank's share that the loader reads (load_checkpoint's expert_range)."""
    for experts in model.modules():
        if isinstance(experts, Experts):
            for name in ("gate_up_proj", "down_proj"):
                full = getattr(experts, name)
                _set(experts, name, torch.empty(count, *full.shape[1:], dtype=full.dtype, device="meta"))


def shard_experts(experts: nn.Module, rank: int, world: int, group, total: int) -> LocalExperts:
    """`experts` holds all `total` experts, or already only this rank's share (the loader read just that:
    local_experts_on_meta)."""
    count = experts.gate_up_proj.shape[0] if isinstance(experts, Experts) else experts.num_experts
    if count * world != total:
        # all of them: a model built whole (scripts/gpu_parallel.py); INT4 experts come from a checkpoint read
        # by share, or are quantised after sharding
        if not isinstance(experts, Experts):
            raise ValueError(f"expert parallel does not know how to split {type(experts).__name__}")
        for name in ("gate_up_proj", "down_proj"):
            _set(experts, name, _part(getattr(experts, name), 0, rank, world))
    return LocalExperts(experts, rank * (total // world), total // world, group)


@torch.no_grad()
def shard_model(model: nn.Module, rank: int, world: int, tp: int = 1, ep: int = 1, group=None) -> nn.Module:
    """Shard `model` in place for `rank` of `world` (tp and ep each 1 or world); sets `model.cfg` to the local
    config (head counts / tp) and returns the model. `group`: the process group of the sums (default: all).
    Routed experts that hold only this rank's share already (read so by the loader) are kept as they are."""
    if world == 1:
        return model
    if tp not in (1, world) or ep not in (1, world):
        raise ValueError(f"--tensor-parallel {tp} and --expert-parallel {ep} must each be 1 or the world size {world}")
    check_divisible(model.cfg, tp, ep)
    group = group or torch.distributed.group.WORLD
    for layer in model.model.layers:
        if tp > 1:
            if layer.is_linear:
                shard_gated_delta_net(layer.linear_attn, rank, world)
                layer.linear_attn = ReducedOutput(layer.linear_attn, group)
            else:
                shard_attention(layer.self_attn, rank, world)
                layer.self_attn = ReducedOutput(layer.self_attn, group)
        if ep > 1 and hasattr(layer.mlp, "experts"):
            layer.mlp.experts = shard_experts(layer.mlp.experts, rank, world, group, model.cfg.num_experts)
    if tp > 1:
        model.cfg = local_config(model.cfg, tp)
    return model
