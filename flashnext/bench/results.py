"""The results file: what ran, where, with which flags, and every sample's raw numbers."""
from __future__ import annotations

import datetime as dt
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from flashnext.bench.client import BenchError

SCHEMA_VERSION = 1
_REPO = Path(__file__).resolve().parents[2]


def utc_now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


COMMIT_PATTERN = re.compile(r"[0-9a-f]{7,40}(\+\S*)?")   # a sha, optionally "+" a note of what differs


def commit_from_env() -> str | None:
    """FLASHNEXT_COMMIT (None when unset); a BenchError when it is not a commit: checked before a run, since a
    results file naming a wrong commit cannot be traced back (session 11 wrote "4" and "PLACEHOLDER")."""
    value = os.environ.get("FLASHNEXT_COMMIT")
    if value and not COMMIT_PATTERN.fullmatch(value):
        raise BenchError(f"FLASHNEXT_COMMIT={value!r} is not a commit (7-40 hex digits, optionally +note)")
    return value or None


def git_commit() -> str:
    """HEAD of the checkout; FLASHNEXT_COMMIT where the tree is a copy without .git (the GPU machine)."""
    if commit := commit_from_env():
        return commit
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=_REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def gpu_info() -> list[dict] | str:
    """[{name, driver}] per GPU from nvidia-smi, or "cpu" where there is none."""
    if shutil.which("nvidia-smi") is None:
        return "cpu"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "cpu"
    gpus = []
    for line in out.stdout.strip().splitlines():
        name, driver, memory = (part.strip() for part in (line.split(",") + ["", ""])[:3])
        gpus.append({"name": name, "driver": driver, "memory": memory})
    return gpus or "cpu"


_LAUNCHERS = {"cli.py": ["python", "-m", "flashnext.cli"]}


def command_line(argv: list[str] | None = None) -> str:
    """The command that reproduces a run, with the FLASHNEXT_* settings of the environment: the bench's own
    (FLASHNEXT_BENCH_*) and the switches a server it starts inherits (e.g. FLASHNEXT_EXPERT_CLAIMS=reference, which
    the flags alone would not show). Not FLASHNEXT_COMMIT (the result names its commit apart) nor FLASHNEXT_CACHE (a
    place on this machine, not a setting)."""
    env = [f"{k}={v}" for k, v in sorted(os.environ.items())
           if k.startswith("FLASHNEXT_") and k not in ("FLASHNEXT_COMMIT", "FLASHNEXT_CACHE")]
    if argv is None:
        argv = [*_LAUNCHERS.get(Path(sys.argv[0]).name, [Path(sys.argv[0]).name]), *sys.argv[1:]]
    return shlex.join([*env, *argv])


def json_flags(args) -> dict:
    return {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, list, type(None)))}


def model_slug(model_id: str) -> str:
    name = model_id.rstrip("/").split("/")[-1] or "model"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name)[:60]


def build(bench: str, target, args, samples: list[dict], info: dict, started_at: str) -> dict:
    return {
        "schema_version": SCHEMA_VERSION, "bench": bench, "commit": git_commit(), "gpu": gpu_info(),
        "server": target.describe(), "model_id": target.model_id, "flags": json_flags(args),
        "command": command_line(getattr(args, "argv", None)), "started_at": started_at, "finished_at": utc_now(),
        "info": info, "samples": samples,
    }


def write(result: dict, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = result["started_at"].replace("-", "").replace(":", "")
    stem = f"{result['bench']}-{model_slug(result['model_id'])}-{stamp}"
    path = out / f"{stem}.json"
    n = 1
    while path.exists():
        n += 1
        path = out / f"{stem}-{n}.json"
    path.write_text(json.dumps(_finite(result), indent=1, allow_nan=False) + "\n")
    return path


def _finite(value):
    """NaN and infinities become null: JSON has no spelling for them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
