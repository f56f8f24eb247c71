"""The server under test: an OpenAI URL we are given, or our own server started for the run."""
from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from flashnext.bench.client import BenchError, OpenAIClient

_BYTES_KEYS = ("model_bytes", "model_size_bytes", "weights_bytes")
# e.g. "loaded 41.2 GB of weights in 12.3 s" or "model_bytes=44236593152"
_LOG_BYTES = re.compile(r"model_bytes[=: ]+(\d+)|loaded\D{0,20}?([\d.]+)\s*(GiB|GB|MiB|MB)", re.I)
_LOG_LOAD_S = re.compile(r"\bloaded .* in ([\d.]+) s\b")
_UNITS = {"gib": 2**30, "gb": 1e9, "mib": 2**20, "mb": 1e6}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LaunchedServer:
    """`python -m flashnext.cli serve` in a subprocess, its log in a file, timed to the first /health 200."""
    model: str
    server_args: str = ""
    timeout_s: float = 1800.0
    log_dir: str | None = None
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    startup_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", "flashnext.cli", "serve", "--model", self.model, "--host", "127.0.0.1",
                "--port", str(self.port), *shlex.split(self.server_args)]

    async def start(self) -> float:
        fd, name = tempfile.mkstemp(prefix="flashnext-bench-server-", suffix=".log", dir=self.log_dir)
        os.close(fd)
        self.log_path = Path(name)
        self.startup_s = await self._launch()
        return self.startup_s

    async def restart(self) -> float:
        """Stop the server and start it again with the same command; returns the seconds to /health 200.
        startup_s stays the first launch's (the startup benchmark's sample); the log goes on in the same file.
        The stop waits as long as a start may: a kill would cut short the server's shutdown, which writes its
        prefix cache to the disk tier."""
        await asyncio.to_thread(self.stop, grace_s=self.timeout_s)   # not a blocking wait in the event loop
        with open(self.log_path, "ab") as log:
            log.write(b"\n== flashnext bench: the server is stopped and started again (--restart) ==\n")
        return await self._launch()

    async def _launch(self) -> float:
        with open(self.log_path, "ab") as log:
            t0 = time.perf_counter()
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        async with httpx.AsyncClient(timeout=5.0) as http:
            while True:
                if self.proc.poll() is not None:
                    raise BenchError(f"the server exited with status {self.proc.returncode} before /health "
                                     f"answered 200. Command: {shlex.join(self.command)}\n"
                                     f"Last log lines:\n{self.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(f"{self.url}/health")).status_code == 200:
                        return time.perf_counter() - t0
                if time.perf_counter() - t0 > self.timeout_s:
                    self.stop()
                    raise BenchError(f"the server did not answer /health with 200 within {self.timeout_s:.0f} s "
                                     f"(--server-timeout). Last log lines:\n{self.log_tail()}")
                await asyncio.sleep(0.05)

    def log_tail(self, n: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self, grace_s: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def model_bytes(props: dict | None, log_text: str, model: str | None = None) -> tuple[int | None, str | None]:
    """(bytes, where from): what /props or the server's log reports, else the size of the checkpoint's
    safetensors files when --model is a folder; (None, None) when nothing says."""
    for key in _BYTES_KEYS:
        if isinstance(props, dict) and isinstance(props.get(key), (int, float)):
            return int(props[key]), f"/props {key}"
    m = _LOG_BYTES.search(log_text)
    if m and m.group(1):
        return int(m.group(1)), "server log"
    if m:
        return int(float(m.group(2)) * _UNITS[m.group(3).lower()]), "server log"
    if model and Path(model).is_dir():
        files = list(Path(model).glob("*.safetensors"))
        if files:
            return sum(f.stat().st_size for f in files), "checkpoint files"
    return None, None


def load_seconds(log_text: str) -> float | None:
    """The load time our server logs ("loaded … in 12.3 s"), or None."""
    m = _LOG_LOAD_S.search(log_text)
    return float(m.group(1)) if m else None


@dataclass
class Target:
    client: OpenAIClient
    url: str
    model_id: str
    models: dict | None
    props: dict | None
    server: LaunchedServer | None

    def describe(self) -> dict:
        info = {"url": self.url, "model_id": self.model_id, "models": self.models, "props": self.props,
                "launched": self.server is not None}
        if self.server is not None:
            info.update(command=shlex.join(self.server.command), startup_s=self.server.startup_s,
                        log=str(self.server.log_path))
        return info


@contextlib.asynccontextmanager
async def open_target(args):
    """Connect to --url, or start our server for --model and stop it afterwards."""
    server = None
    if args.url:
        url = args.url
    elif args.model:
        server = LaunchedServer(args.model, args.server_args or "", args.server_timeout)
        await server.start()
        url = server.url
    else:
        raise BenchError("say which server to measure: --url URL (any OpenAI-compatible server) or "
                         "--model DIR|preset (starts ours).")
    client = OpenAIClient(url, args.api_key, request_timeout_s=args.request_timeout)
    try:
        client.model = args.model_name or await client.model_id()
        models = await client.get_json("/v1/models")
        props = await client.get_json("/props")
        yield Target(client, client.root, client.model, models, props, server)
    finally:
        await client.aclose()
        if server is not None:
            server.stop()
