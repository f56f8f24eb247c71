"""Markdown from results files: one section per file, the command that reproduces it, floors beside."""
from __future__ import annotations

import json
from pathlib import Path

from flashnext.bench.floors import floor_key
from flashnext.bench.results import SCHEMA_VERSION
from flashnext.bench.runner import BENCHES, bench_module


def load(path: str | Path) -> dict:
    result = json.loads(Path(path).read_text())
    if result.get("schema_version") != SCHEMA_VERSION or result.get("bench") not in BENCHES:
        raise ValueError(f"{path} is not a flashnext bench results file of schema {SCHEMA_VERSION}.")
    return result


def gpu_name(result: dict) -> str:
    gpu = result.get("gpu")
    if isinstance(gpu, list) and gpu:
        return f"{len(gpu)}× {gpu[0]['name']} (driver {gpu[0]['driver']})" if len(gpu) > 1 else \
            f"{gpu[0]['name']} (driver {gpu[0]['driver']})"
    return "cpu"


def section(result: dict) -> str:
    key = floor_key(result)
    head = (f"### {result['bench']} — {result['model_id']}\n\n"
            f"{result['started_at']} on {gpu_name(result)}, commit `{result['commit'][:12]}`, server "
            f"{result['server']['url']}{' (started by the bench)' if result['server'].get('launched') else ''}; "
            f"floor: {key or 'none known for this model'}.\n\n"
            f"```\n{result['command']}\n```\n")
    return head + "\n" + bench_module(result["bench"]).table(result) + "\n"


def render(paths: list[str | Path]) -> str:
    order = list(BENCHES)
    results = sorted((load(p) for p in paths), key=lambda r: (order.index(r["bench"]), r["started_at"]))
    return "\n".join(section(r) for r in results)
