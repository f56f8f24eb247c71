"""`flashnext serve`: flags (each also an env var), background model loading, uvicorn.

The HTTP server comes up first and answers /health with 503 while the model loads, so orchestrators can
tell "starting" from "dead".
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
import time

log = logging.getLogger("flashnext.server")

ENV_PREFIX = "FLASHNEXT_"


def _env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


def _add(parser, flag: str, *, type=str, default=None, help: str, choices=None):
    env = _env_name(flag)
    raw = os.environ.get(env)
    if raw is not None:
        try:
            default = type(raw)
        except ValueError:
            parser.error(f"{env}={raw!r} is not a valid value for {flag}.")
    shown = "" if default is None or default == "" else f"; default {default}"
    parser.add_argument(flag, type=type, default=default, choices=choices, help=f"{help} [env {env}{shown}]")


def _bool(raw: str) -> bool:
    if str(raw).lower() in ("1", "true", "yes", "on"):
        return True
    if str(raw).lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(raw)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    from flashnext.engine.args import DEFAULT_MODEL

    _add(parser, "--model", default=DEFAULT_MODEL,
         help=f"model directory, Hugging Face hub id or preset name ({DEFAULT_MODEL}: the embedded tiny synthetic "
              "model, built into a cache folder on first use)")
    _add(parser, "--host", default="127.0.0.1", help="address to listen on")
    _add(parser, "--port", type=int, default=8000, help="port to listen on")
    _add(parser, "--api-key", help="require 'Authorization: Bearer <key>' on every route but /health and /metrics")
    _add(parser, "--api-key-file", help="read the API key from this file (keeps it out of the process list)")
    _add(parser, "--served-model-name", help="the model id clients send and /v1/models lists (default: --model)")
    _add(parser, "--max-model-len", type=int, help="context length (default: the model's)")
    _add(parser, "--max-num-seqs", type=int, help="most sequences in the running batch")
    _add(parser, "--max-queued-requests", type=int,
         help="most requests waiting for a slot; more get 429 with Retry-After")
    _add(parser, "--gpu-memory-fraction", type=float, help="share of GPU memory the engine may plan for")
    _add(parser, "--dtype", help="activation dtype: auto (bf16 on GPU, float32 on CPU), checkpoint (config.json's), bfloat16, float16, float32")
    _add(parser, "--device", help="cpu, cuda or auto (default: cuda when available)")
    _add(parser, "--max-num-batched-tokens", type=int,
         help="token budget of one engine step: prefill chunks plus decodes; larger prefill chunks run faster "
              "and keep more activation memory (default 16384 on a GPU of 72 GiB or more, e.g. 80 GB cards, else 8192)")
    _add(parser, "--prefill-budget-while-decoding", type=int,
         help="prefill tokens per step while any sequence decodes, so running streams keep flowing while a long "
              "prompt enters (default 2048)")
    _add(parser, "--decode-step-budget-ms", type=float,
         help="size the prefill chunks of steps that also decode so such a step takes about this long, from "
              "measured step times (at most --prefill-budget-while-decoding tokens; default 0: off)")
    _add(parser, "--decode-steps-between-prefill", type=int,
         help="after each step that carries a prefill chunk while other sequences decode, run this many steps of "
              "decodes alone, so running streams keep flowing while long prompts enter (an eager prefill step has a "
              "fixed host cost however small its chunk); 0: every step may mix (default 0)")
    _add(parser, "--graph-prefill-tail", type=int,
         help="with CUDA graphs, a prompt chunk of at most this many tokens (an agent turn's generation prompt, a "
              "short tool result after a prefix hit) is fed one token a step through the captured decode graph "
              "instead of one eager step (6-8 ms a token against 120-150 ms a step for full-size Flash-Next on an "
              "H200), where --graph-extend-max's chained steps cannot run (16-bit experts, --expert-vram-gb, several "
              "GPUs) or are off (--graph-extend-max 0); 0: off (default 16)")
    _add(parser, "--graph-extend-max", type=int,
         help="with CUDA graphs, a prompt chunk of at most this many tokens that continues a sequence (a resumed "
              "conversation's new message, a tool result, the generation prompt after a turn's history) replays "
              "captured steps of one sequence's tokens (powers of two up to 128, largest first) instead of one eager "
              "step; INT4 experts without an expert cache, one GPU; supersedes --graph-prefill-tail; longer chunks "
              "take --graph-prefill-max's row-wise graphs (on an H200 faster from ~60 tokens: 120 new tokens on 30K "
              "of context 74-76 ms against 128-131 chained); 0: off (default 48)")
    _add(parser, "--graph-prefill-max", type=int,
         help="with CUDA graphs, a prefill step of at most this many tokens (a fresh short prompt, a chunk past "
              "--graph-extend-max) replays its row-wise work (projections, norms, hyper-connection mixes, the MoE) "
              "from graphs captured at warm-up for rows padded up to a bucket (powers of two to 1,024, then multiples of "
              "512), and runs what mixes tokens (attention, the QSA indexer, PLE; GatedDeltaNet too in steps of "
              "several sequences: a step of one captures its conv and delta rule) eagerly; INT4 experts without an "
              "expert cache, one GPU; 0: off (default 4096)")
    _add(parser, "--decode-ahead", type=_bool,
         help="with CUDA graphs on one GPU, queue each decode step on the device, fed the tokens the step before "
              "sampled there, before the host reads those tokens, so the host's work between steps (detokenising, "
              "stop checks, streaming) overlaps the GPU's; false: every step waits for the host (default true)")
    _add(parser, "--kv-cache-gb", type=float, help="KV cache size in GiB (default: from free memory)")
    _add(parser, "--block-size", type=int, help="tokens per KV block (default 16)")
    _add(parser, "--seed", type=int, help="seed of the engine's shared sampling generator (default 0)")
    _add(parser, "--ple-placement", choices=["auto", "device", "host"],
         help="where Flash-Next's PLE n-gram table lives: host = pinned RAM, 16 rows read by the GPU per token (auto: "
              "host when the table is over 4 GiB; default auto)")
    _add(parser, "--warmup", type=_bool,
         help="on a GPU, run throwaway requests before /health says ready, so the first request does not pay "
              "for kernel compilation and graph captures (a minute for full-size Flash-Next; default true)")
    _add(parser, "--enforce-eager", type=_bool,
         help="run every decode step eagerly instead of replaying captured CUDA graphs (debugging; default false)")
    _add(parser, "--quantize", choices=["int4"],
         help="quantise the dense projections and routed experts at load and keep them INT4 in memory (int4: RTN, "
              "group 128; docs/int4.md)")
    _add(parser, "--expert-vram-gb", type=float,
         help="keep the routed experts in host memory and this many GiB of expert slots on the device, all layers "
              "together (needs --quantize int4; at least top-k slots per layer; docs/expert_cache.md; default: off, "
              "every expert resident)")
    _add(parser, "--expert-prefetch", type=_bool,
         help="with --expert-vram-gb: while a layer computes, copy in the experts the next layer's router picks "
              "for this layer's input (decode-sized batches; default true)")
    _add(parser, "--expert-cache-policy", choices=["lfu-decay", "lru"],
         help="which cached expert the eager path (prefill, --enforce-eager) evicts: decayed hit count or least "
              "recently used; captured decode steps evict the least recently used (docs/expert_cache.md; default "
              "lfu-decay)")
    _add(parser, "--routing-trace", choices=["calibrated"],
         help="benchmark mode: routers pick experts from a trace with Flash-Next's published locality (LRU-64 hits "
              "~67%%, LRU-128 ~81%%) instead of their own top-k; outputs are not the model's (default: off)")
    _add(parser, "--tensor-parallel", type=int,
         help="GPUs of this host to split attention and GatedDeltaNet heads over; starts one worker process per "
              "extra GPU (docs/parallel.md; default 1)")
    _add(parser, "--expert-parallel", type=int,
         help="GPUs to split the routed experts over, whole experts per GPU: 1 or the --tensor-parallel size "
              "(docs/parallel.md; default 1)")
    _add(parser, "--ple-share-dir",
         help="several GPUs: the ranks share one copy of a host-placed PLE table (102 GB for Flash-Next in bf16) "
              "through a file here, in RAM for /dev/shm; off keeps one copy per rank (default /dev/shm)")
    _add(parser, "--tool-call-parser", default="auto", choices=["auto", "hermes", "qwen3_coder"],
         help="tool-call format in the model's output (auto: from the chat template)")
    _add(parser, "--sse-keepalive", type=float, default=2.0,
         help="seconds of model silence (e.g. a long prefill) after which a stream gets a ': keep-alive' comment")
    _add(parser, "--max-request-bytes", type=int, default=32 << 20, help="largest request body accepted (413 above)")
    _add(parser, "--enable-prefix-caching", type=_bool,
         help="reuse cached prefixes (KV blocks + recurrent-state snapshots) across requests (default true)")
    _add(parser, "--prefix-snapshot-interval", type=int,
         help="a state snapshot at the first prefill chunk end past every multiple of this many prompt tokens "
              "(chunks are never cut for it); 0: none (default 1024)")
    _add(parser, "--prefix-cache-gb", type=float,
         help="device memory for prefix-cache state snapshots (default: room for 3 a sequence slot, --max-num-seqs "
              "× 3 × (one slot's states + a KV block), cut to what the GPU has left beside an explicit --kv-cache-gb; the log's "
              "memory plan prints it)")
    _add(parser, "--kv-host-gb", type=float, help="host-RAM tier for evicted prefix-cache entries (default 0: off)")
    _add(parser, "--kv-host-write-through", type=_bool,
         help="write every finished turn to the host and disk tiers at once (default false)")
    _add(parser, "--kv-host-idle-copy", type=_bool,
         help="while no request runs, copy device prefix-cache entries to the host tier ahead of their eviction, "
              "so a request that needs their blocks does not wait for the copy (default true; only with --kv-host-gb, on one "
              "device)")
    _add(parser, "--kv-host-write-behind", type=_bool,
         help="while requests run, copy a piece of a device prefix-cache entry to the host tier beside decode steps "
              "queued ahead and prefill steps of 1,024+ tokens, on a stream of its own that the steps do not wait "
              "for, ahead of the entry's eviction, while the host tier has room (default true; only with "
              "--kv-host-gb, on one device; decode steps slow while it copies)")
    _add(parser, "--kv-disk-dir", help="disk tier directory: cached conversations survive a restart")
    _add(parser, "--kv-disk-gb", type=float, help="size of the disk tier (default 16)")
    _add(parser, "--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log verbosity")


# Flags that belong to the engine, under the engine's field names.
_ENGINE_FLAGS = {"model": "model", "device": "device", "max_num_batched_tokens": "max_num_batched_tokens",
                 "prefill_budget_while_decoding": "prefill_budget_while_decoding",
                 "decode_step_budget_ms": "decode_step_budget_ms",
                 "decode_steps_between_prefill": "decode_steps_between_prefill",
                 "kv_cache_gb": "kv_cache_gb", "block_size": "block_size", "seed": "seed", "max_model_len": "max_model_len", "max_num_seqs": "max_num_seqs",
                 "max_queued_requests": "max_queued_requests", "graph_prefill_tail": "graph_prefill_tail", "graph_extend_max": "graph_extend_max", "graph_prefill_max": "graph_prefill_max", "decode_ahead": "decode_ahead", "gpu_memory_fraction": "gpu_memory_fraction",
                 "dtype": "dtype", "quantize": "quantize", "enforce_eager": "enforce_eager", "warmup": "warmup", "ple_placement": "ple_placement", "enable_prefix_caching": "enable_prefix_caching",
                 "prefix_snapshot_interval": "prefix_snapshot_interval", "prefix_cache_gb": "prefix_cache_gb",
                 "kv_host_gb": "kv_host_gb", "kv_host_write_through": "kv_host_write_through",
                 "kv_host_idle_copy": "kv_host_idle_copy", "kv_host_write_behind": "kv_host_write_behind",
                 "kv_disk_dir": "kv_disk_dir", "kv_disk_gb": "kv_disk_gb", "tensor_parallel": "tensor_parallel",
                 "expert_parallel": "expert_parallel", "ple_share_dir": "ple_share_dir",
                 "expert_vram_gb": "expert_vram_gb",
                 "expert_cache_policy": "expert_cache_policy", "expert_prefetch": "expert_prefetch", "routing_trace": "routing_trace"}


def engine_args_from(args: argparse.Namespace):
    """The engine's EngineArgs from our flags; unset flags keep the engine's defaults."""
    from flashnext.engine.args import EngineArgs

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    values = {}
    for flag, field in _ENGINE_FLAGS.items():
        value = getattr(args, flag)
        if value is None or value == "":
            continue
        if field not in fields:
            raise SystemExit(f"--{flag.replace('_', '-')} is not supported by this engine build.")
        values[field] = value
    return EngineArgs(**values)


def load_engine(engine_args):
    """The engine the server runs, warmed up; then the startup heap frozen, long collector pauses logged and full
    collections moved to the engine's idle time (server/gc_pauses.py)."""
    from flashnext.engine.async_llm import AsyncLLM
    from flashnext.server.gc_pauses import IdleFullCollections, PauseLog, freeze_startup_heap

    if max(engine_args.tensor_parallel, engine_args.expert_parallel) > 1:
        from flashnext.parallel import launch_engine

        # This process becomes rank 0 (scheduler, sampling, HTTP); the other ranks are its child processes.
        engine = launch_engine(engine_args)
    else:
        from flashnext.engine.llm_engine import LLMEngine

        engine = LLMEngine(engine_args)
    if engine_args.warmup and engine.device.type == "cuda":
        log.info("warming up (kernel compilation, graph captures) before serving")
        log.info("warm-up took %.1f s", engine.warm_up())
    freeze_startup_heap()
    return AsyncLLM(engine, on_idle=IdleFullCollections(PauseLog().install()))


def _api_key(args) -> str | None:
    if args.api_key_file:
        try:
            with open(args.api_key_file) as f:
                key = f.read().strip()
        except OSError as exc:
            raise SystemExit(f"cannot read --api-key-file {args.api_key_file}: {exc.strerror}")
        if not key:
            raise SystemExit(f"--api-key-file {args.api_key_file} is empty.")
        return key
    return args.api_key or None


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from flashnext.server.app import ServerSettings, build_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine_args = engine_args_from(args)
    settings = ServerSettings(served_model_name=args.served_model_name or args.model,
                              model_path=args.model or "", api_key=_api_key(args),
                              max_request_bytes=args.max_request_bytes, tool_call_parser=args.tool_call_parser,
                              keepalive_s=args.sse_keepalive,
                              max_num_seqs=args.max_num_seqs)
    slot = {"engine": None}
    app = build_app(lambda: slot["engine"], settings)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    failed = []

    async def load():
        start = time.perf_counter()
        try:
            engine = await asyncio.to_thread(load_engine, engine_args)
            if hasattr(engine, "start"):
                await engine.start()
        except BaseException as exc:
            log.exception("loading the model failed")
            failed.append(exc)
            server.should_exit = True
            return
        _log_loaded(engine, settings, time.perf_counter() - start)
        slot["engine"] = engine

    async def main():
        task = asyncio.create_task(load())
        try:
            await server.serve()
        finally:
            task.cancel()
            engine = slot["engine"]
            if engine is not None and hasattr(engine, "shutdown"):
                result = engine.shutdown()
                if asyncio.iscoroutine(result):
                    await result

    log.info("serving on http://%s:%d (model loading in the background; /health answers 503 until ready)",
             args.host, args.port)
    signal.signal(signal.SIGTERM, _exit_after_shutdown)
    asyncio.run(main())
    return 1 if failed else 0


def _exit_after_shutdown(signum, frame) -> None:
    """SIGTERM (docker stop, systemd, the bench): uvicorn drains the connections, then raises the signal again
    once serve() returns; the default handler would kill the process there, before main()'s finally writes the
    prefix cache down to the disk tier. Raised as SystemExit, the finally runs first."""
    raise SystemExit(128 + signum)


def _log_loaded(engine, settings, seconds: float) -> None:
    # The engine logs its memory plan itself while loading.
    source = getattr(engine, "model_path", None) or settings.model_path
    log.info("loaded %s from %s in %.1f s; serving it as '%s', max_model_len %d", getattr(engine, "model_name", "?"),
             source, seconds, settings.served_model_name, engine.max_model_len)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flashnext serve", description="OpenAI-compatible HTTP server")
    add_serve_arguments(parser)
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
