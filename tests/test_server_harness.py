"""Starts the real server (`python -m flashnext.cli serve`) on the tiny model, in a subprocess.

The other tests/test_server_*.py import `shared_server` (one server for the whole session) or start their
own with special flags. FLASHNEXT_TEST_SERVER_CMD replaces the command prefix (e.g. to run the same
contract tests against another build).
"""
from __future__ import annotations

import atexit
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

API_KEY = "test-key-123"
START_TIMEOUT_S = float(os.environ.get("FLASHNEXT_TEST_START_TIMEOUT", "600"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command() -> list[str]:
    custom = os.environ.get("FLASHNEXT_TEST_SERVER_CMD")
    return shlex.split(custom) if custom else [sys.executable, "-m", "flashnext.cli", "serve"]


class ServerProcess:
    """One server subprocess; the port and the API key go in through env vars, as a deployment would."""

    def __init__(self, *flags: str, api_key: str = API_KEY, env: dict | None = None):
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.health_codes: list[int] = []
        self.log = tempfile.NamedTemporaryFile("w+", prefix="flashnext-server-", suffix=".log", delete=False)
        full_env = dict(os.environ, FLASHNEXT_PORT=str(self.port), FLASHNEXT_API_KEY=api_key, **(env or {}))
        self.proc = subprocess.Popen(server_command() + list(flags), env=full_env, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        atexit.register(self.stop)
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                r = httpx.get(self.base + "/health", timeout=2)
            except httpx.TransportError:
                time.sleep(0.2)
                continue
            self.health_codes.append(r.status_code)
            if r.status_code == 200:
                return
            assert r.status_code == 503, r.text
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not healthy after {START_TIMEOUT_S} s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-8000:]

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"}

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.base, headers=self.headers, timeout=kw.pop("timeout", 120), **kw)

    def openai(self):
        import openai

        return openai.OpenAI(base_url=self.base + "/v1", api_key=self.api_key, max_retries=0, timeout=120)

    def model_id(self) -> str:
        with self.client() as c:
            return c.get("/v1/models").json()["data"][0]["id"]

    def engine_stats(self) -> dict:
        with self.client() as c:
            r = c.get("/debug/engine")
            r.raise_for_status()
            return r.json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


_shared: list[ServerProcess] = []


@pytest.fixture(scope="session")
def shared_server() -> ServerProcess:
    """The session's server with default flags; started on first use, stopped at exit."""
    if not _shared:
        _shared.append(ServerProcess())
    return _shared[0]


def test_health_is_503_in_openai_shape_until_loaded_then_200(shared_server):
    # The harness checked the shape of every non-200 answer while waiting; now it must stay up.
    assert shared_server.health_codes[-1] == 200
    assert httpx.get(shared_server.base + "/health").status_code == 200


def test_health_needs_no_key_but_v1_does(shared_server):
    assert httpx.get(shared_server.base + "/health").status_code == 200
    r = httpx.get(shared_server.base + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(shared_server.base + "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_help_lists_every_flag_with_its_env_var():
    out = subprocess.run(server_command() + ["--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    for flag in ("model", "host", "port", "api-key", "api-key-file", "served-model-name", "max-model-len",
                 "max-num-seqs", "max-queued-requests", "gpu-memory-fraction", "dtype", "tool-call-parser",
                 "log-level", "max-request-bytes", "sse-keepalive"):
        assert f"--{flag}" in text
        assert "FLASHNEXT_" + flag.upper().replace("-", "_") in text.replace("- ", "-")
