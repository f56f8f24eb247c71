"""Everything the engine is configured by; the CLI maps its flags (and env vars) onto these fields."""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MODEL = "tiny-flash-next"


@dataclass
class EngineArgs:
    model: str = DEFAULT_MODEL            # folder, hub id or preset name
    dtype: str = "auto"                   # auto: bf16 on GPU, fp32 on CPU; "checkpoint": config.json's dtype
    device: str = "auto"                  # auto: cuda if available
    max_model_len: int | None = None      # default: the model's max_position_embeddings
    max_num_seqs: int = 16
    max_num_batched_tokens: int | None = None  # token budget of one step (prefill chunks + decodes); None: by the
                                          # device (step_token_budget)
    prefill_budget_while_decoding: int = 2048  # prefill tokens per step while any sequence decodes
    decode_step_budget_ms: float = 0.0    # > 0: size those prefill chunks so a mixed step takes about this long
    decode_steps_between_prefill: int = 0  # > 0: after a step with a prefill chunk beside decodes, this many decode-only steps
    graph_prefill_tail: int = 16          # with decode graphs: prompt chunks of at most this many tokens go one a step
    graph_extend_max: int = 48            # with decode graphs: prompt chunks of at most this many tokens of a sequence
                                          # under way replay chained steps (DecodeGraphs.extend; 0: off); longer ones
                                          # take row-wise graphs (H200: faster from ~60 tokens)
    graph_prefill_max: int = 4096         # with decode graphs: eager prefill steps of at most this many tokens replay
                                          # their row-wise work from CUDA graphs (engine/row_graphs.py; 0: off)
    decode_ahead: bool = True             # with decode graphs: queue the next decode step before reading the tokens
    max_queued_requests: int = 256
    gpu_memory_fraction: float = 0.9
    kv_cache_gb: float | None = None      # explicit KV pool size; default: from free memory
    block_size: int = 16
    seed: int = 0
    ple_placement: str = "auto"           # PLE n-gram table: auto (host above 4 GiB), device or host (pinned RAM)
    enforce_eager: bool = False           # no CUDA graphs: every decode step runs the eager torch path (debugging)
    warmup: bool = True                   # serve on a GPU: throwaway requests before /health says ready
    quantize: str | None = None           # "int4": dense projections INT4 in memory (RTN g128; docs/int4.md)
    # Expert cache (docs/expert_cache.md): routed INT4 experts in host memory, a pool of slots per layer on the device
    expert_vram_gb: float | None = None   # device memory for all layers' expert slots (None: every expert resident)
    expert_cache_policy: str = "lfu-decay"  # or "lru"; the eager path's (captured decode steps evict by LRU)
    expert_prefetch: bool = True          # copy the next layer's guessed experts in while a layer computes
    routing_trace: str | None = None      # "calibrated": stated-locality routing for benchmarks (cache/routing_trace.py)
    # Several GPUs of one host (docs/parallel.md): each 1 or the number of GPUs; flashnext.parallel.launch_engine
    tensor_parallel: int = 1              # attention / GatedDeltaNet heads split across GPUs
    expert_parallel: int = 1              # routed experts split across GPUs (whole experts)
    ple_share_dir: str = "/dev/shm"       # several GPUs: one host copy of a host-placed PLE table here ("off": per rank)
    # Prefix cache (docs/prefix_cache.md)
    enable_prefix_caching: bool = True
    prefix_snapshot_interval: int = 1024  # a snapshot at the first chunk end past each multiple (0: none)
    prefix_cache_gb: float | None = None  # device memory for state snapshots (None: SNAPSHOTS_PER_SEQUENCE a slot)
    kv_host_gb: float = 0.0               # host-RAM tier for evicted entries (0: none); per rank on several GPUs
    kv_host_write_through: bool = False   # write every finished turn down to the lower tiers at once
    kv_host_idle_copy: bool = True        # while no request runs, copy device entries down to the host tier
    kv_host_write_behind: bool = True     # while requests run, a piece of that between steps (not waited for)
    kv_disk_dir: str | None = None        # disk tier: entries survive a restart (several GPUs: rank<r>/ under it)
    kv_disk_gb: float = 16.0              # per rank on several GPUs


# A prefill chunk of 16,384 tokens against 8,192: 16.1K against 13.9K tok/s for a 10K-token prompt (one chunk instead
# of two), 12.9K against 12.5K at 90K (H200, full-size Flash-Next INT4, scripts/gpu_prefill.py, session 16); its
# activations take twice the memory (LLMEngine._chunk_activation_bytes: ~5 GB for Flash-Next), which a GPU of less
# than LARGE_GPU_BYTES keeps for KV (80 GB cards report ~79.3 GiB: they take the larger step). Steps with decodes in
# them are sized by --prefill-budget-while-decoding.
LARGE_GPU_BYTES = 72 << 30


def step_token_budget(device) -> int:
    """max_num_batched_tokens by default: 16,384 on a GPU of LARGE_GPU_BYTES (72 GiB) or more, else 8,192."""
    import torch

    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.get_device_properties(device).total_memory >= LARGE_GPU_BYTES:
        return 16384
    return 8192


def model_len(args: EngineArgs, cfg) -> int:
    """The longest sequence served: --max-model-len, at most the model's max_position_embeddings."""
    return min(args.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)


def resolve_dtype(name: str, device, model: str | None = None) -> "torch.dtype":  # noqa: F821
    """auto: bf16 on GPU, fp32 on CPU (fast on both); checkpoint: what the model's config.json declares."""
    import torch

    if name in ("auto", None, ""):
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name == "checkpoint":
        from flashnext.engine.loading import resolve_model
        from flashnext.weights.config import load_config

        name = load_config(resolve_model(model)).torch_dtype
    table = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
             "float32": torch.float32, "fp32": torch.float32}
    if name not in table:
        raise ValueError(f"--dtype {name!r} is not one of auto, checkpoint, {', '.join(table)}")
    return table[name]
