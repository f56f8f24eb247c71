"""`flashnext serve | generate | bench | synth | inspect`. Every flag also reads an env var FLASHNEXT_<FLAG>."""
from __future__ import annotations

import argparse
import logging
import os
import sys


def _env_default(flag: str, default, type=str):
    raw = os.environ.get("FLASHNEXT_" + flag.lstrip("-").upper().replace("-", "_"))
    return type(raw) if raw is not None else default


def _flag(parser, flag: str, default=None, type=str, help="", **kw):
    env = "FLASHNEXT_" + flag.lstrip("-").upper().replace("-", "_")
    if kw.get("action") == "store_true":
        parser.add_argument(flag, default=_env_default(flag, default, lambda v: v.lower() in ("1", "true", "yes")),
                            help=f"{help} [env {env}]", **kw)
        return
    shown = "" if default is None else f"; default {default}"
    parser.add_argument(flag, default=_env_default(flag, default, type), type=type, help=f"{help} [env {env}{shown}]", **kw)


def _add_generate(sub):
    p = sub.add_parser("generate", help="generate text from a prompt; prints only the generated text")
    _flag(p, "--model", "tiny-flash-next", help="model folder, hub id or preset name")
    _flag(p, "--prompt", help="the prompt (raw text unless --chat)", required=_env_default("--prompt", None) is None)
    _flag(p, "--max-tokens", 64, int, help="tokens to generate at most")
    _flag(p, "--temperature", 0.0, float, help="sampling temperature; 0 is greedy")
    _flag(p, "--top-p", 1.0, float, help="nucleus sampling threshold")
    _flag(p, "--top-k", 0, int, help="sample among the k most likely tokens (0: off)")
    _flag(p, "--seed", None, int, help="sampling seed")
    _flag(p, "--chat", False, action="store_true", help="apply the model's chat template to the prompt")
    _flag(p, "--dtype", "checkpoint", help="activation dtype: checkpoint (what config.json declares), auto (bf16 on GPU, "
          "float32 on CPU), bfloat16, float16, float32")
    _flag(p, "--device", "auto", help="cpu, cuda or auto")


def _add_synth(sub):
    from flashnext.weights.presets import PRESETS

    p = sub.add_parser("synth", help="write a synthetic HF checkpoint (random weights) of a preset")
    _flag(p, "--preset", "tiny-flash-next", choices=sorted(PRESETS), help="which model shape")
    _flag(p, "--dtype", "bf16", choices=["bf16", "int4", "int4-ct", "fp8"],
          help="weight format: bf16, int4 (AutoRound, auto_gptq packing), int4-ct (compressed-tensors pack-quantized "
               "W4A16, llm-compressor's format) or fp8 (block-FP8)")
    _flag(p, "--out", help="output folder", required=_env_default("--out", None) is None)
    _flag(p, "--layers", None, int, help="override the number of layers")
    _flag(p, "--seed", 0, int, help="random seed")


def _add_inspect(sub):
    p = sub.add_parser("inspect", help="print a checkpoint's parsed config and sizes")
    _flag(p, "--model", "tiny-flash-next", help="model folder, hub id or preset name")


def run_generate(args) -> int:
    from flashnext.engine.llm import LLM
    from flashnext.engine.sampling_params import SamplingParams

    llm = LLM(args.model, dtype=args.dtype, device=args.device)
    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    out = llm.generate([prompt], params)[0]
    sys.stdout.write(out.text + "\n")
    return 0


def run_synth(args) -> int:
    from flashnext.weights.synth import synthesize

    path = synthesize(args.preset, args.out, dtype=args.dtype, layers=args.layers, seed=args.seed)
    print(path)
    return 0


def run_inspect(args) -> int:
    import dataclasses
    import json

    from flashnext.engine.loading import resolve_model
    from flashnext.weights.config import load_config

    cfg = load_config(resolve_model(args.model))
    print(json.dumps({k: v for k, v in dataclasses.asdict(cfg).items() if k != "raw"}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    from flashnext.bench.cli import add_bench_arguments, run_bench
    from flashnext.server.serve import add_serve_arguments, run_serve

    parser = argparse.ArgumentParser(prog="flashnext", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_arguments(sub.add_parser("serve", help="OpenAI-compatible HTTP server"))
    _add_generate(sub)
    add_bench_arguments(sub)
    _add_synth(sub)
    _add_inspect(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.command == "generate" else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handlers = {"serve": run_serve, "generate": run_generate, "bench": run_bench, "synth": run_synth,
                "inspect": run_inspect}
    return handlers[args.command](args) or 0


if __name__ == "__main__":
    sys.exit(main())
