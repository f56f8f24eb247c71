"""Every JSON body the server sends encodes: UTF-8 with non-ASCII as itself, and text holding a lone surrogate
(which has no UTF-8) as \\u escapes instead of a 500 or a stream cut off without [DONE]."""
from __future__ import annotations

import json
import re

import pytest

from flashnext.server.json_body import json_bytes, json_text
from test_server_contract import CHAT, MSGS, post_json, sse_events
from test_server_harness import ServerProcess, shared_server  # noqa: F401  (fixture)


@pytest.mark.parametrize("value, body", [
    ({"a": "café 🙂"}, '{"a":"café 🙂"}'.encode()),
    ({"a": "caf\udce9", "b": "é"}, b'{"a":"caf\\udce9","b":"\\u00e9"}'),   # all escaped: one rule per body
])
def test_json_bytes(value, body):
    assert json_bytes(value) == body and json.loads(body) == value


def test_json_text_encodes_on_its_own_and_refuses_nan():
    text = json_text({"k": "\ud83d"}, separators=(", ", ": "))
    assert text == '{"k": "\\ud83d"}' and json.loads(text) == {"k": "\ud83d"}
    with pytest.raises(ValueError):
        json_bytes({"x": float("nan")})


# A name given in Latin-1 bytes (b"caf\xe9"): Python decodes a non-UTF-8 argv byte to a lone surrogate
# (surrogateescape), and every response names the served model.
LATIN1_NAME = "caf\udce9"


@pytest.fixture(scope="module")
def latin1_server():
    server = ServerProcess("--served-model-name", LATIN1_NAME)
    yield server
    server.stop()


def test_a_served_name_without_utf8_is_listed_and_echoed(latin1_server):
    with latin1_server.client() as c:
        assert c.get("/v1/models").json()["data"][0]["id"] == LATIN1_NAME
        assert c.get("/props").json()["model_alias"] == LATIN1_NAME
        # The client sends back the name it was given (as a JSON escape) and gets it echoed.
        r = post_json(c, CHAT, {"model": LATIN1_NAME, "messages": MSGS, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == LATIN1_NAME, r.text
        r = post_json(c, "/v1/completions", {"prompt": "Once", "max_tokens": 2, "echo": True})
        assert r.status_code == 200 and r.json()["model"] == LATIN1_NAME, r.text


def test_metrics_label_it_escaped(latin1_server):
    """Prometheus' exposition is UTF-8 too: the scrape had answered 500; the label carries the byte escaped."""
    with latin1_server.client() as c:
        post_json(c, CHAT, {"messages": MSGS, "max_tokens": 2})
        r = c.get("/metrics")
    assert r.status_code == 200
    # the module's other tests may have finished requests on this server before
    assert re.search(r'vllm:request_success_total\{finished_reason="length",model_name="caf\\\\udce9"\} [1-9]',
                     r.text), r.text


@pytest.mark.parametrize("path, body", [(CHAT, {"messages": MSGS}), ("/v1/completions", {"prompt": "Once"})])
def test_a_stream_naming_it_runs_to_done(latin1_server, path, body):
    req = {**body, "max_tokens": 3, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with latin1_server.client() as c, c.stream("POST", path, json=req) as r:
        assert r.status_code == 200
        events, _ = sse_events(r)
    assert events[-1] == "[DONE]"
    assert all(e["model"] == LATIN1_NAME for e in events[:-1])
    assert events[-2]["usage"]["completion_tokens"] == 3


def test_an_error_quotes_non_ascii_as_itself(shared_server):
    with shared_server.client() as c:
        r = c.post(CHAT, json={"model": "modèle", "messages": MSGS})
    assert r.status_code == 404 and "'modèle'".encode() in r.content
