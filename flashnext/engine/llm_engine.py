"""The synchronous engine: admission checks, one step = schedule → run → update, outputs per request.

It owns the model, the pools and the scheduler; nothing else touches device memory. AsyncLLM drives it
from one thread; the Python API `LLM` drives it directly.
"""
from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from flashnext.cache.kv_pool import KVPool
from flashnext.cache.prefix_cache import PrefixCache
from flashnext.cache.state_pool import StatePool
from flashnext.engine.args import EngineArgs, model_len, resolve_dtype, step_token_budget
from flashnext.engine.cuda_graph import DecodeGraphs
from flashnext.engine.errors import RequestRejected
from flashnext.engine.loading import LoadedModel, load_model
from flashnext.engine.model_runner import ModelRunner
from flashnext.engine.outputs import RequestOutput, TokenLogprob
from flashnext.engine.prefill_pacer import PrefillPacer
from flashnext.engine.request import Request
from flashnext.engine.row_graphs import RowGraphs, buckets_up_to
from flashnext.engine.sampled_on_host import SampledOnHost
from flashnext.engine.sampler import SamplerOutput, validate_token_ids
from flashnext.engine.sampling_params import InvalidParams, SamplingParams
from flashnext.engine.scheduler import Scheduler
from flashnext.engine.structured.backend import InvalidConstraint, StructuredConstraint, shared_backend
from flashnext.models.layers.indexed_attention import compile_list_attention
from flashnext.models.layers.qsa_indexer import compile_selection_kernels
from flashnext.tokenizer.detokenizer import IncrementalDetokenizer

log = logging.getLogger("flashnext.engine")

# The default snapshot budget, in snapshots a sequence slot: each running conversation leaves two ends (its
# history's, where a chat's next turn resumes, and its reply's, where a plain continuation does) plus room for
# one more. Fewer, and conversations resumed in turn push each other's ends out before their turn comes: the
# H200's `bench concurrency` (8 streams, session 13) resumed none with a fixed 1 GiB (~9 Flash-Next snapshots).
SNAPSHOTS_PER_SEQUENCE = 3
# Prefill tokens in a step from which the write-behind runs beside it (LLMEngine._write_behind).
WRITE_BEHIND_MIN_TOKENS = 1024


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_queries: int
    prefix_hits: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_preemptions: int
    free_kv_blocks: int
    total_kv_blocks: int
    free_state_slots: int
    total_state_slots: int
    prefix_cached_kv_blocks: int    # held only by the prefix cache: evictable, so not counted as usage


@dataclass
class MemoryPlan:
    device: str
    dtype: str
    weight_bytes: int
    kv_blocks: int
    block_size: int
    kv_bytes: int
    state_slots: int
    state_bytes: int
    snapshot_bytes: int

    def __str__(self) -> str:
        gib = 1 << 30
        return (f"{self.device} {self.dtype}: weights {self.weight_bytes / gib:.2f} GiB, KV {self.kv_blocks} blocks × "
                f"{self.block_size} tokens = {self.kv_bytes / gib:.2f} GiB ({self.kv_blocks * self.block_size} tokens), "
                f"{self.state_slots} state slots = {self.state_bytes / gib:.2f} GiB, prefix-cache snapshots up to "
                f"{self.snapshot_bytes / gib:.2f} GiB")


def fit_snapshot_budget(budget: int, free: int, reserve: int, activations: int) -> int:
    """The device bytes a snapshot budget may take of `free`, after the reserve and the activations: all of it, less,
    or nothing."""
    return max(0, min(budget, free - reserve - activations))


def request_timing(request: Request) -> str:
    """One line per finished request, as llama.cpp's server prints them: where its time went inside the engine
    (arrival = when the engine got it: the server's template, tokenising and grammar come before)."""
    m = request.metrics
    generated = len(request.output_ids)
    first = "no token" if m.ttft is None else f"first token {m.ttft:.3f} s after arrival"
    rate = ""
    if m.first_token_time is not None and m.finished_time is not None and generated > 1 \
            and m.finished_time > m.first_token_time:
        rate = f", {(generated - 1) / (m.finished_time - m.first_token_time):.1f} tok/s after it"
    queued = "never scheduled" if m.queue_time is None else f"queued {m.queue_time:.3f} s"
    return (f"{request.request_id} {request.finish_reason}: prompt {len(request.prompt_ids)} tokens "
            f"({request.num_cached} cached), {queued}, {first}; {generated} tokens{rate}")


class LLMEngine:
    def __init__(self, args: EngineArgs, loaded: LoadedModel | None = None):
        device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device(device)
        if args.max_num_batched_tokens is None:
            args = replace(args, max_num_batched_tokens=step_token_budget(self.device))
        self.args = args
        self.dtype = resolve_dtype(args.dtype, self.device, args.model)
        self.loaded = loaded or load_model(args.model, self.device, self.dtype, quantize=args.quantize,
                                           expert_vram_gb=args.expert_vram_gb,
                                           expert_cache_policy=args.expert_cache_policy,
                                           ple_placement=args.ple_placement, expert_prefetch=args.expert_prefetch)
        cfg = self.config = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        if args.routing_trace and not self._routes_by_trace():
            from flashnext.cache.routing_trace import install_routing_trace

            count = install_routing_trace(self.loaded.model, args.routing_trace, args.seed)
            log.warning("--routing-trace %s: %d routers pick experts from a trace of stated locality; outputs are "
                        "not the model's (a benchmark mode)", args.routing_trace, count)
        self.max_model_len = model_len(args, cfg)
        block_size = KVPool.fit_block_size(cfg, args.block_size)
        slot_bytes = StatePool.bytes_per_slot(cfg, self.dtype)
        use_graphs = self._use_cuda_graphs()
        if args.graph_extend_max < 0:
            raise ValueError(f"--graph-extend-max {args.graph_extend_max} must be >= 0 (0: off)")
        # chained chunks take 2 tokens or more: --graph-extend-max 1 turns them off like 0 (the graph tail stays)
        extend_max = args.graph_extend_max if use_graphs and args.graph_extend_max > 1 and self._extends_capturable() else 0
        # A captured decode step pads its batch with rows on a scratch slot and block (engine/cuda_graph.py).
        num_slots = args.max_num_seqs + use_graphs
        num_blocks = self._plan_kv_blocks(block_size, slot_bytes, num_slots)
        self.kv = KVPool(cfg, num_blocks, block_size, self.dtype, self.device)
        self.states = StatePool(cfg, num_slots, self.dtype, self.device)
        self.memory_plan = MemoryPlan(str(self.device), str(self.dtype).replace("torch.", ""), self.loaded.weight_bytes,
                                      num_blocks, block_size, num_blocks * KVPool.bytes_per_block(cfg, block_size, self.dtype),
                                      num_slots, num_slots * slot_bytes, self._fitted_snapshot_budget(block_size, slot_bytes))
        self.prefix_cache = self._build_prefix_cache(block_size)
        pacer = None
        if args.decode_step_budget_ms > 0:
            pacer = PrefillPacer(args.decode_step_budget_ms / 1e3, args.prefill_budget_while_decoding)
        self.scheduler = Scheduler(self.kv, self.states, args.max_num_seqs, args.max_num_batched_tokens,
                                   self.prefix_cache, args.prefix_snapshot_interval, args.prefill_budget_while_decoding,
                                   pacer, graph_tail=args.graph_prefill_tail if use_graphs and not extend_max else 0,
                                   decode_steps_between_prefill=args.decode_steps_between_prefill, extend_max=extend_max)
        eos = set(cfg.eos_token_ids) | set(self.tokenizer.eos_token_ids)
        self.eos_token_ids = frozenset(e for e in eos if e < cfg.vocab_size)
        graphs = None
        experts = self.loaded.expert_cache
        if use_graphs:
            # with an expert cache, batches up to CACHED_MAX_M read its pools in the graph (imported here: the claim
            # pool imports Triton, which the engine's modules must not at import: tests/test_branches.py)
            from flashnext.cache.expert_claim_pool import CACHED_MAX_M

            graph_rows = args.max_num_seqs if experts is None else min(args.max_num_seqs, CACHED_MAX_M)
            graphs = DecodeGraphs(self.loaded.model, self.kv, self.states, graph_rows,
                                  self.kv.blocks_for(self.max_model_len), max_chain=extend_max)
            if experts is not None:
                graphs.keeper = experts.enable_graphs()
        row_graphs = None
        if args.graph_prefill_max < 0:
            raise ValueError(f"--graph-prefill-max {args.graph_prefill_max} must be >= 0 (0: off)")
        if use_graphs and args.graph_prefill_max and self._extends_capturable() and not self._routes_by_trace():
            row_graphs = RowGraphs(self.device, min(args.graph_prefill_max, args.max_num_batched_tokens))
        self.runner = ModelRunner(self.loaded.model, self.kv, self.states, self.eos_token_ids, self.device, args.seed,
                                  graphs, row_graphs)
        self.requests: dict[str, Request] = {}
        self._in_flight: tuple[list[Request], SamplerOutput] | None = None   # a decode step launched ahead (step)
        self._tokens_read_at = 0.0   # when the last sampled tokens reached the host (the pacer's decode step time)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        log.info("memory plan: %s", self.memory_plan)

    def _use_cuda_graphs(self) -> bool:
        """Decode replays CUDA graphs on a GPU unless --enforce-eager — with an expert cache too, whose kernels read
        missing experts from host memory and admit them into its pools inside the step (cache/expert_claim_pool.py),
        and with a routing trace, whose decode steps read tables drawn ahead (CalibratedRouting.decode_ids). With
        several GPUs every rank replays its own graph, NCCL all-reduces inside (parallel/runtime.py
        broadcast_decode)."""
        return self.device.type == "cuda" and not self.args.enforce_eager

    def _extends_capturable(self) -> bool:
        """Whether short prompt chunks can replay chained steps (DecodeGraphs.extend): one GPU (rank 0 announces
        decode steps only to the workers of several), routed experts INT4 in the device's memory (their kernels need
        no host sync; the 16-bit experts' decode form gathers every row's expert weights, too much memory for a
        chunk's rows; an expert cache's eager path syncs)."""
        from flashnext.models.layers.int4_experts import Int4Experts
        from flashnext.models.layers.moe import Experts
        from flashnext.parallel.runtime import world_size

        experts = [m for m in self.loaded.model.modules() if isinstance(m, (Experts, Int4Experts))]
        return (world_size(self.args.tensor_parallel, self.args.expert_parallel) == 1
                and self.loaded.expert_cache is None and all(isinstance(m, Int4Experts) for m in experts))

    def _routes_by_trace(self) -> bool:
        """A routing trace draws its experts on the host each forward (cache/routing_trace.py): a captured prefill
        step would replay one draw."""
        return any(getattr(m, "trace", None) is not None for m in self.loaded.model.modules())

    def _build_prefix_cache(self, block_size: int) -> PrefixCache | None:
        args = self.args
        if not args.enable_prefix_caching:
            return None
        if args.prefix_snapshot_interval < 0:
            raise ValueError(f"--prefix-snapshot-interval {args.prefix_snapshot_interval} must be >= 0 "
                             "(0: no snapshots inside a prefill)")
        gib = 1 << 30
        lower = None
        if args.kv_disk_dir:
            from flashnext.cache.disk_tier import DiskTier, disk_stores, model_identity

            # Several ranks: this is rank 0, whose index covers every rank's share (parallel/mirror.py).
            identity = model_identity(self.loaded.path, self.dtype, block_size)
            stores = disk_stores(args.kv_disk_dir, identity, args.tensor_parallel, args.expert_parallel)
            lower = DiskTier(stores[0], int(args.kv_disk_gb * gib), block_size, peers=stores[1:])
        if args.kv_host_gb > 0:
            from flashnext.cache.host_tier import HostStore
            from flashnext.cache.tier_index import TierIndex

            host_bytes = int(args.kv_host_gb * gib)
            lower = TierIndex(HostStore(host_bytes), host_bytes, block_size, lower)
        return PrefixCache(self.kv, self.states, self.memory_plan.snapshot_bytes, lower, args.kv_host_write_through)

    def _chunk_activation_bytes(self) -> int:
        """The largest tensors one prefill chunk of max_num_batched_tokens holds at once, per token: the routed
        experts' fp32 outputs before their sum (top-k × hidden × 4; or their 16-bit rows and the gathered inputs on
        the dequantised path) and gate·up rows (top-k × intermediate), the hyper-connection streams (hc × hidden)
        and their mix, doubled for torch's temporaries around them (the 1 GiB beside it covers logits, sampling
        and the allocator's slack); plus the dequantised experts' scratch where a step takes that path."""
        return self._activation_bytes_per_token() * self.args.max_num_batched_tokens + self._moe_dequant_scratch_bytes()

    def _activation_bytes_per_token(self) -> int:
        cfg, item = self.config, self.dtype.itemsize
        per_token = cfg.num_experts_per_tok * (cfg.hidden_size * 4 + cfg.moe_intermediate_size * item)
        return 2 * (per_token + 2 * cfg.hc_hidden_size * item)

    def _row_graph_bytes(self) -> int:
        """What row-wise prefill graphs keep on the device (engine/row_graphs.py), an estimate at their largest
        bucket: static buffers for the tensors passed between calls (the streams a few times, the GatedDeltaNet
        projections, attention's query and gate), twice for the copies of eager inputs, plus their pool's
        temporaries (a step's activations at those rows)."""
        args, cfg = self.args, self.config
        if self.device.type != "cuda" or args.enforce_eager or not args.graph_prefill_max:
            return 0
        linear = 2 * (cfg.linear_num_key_heads * cfg.linear_key_head_dim
                      + cfg.linear_num_value_heads * cfg.linear_value_head_dim)
        width = 3 * cfg.hc_hidden_size + linear + 2 * cfg.num_attention_heads * cfg.head_dim
        rows = min(args.graph_prefill_max, args.max_num_batched_tokens)
        return rows * (2 * width * self.dtype.itemsize + self._activation_bytes_per_token())

    def _moe_dequant_scratch_bytes(self) -> int:
        """A layer's experts dequantised to 16 bits, where a full prefill step of resident INT4 experts takes that
        path (ops.moe_int4.prefill_path; Flash-Next: 3.4 GB)."""
        from flashnext.models.layers.int4_experts import Int4Experts
        from flashnext.ops.moe_int4 import prefill_path
        from flashnext.ops.moe_int4_dequant import dequant_scratch_bytes

        layers = [m for m in self.loaded.model.modules() if isinstance(m, Int4Experts) and m.expert_cache is None]
        if self.device.type != "cuda" or not layers or prefill_path(
                self.args.max_num_batched_tokens, self.config.num_experts_per_tok, layers[0].num_experts,
                layers[0].weight_int4("gate_up"), layers[0].weight_int4("down"), self.device) != "dequant":
            return 0
        return max(dequant_scratch_bytes(m.weight_int4("gate_up"), m.weight_int4("down"), self.dtype) for m in layers)

    def _snapshot_budget(self, block_size: int, slot_bytes: int) -> int:
        """Device bytes for prefix-cache snapshots: --prefix-cache-gb, by default room for SNAPSHOTS_PER_SEQUENCE
        a sequence slot (a snapshot holds one slot's states and the KV of its partial block)."""
        if not self.args.enable_prefix_caching:
            return 0
        if self.args.prefix_cache_gb is not None:
            return int(self.args.prefix_cache_gb * (1 << 30))
        snapshot = slot_bytes + KVPool.bytes_per_block(self.config, block_size, self.dtype)
        return SNAPSHOTS_PER_SEQUENCE * self.args.max_num_seqs * snapshot

    def _headroom(self, total: int) -> tuple[int, int]:
        """Device bytes the memory plan leaves free of a GPU of `total` bytes: (the reserve --gpu-memory-fraction
        keeps, a prefill chunk's activations plus 1 GiB)."""
        return (int(total * (1 - self.args.gpu_memory_fraction)),
                (1 << 30) + self._chunk_activation_bytes() + self._row_graph_bytes())

    def _fitted_snapshot_budget(self, block_size: int, slot_bytes: int) -> int:
        """_snapshot_budget once the KV pool and the state slots are allocated: beside an explicit --kv-cache-gb on a
        GPU (which the plan took as given: the default budget grows with --max-num-seqs, ~350 MB a slot for
        Flash-Next) the default is cut to what the device has left beside the reserve and a prefill chunk's
        activations. A KV pool planned from free memory left the budget aside already."""
        budget = self._snapshot_budget(block_size, slot_bytes)
        if self.device.type != "cuda" or self.args.prefix_cache_gb is not None or self.args.kv_cache_gb is None:
            return budget
        free, total = torch.cuda.mem_get_info(self.device)
        fitted = fit_snapshot_budget(budget, free, *self._headroom(total))
        if fitted < budget:
            log.warning("prefix-cache snapshots: %.2f GiB of the default %.2f GiB fit beside the KV cache; set "
                        "--prefix-cache-gb or a smaller --kv-cache-gb / --max-num-seqs", fitted / (1 << 30),
                        budget / (1 << 30))
        return fitted

    def _plan_kv_blocks(self, block_size: int, slot_bytes: int, num_slots: int) -> int:
        """KV blocks for --kv-cache-gb, or from the free memory after the reserve, a chunk's activations, the
        `num_slots` state slots (the scratch slot of decode graphs included) and the snapshot budget."""
        per_block = KVPool.bytes_per_block(self.config, block_size, self.dtype)
        if self.args.kv_cache_gb is not None:
            budget = int(self.args.kv_cache_gb * (1 << 30))
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            reserve, activations = self._headroom(total)
            snapshots = self._snapshot_budget(block_size, slot_bytes)
            budget = int(free - reserve - activations - num_slots * slot_bytes - snapshots)
        else:
            # CPU: enough for every sequence at full length, capped at 4 GiB
            budget = min(4 << 30, self.args.max_num_seqs * self.max_model_len * per_block // block_size)
        blocks = budget // per_block
        if blocks < 1:
            raise RuntimeError(f"no memory left for the KV cache (budget {budget / (1 << 30):.2f} GiB); lower "
                               "--max-num-seqs or raise --gpu-memory-fraction / --kv-cache-gb")
        return max(blocks, -(-self.max_model_len // block_size))

    @property
    def model_name(self) -> str:
        return self.args.model

    # ---- requests ----
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    history_len: int | None = None, constraint: StructuredConstraint | None = None) -> Request:
        """`history_len`: prompt tokens before the chat template's generation prompt (Request.history_len).
        `constraint`: params.structured compiled already (`compile_constraint`, off the engine thread); else it is
        compiled here."""
        if request_id in self.requests:
            raise RequestRejected(f"request id {request_id!r} is already running", "request_id")
        if not prompt_ids:
            raise RequestRejected("the prompt is empty", "prompt")
        vocab = self.config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise RequestRejected(f"prompt token ids {bad[:5]} lie outside the vocabulary of {vocab}", "prompt")
        try:
            validate_token_ids(params, vocab)
        except InvalidParams as e:
            raise RequestRejected(str(e), e.param) from None
        n = len(prompt_ids)
        wanted = params.max_tokens or 1
        if n + wanted > self.max_model_len:
            raise RequestRejected(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{n + wanted} tokens ({n} in the prompt, {wanted} for the completion). Shorten the prompt or "
                f"lower max_tokens.", "messages", "context_length_exceeded")
        if self.kv.blocks_for(n + wanted) > self.kv.num_blocks:
            raise RequestRejected(f"the request needs {n + wanted} tokens of KV cache; the pool holds "
                                  f"{self.kv.num_blocks * self.kv.block_size} (raise --kv-cache-gb)",
                                  "max_tokens", "context_length_exceeded")
        if params.structured is not None and constraint is None:
            constraint = self.compile_constraint(params)
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, skip_special_tokens=params.skip_special_tokens)
        request = Request(request_id, list(prompt_ids), params, detok, self.max_model_len, constraint=constraint,
                          history_len=history_len if self.prefix_cache is not None and history_len is not None
                          and 0 < history_len < n else None)   # the chunk cut there only feeds a snapshot
        self.requests[request_id] = request
        self.scheduler.add(request)
        self.prompt_tokens_total += n
        return request

    def compile_constraint(self, params: SamplingParams) -> StructuredConstraint:
        """params.structured compiled against this model's vocabulary. Safe from any thread, and AsyncLLM calls it from
        the request's, not the engine's. On the dev machine the first constrained request imports xgrammar (1.7 s)
        and builds its vocabulary (0.07 s for 150K synthetic byte-level tokens), and a schema compiles in ~25–30 ms at
        that size with one thread, the GIL let go meanwhile: on the engine thread every running stream would wait."""
        try:
            backend = shared_backend(self.loaded.path / "tokenizer.json", self.config.vocab_size, self.eos_token_ids)
            return backend.constraint(params.structured)
        except InvalidConstraint as e:
            raise RequestRejected(str(e), params.structured.param) from None

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.requests.pop(request_id, None)
        if request is None or request.finished:
            return None
        request.finish_reason = "abort"
        self.scheduler.finish(request)
        return self._output(request)

    def shutdown(self) -> None:
        """Before the process ends: the prefix cache writes what only VRAM and host RAM hold to its disk tier."""
        if self.prefix_cache is not None:
            written = self.prefix_cache.persist()
            if written:
                log.info("wrote %d cached conversation states to the disk tier", written)

    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting or self._in_flight)

    def idle_work(self) -> bool:
        """One piece of background work while no request runs (AsyncLLM's loop asks, one piece after the other once
        it has had no request for IDLE_WORK_AFTER_S): a piece of a prefix-cache entry copied down to the host tier
        ahead of its eviction (--kv-host-idle-copy, PrefixCache.copy_down_one). False when there is nothing to do."""
        return (self.prefix_cache is not None and self.args.kv_host_idle_copy and not self.has_work()
                and self.prefix_cache.copy_down_one())

    def _write_behind(self, chunks) -> None:
        """With a step queued on the device: a piece of a device prefix-cache entry copied down to the host tier ahead
        of its eviction (--kv-host-write-behind; PrefixCache.copy_down_one), its gather queued behind the step and its
        copy on a stream the steps do not wait for — unless the last pieces are still crossing. On the H200's idle
        bench the resumes follow each other too closely for the idle copy: each had written down the conversation it
        evicted on its own path (~50 ms of a ~0.2 s first token, session 16).

        Only where the host has time to spare: beside a decode step queued ahead (the host then waits for the one
        before it) or a prefill step of WRITE_BEHIND_MIN_TOKENS or more (~0.1 s of GPU work and up). A piece costs
        the host 3–7 ms (H200, session 17's logs), which beside a resumed turn's ~100-token step comes before that
        turn's first token (the idle bench's second resume had nine pieces there at 2c03ae8)."""
        cache = self.prefix_cache
        if cache is None or not self.args.kv_host_write_behind or cache.copying_down():
            return
        # a step queued ahead also follows a prompt's last chunk (its first token, still to read, is what a resumed
        # turn waits for): only beside decode steps
        decoding = self._in_flight is not None and (chunks is None or all(c.num_tokens == 1 for c in chunks))
        if decoding or sum(c.num_tokens for c in chunks or ()) >= WRITE_BEHIND_MIN_TOKENS:
            cache.copy_down_one()

    def warm_up(self) -> float:
        """Run throwaway requests before serving, so the first user's request does not pay for compiling the
        Triton kernels, fla-core's autotuning and the first graph captures (on the H200 the first 10K-token request
        to full-size Flash-Next took 73 s, the next ones 2.4 s): one prompt of a full step budget plus an odd tail
        chunk, and a short one that enters while the first decodes; then one sequence's decode step at every
        block-table width, and every chained step (DecodeGraphs.extend) at every width from CHAIN_MIN_WIDTH (on the
        H200, full-size Flash-Next: 77 chained captures at all 11 widths took 38 s; from 256 blocks the servers warmed
        up in 21–47 s). The prefix cache, the counters and the pools end
        as they started. → seconds taken."""
        start = time.perf_counter()
        rng, vocab = random.Random(0), self.config.vocab_size
        prompt = lambda n: [rng.randrange(vocab // 4, vocab // 2) for _ in range(max(n, 1))]  # noqa: E731
        room = min(self.max_model_len - 8, self.kv.num_blocks * self.kv.block_size // 2)
        lengths = [min(self.args.max_num_batched_tokens + 37, room), min(61, room)]
        counters = (self.prompt_tokens_total, self.generation_tokens_total, self.scheduler.prefix_queries,
                    self.scheduler.prefix_hits, self.scheduler.num_preemptions)
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        for i, n in enumerate(lengths):
            self.add_request(f"warm-up-{i}", prompt(n), params)
            self.step()
        while self.has_work():
            self.step()
        # the eager path's selections at context lengths the prompts above did not reach (the workers of several
        # ranks compile their own: parallel/launch.py)
        compile_selection_kernels(self.config, self.device, self.max_model_len)
        compile_list_attention(self.config, self.kv.block_size, self.dtype, self.device, self.max_model_len)
        graphs = self.runner.graphs
        if graphs is not None and graphs.announce is None:   # one GPU (several: the workers capture as announced)
            graphs.capture_widths(1)
            for size in graphs.chain_steps:
                graphs.capture_widths(size, chained=True)
        self._warm_row_graphs(prompt, params, room)
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        (self.prompt_tokens_total, self.generation_tokens_total, self.scheduler.prefix_queries,
         self.scheduler.prefix_hits, self.scheduler.num_preemptions) = counters
        return time.perf_counter() - start

    def _warm_row_graphs(self, prompt: Callable[[int], list[int]], params: SamplingParams, room: int) -> None:
        """A fresh `prompt(n)` of every bucket's size up to `room` tokens, so each bucket's row-wise graphs are
        captured before a request needs them (engine/row_graphs.py); where one sequence's steps have plans of their
        own (RowGraphs.sequences), also two prompts of half the size in one step, for the plans of several."""
        row_graphs = self.runner.row_graphs
        if row_graphs is None:
            return
        start = time.perf_counter()
        cuda = self.device.type == "cuda"
        reserved = torch.cuda.memory_reserved(self.device) if cuda else 0
        kinds = [row_graphs.sequences] + ([False] if row_graphs.sequences and self.args.max_num_seqs > 1 else [])
        for size in buckets_up_to(min(row_graphs.max_rows, room)):
            for single in kinds:
                if (size, single) in row_graphs.plans or not row_graphs.enabled:
                    continue
                parts = [size] if single else [size // 2, size - size // 2]
                for i, n in enumerate(parts):   # added together: the scheduler takes both into one step
                    self.add_request(f"warm-up-rows-{size}-of-{len(parts)}-{i}", prompt(n), params)
                while self.has_work():
                    self.step()
        # the allocator's reserve grows by the buffers, the graphs' pool and what the warm-up prompts left cached
        grown = (torch.cuda.memory_reserved(self.device) - reserved) / (1 << 30) if cuda else 0.0
        log.info("row-wise prefill graphs: %d buckets up to %d rows, up to %d calls a step, %.2f GiB of buffers "
                 "(device memory reserved +%.2f GiB), %.1f s", len(row_graphs.plans), row_graphs.max_rows,
                 max((len(p.calls) for p in row_graphs.plans.values()), default=0),
                 row_graphs.buffer_bytes / (1 << 30), grown, time.perf_counter() - start)

    # ---- one step ----
    def step(self, launched: Callable[[], None] | None = None) -> list[RequestOutput]:
        """Run one step; returns the requests' new output increments.

        `launched` (the server's delivery of the previous step's outputs) is called once the device has work: by the
        runner right after it replays a decode graph that runs the whole step (milliseconds of GPU work while the
        host would otherwise wait), before any eager forward (a prefill chunk may wait on the device), and at once
        when there is nothing to run.

        Decode ahead (--decode-ahead; one GPU with decode graphs): when every running request decodes in this step
        and no waiting request can be admitted, their next step is queued on the device before the host reads this one's tokens, fed
        those tokens there (_launch_ahead). The next call starts from that step in flight instead of scheduling one,
        so the host's work between steps (reading tokens, detokenising, stop checks, the server's delivery)
        overlaps the GPU's instead of leaving it idle."""
        started = time.perf_counter()
        if self._in_flight is not None:
            sampling, sampled = self._in_flight
            self._in_flight = None
            chunks = None
            live = [r for r in sampling if not r.finished]
        else:
            chunks = self.scheduler.schedule()
            if not chunks:
                if launched is not None:
                    launched()
                if self.prefix_cache is not None and self.prefix_cache.reading:
                    self.prefix_cache.wait_for_reads(timeout=0.005)   # only disk reads are left: do not spin on them
                return []
            now = time.time()
            for c in chunks:
                if c.request.metrics.first_scheduled_time is None:
                    c.request.metrics.first_scheduled_time = now
            sampling = [c.request for c in chunks if c.samples]
            sampled = self.runner.run(chunks, launched)
            launched = None   # the runner called it
            self.scheduler.computed(chunks)
        if sampled is not None:
            on_host = SampledOnHost(sampled)   # queued before any step ahead: reading it waits for this step only
            if chunks is None or len(sampling) == len(chunks):
                self._in_flight = self._launch_ahead(sampling, sampled)
            if launched is not None:
                launched()
            self._write_behind(chunks)   # while the host would wait for the step's tokens anyway
            tokens, logprobs, top = on_host.lists()
            for i, request in enumerate(sampling):
                if request.finished:   # ended (or aborted) while this step, launched ahead, ran: its row is dropped
                    continue
                lp = None
                if logprobs is not None and request.params.logprobs is not None:
                    k = request.params.logprobs
                    pairs = list(zip(top[0][i][:k], top[1][i][:k])) if top is not None else []
                    lp = TokenLogprob(tokens[i], logprobs[i], pairs)
                self._append_token(request, tokens[i], lp)
            read = time.perf_counter()
            if self.scheduler.pacer is not None:   # the sampled tokens are on the host: the GPU is done
                if chunks is None:   # a decode step launched ahead ran from the last step's tokens to these
                    self.scheduler.pacer.record(0, len(sampling), read - self._tokens_read_at)
                elif not any(c.chained for c in chunks):   # a chained step's time fits neither of its terms
                    decodes = sum(c.num_tokens == 1 for c in chunks)   # decodes and prompt tails: graph rows
                    self.scheduler.pacer.record(sum(c.num_tokens for c in chunks) - decodes, decodes, read - started)
            self._tokens_read_at = read
        else:   # prefill chunks that sample nothing
            if launched is not None:
                launched()
            self._write_behind(chunks)
        if chunks is None:   # a request that ended before this step ran has had its output
            return [self._output(r) for r in live if r.pending_ids or r.finished]
        return [self._output(c.request) for c in chunks if c.request.pending_ids or c.request.finished]

    def _launch_ahead(self, requests: list[Request], sampled) -> tuple[list[Request], SamplerOutput] | None:
        """Queue the decode step of `requests` that follows the one which sampled `sampled`, its input tokens taken
        from `sampled` on the device → (requests, its sampled tokens), or None where it would not be the step the
        scheduler picks next (Scheduler.schedule_ahead) or the runner cannot (ModelRunner.can_run_ahead). A request
        that then finishes with this step's token (a stop, or its length limit) had its last token computed by the
        step ahead: num_computed counts it, so the prefix cache's snapshot at its end covers the whole reply; the
        step's sample for it is dropped. Greedy and seeded requests get the tokens they get one step at a time; unseeded ones draw
        from the engine's shared generator, whose draws shift when a dropped row took some."""
        if not (self.args.decode_ahead and requests):
            return None
        runs = lambda width: self.runner.can_run_ahead(requests, sampled, width)  # noqa: E731
        chunks = self.scheduler.schedule_ahead(requests, runs)
        if chunks is None:
            return None
        ahead = self.runner.run_ahead(requests, sampled)
        self.scheduler.computed(chunks)
        return requests, ahead

    def _append_token(self, request: Request, token: int, logprob: TokenLogprob | None) -> None:
        now = time.time()
        m = request.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        else:
            m.inter_token_times.append(now - m.last_token_time)
        m.last_token_time = now
        request.output_ids.append(token)
        request.pending_ids.append(token)
        if request.constraint is not None and not request.constraint.accept(token):
            # Not expected (the mask let the token through; SamplingParams.constrain refuses the settings that
            # generate past a grammar's end): logged, and the request goes on unconstrained rather than failing the
            # step of every request.
            log.warning("%s: token %d breaks its %s constraint; no longer constrained", request.request_id, token,
                        request.constraint.kind)
            request.constraint = None
        self.generation_tokens_total += 1
        if logprob is not None:
            request.pending_logprobs.append(logprob)
        params = request.params
        n_out = len(request.output_ids)
        finish = None
        if n_out >= params.min_tokens:
            if token in self.eos_token_ids and not params.ignore_eos:
                finish, request.stop_reason = "stop", token
            elif token in params.stop_token_ids:
                finish, request.stop_reason = "stop", token
        hidden = finish is not None and not (request.params.include_stop_str_in_output and token in params.stop_token_ids)
        text = "" if hidden else request.detokenizer.push([token])
        emit, matched = request.stop_matcher.feed(text)
        request.pending_text += emit
        if matched is not None and finish is None:
            finish, request.stop_reason = "stop", matched
        if finish is None and (n_out >= request.max_output or request.num_tokens >= self.max_model_len):
            finish = "length"
        if finish is not None:
            if matched is None:
                request.pending_text += request.stop_matcher.feed(request.detokenizer.flush())[0] + request.stop_matcher.flush()
            request.finish_reason = finish
            self.scheduler.finish(request)
            self.requests.pop(request.request_id, None)

    def _output(self, request: Request) -> RequestOutput:
        out = RequestOutput(
            request_id=request.request_id, token_ids=request.pending_ids, text=request.pending_text,
            finish_reason=request.finish_reason, prompt_tokens=len(request.prompt_ids),
            cached_tokens=request.num_cached, completion_tokens=len(request.output_ids),
            logprobs=request.pending_logprobs if request.params.logprobs is not None else None,
            stop_reason=request.stop_reason, metrics=request.metrics)
        request.pending_ids, request.pending_text, request.pending_logprobs = [], "", []
        if request.finished:
            request.metrics.finished_time = time.time()
            log.info("%s", request_timing(request))
        return out

    def stats(self) -> EngineStats:
        total = self.kv.num_blocks
        in_use = len({b for r in self.scheduler.running for b in r.blocks})
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=in_use / total, prefix_cached_kv_blocks=total - self.kv.num_free - in_use, prefix_queries=self.scheduler.prefix_queries,
            prefix_hits=self.scheduler.prefix_hits,
            prompt_tokens_total=self.prompt_tokens_total, generation_tokens_total=self.generation_tokens_total,
            num_preemptions=self.scheduler.num_preemptions, free_kv_blocks=self.kv.num_free, total_kv_blocks=total,
            free_state_slots=self.states.num_free, total_state_slots=self.states.num_slots)
