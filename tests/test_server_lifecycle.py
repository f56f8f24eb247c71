"""Requests that end badly: a client that disconnects mid-stream, and more clients than the engine admits."""
from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from test_server_harness import ServerProcess, shared_server  # noqa: F401  (fixture)

LONG_CHAT = {"messages": [{"role": "user", "content": "Tell a very long story."}], "ignore_eos": True}


def wait_idle(server: ServerProcess, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = server.engine_stats()
        if stats["num_running"] == 0 and stats["num_waiting"] == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def test_debug_engine_needs_the_key(shared_server):
    assert httpx.get(shared_server.base + "/debug/engine").status_code == 401
    assert {"num_running", "num_waiting", "kv_cache_usage"} <= set(shared_server.engine_stats())


def test_disconnect_mid_stream_frees_the_request(shared_server):
    before = wait_idle(shared_server)
    with shared_server.client() as c:
        with c.stream("POST", "/v1/chat/completions", json={**LONG_CHAT, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in got)
            assert shared_server.engine_stats()["num_running"] == 1
        # leaving the block closes the connection mid-stream
    after = wait_idle(shared_server, timeout=5)
    assert after["num_running"] == 0 and after["num_waiting"] == 0, after
    assert after["kv_cache_usage"] <= before["kv_cache_usage"] + 1e-6, (before, after)
    if "free_state_slots" in after:  # the engine's own detail beyond the contract's stats
        assert after["free_state_slots"] == after["total_state_slots"], after
        # what is not free is held by the prefix cache alone (evictable), never by the aborted request
        assert after["free_kv_blocks"] + after["prefix_cached_kv_blocks"] == after["total_kv_blocks"], after


def test_disconnect_while_waiting_for_non_streaming_answer(shared_server):
    wait_idle(shared_server)
    with pytest.raises(httpx.ReadTimeout):
        with shared_server.client(timeout=1.0) as c:
            c.post("/v1/chat/completions", json=LONG_CHAT)
    after = wait_idle(shared_server, timeout=5)
    assert after["num_running"] == 0 and after["num_waiting"] == 0, after
    if "free_state_slots" in after:
        assert after["free_state_slots"] == after["total_state_slots"], after


@pytest.fixture(scope="module")
def tight_server():
    server = ServerProcess("--max-queued-requests", "1", "--max-num-seqs", "1", "--sse-keepalive", "0.01")
    yield server
    server.stop()


def test_overload_answers_429_with_retry_after_and_admitted_requests_finish(tight_server):
    async def one(client: httpx.AsyncClient, i: int):
        body = {"messages": [{"role": "user", "content": f"Story {i}"}], "max_tokens": 32, "ignore_eos": True,
                "stream": i % 2 == 0}
        r = await client.post("/v1/chat/completions", json=body)
        return r

    async def burst():
        async with httpx.AsyncClient(base_url=tight_server.base, headers=tight_server.headers,
                                     timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(10)))

    responses = asyncio.run(burst())
    refused = [r for r in responses if r.status_code in (429, 503)]
    admitted = [r for r in responses if r.status_code == 200]
    assert refused and admitted and len(refused) + len(admitted) == len(responses), \
        [r.status_code for r in responses]
    for r in refused:
        assert int(r.headers["Retry-After"]) >= 1
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    for r in admitted:
        if r.headers["content-type"].startswith("text/event-stream"):
            assert r.text.rstrip().endswith("data: [DONE]") and '"finish_reason":"length"' in r.text
            assert '"error"' not in r.text
        else:
            assert r.json()["choices"][0]["finish_reason"] == "length"
            assert r.json()["usage"]["completion_tokens"] == 32
    assert httpx.get(tight_server.base + "/health").status_code == 200


def test_keepalive_comments_while_the_prompt_is_prefilled(tight_server):
    # A 3000-token prompt takes far longer than the 10 ms keep-alive interval to prefill.
    body = {"prompt": [5] * 3000, "max_tokens": 2, "stream": True}
    with tight_server.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
        lines = [line for line in r.iter_lines() if line]
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data: "))
    assert first_data > 0 and all(line == ": keep-alive" for line in lines[:first_data]), lines[:5]
    assert lines[-1] == "data: [DONE]"


def test_chat_stream_opens_its_choice_with_the_first_token(tight_server):
    # The role chunk comes with the first generated token, after the prefill's keep-alives,
    # so the first data frame marks the first token even when the text is held back.
    body = {"messages": [{"role": "user", "content": "tokens " * 2500}], "max_tokens": 2, "stream": True}
    with tight_server.client() as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = [line for line in r.iter_lines() if line]
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data: "))
    assert first_data > 0 and all(line == ": keep-alive" for line in lines[:first_data]), lines[:5]
    assert json.loads(lines[first_data][6:])["choices"][0]["delta"]["role"] == "assistant"


def test_sigterm_writes_the_prefix_cache_to_the_disk_tier_before_exiting(tmp_path):
    server = ServerProcess("--kv-disk-dir", str(tmp_path / "kv"))
    try:
        with server.client() as c:
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Remember this."}],
                                                      "max_tokens": 4})
            assert r.status_code == 200, r.text
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        server.stop()
    assert "cached conversation states to the disk tier" in server.output()
    assert any((tmp_path / "kv").rglob("*")), "nothing written to the disk tier"
