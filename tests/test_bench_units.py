"""The bench suite's pieces on their own: statistics, workload generators, SSE parsing, flags, report."""
from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest

from flashnext.bench import agentic_session as session
from flashnext.bench import cli, floors, report, results
from flashnext.bench.client import BenchError, OpenAIClient, api_root
from flashnext.bench.concurrency import aggregate_rate, all_decoding_rates
from flashnext.bench.experts import hit_rate, parse_metrics
from flashnext.bench.stats import decode_rate, median, percentile, prefill_rate, summarize
from flashnext.bench.target import load_seconds, model_bytes
from flashnext.bench.text import TextSizer, fresh_salt, varied_text
from flashnext.bench.tools import TOOLS


# --- statistics ---------------------------------------------------------------------------------

@pytest.mark.parametrize("values,q,expected", [
    ([3.0], 50, 3.0), ([1, 2, 3, 4], 50, 2.5), ([1, 2, 3, 4], 0, 1), ([1, 2, 3, 4], 100, 4),
    ([10, 20, 30, 40, 50], 25, 20.0), ([5, 1, 4, 2, 3], 90, 4.6)])
def test_percentile_matches_linear_interpolation(values, q, expected):
    assert percentile(values, q) == pytest.approx(expected)


def test_percentile_rejects_out_of_range_q_and_empty_is_nan():
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    assert math.isnan(median([]))


def test_summarize_skips_missing_values():
    s = summarize([2.0, None, 4.0, float("nan"), 9.0])
    assert s["n"] == 3 and s["mean"] == pytest.approx(5.0) and s["min"] == 2.0 and s["max"] == 9.0
    assert s["median"] == 4.0 and s["stdev"] == pytest.approx(math.sqrt(13.0))
    assert summarize([7.0])["stdev"] == 0.0
    assert summarize([None])["n"] == 0 and math.isnan(summarize([])["mean"])


def test_rates_follow_the_protocol_formulas():
    assert decode_rate(1000, wall_s=2.5, ttft_s=0.5) == pytest.approx(500.0)
    assert decode_rate(1000, wall_s=0.5, ttft_s=0.5) is None
    assert decode_rate(0, wall_s=1.0, ttft_s=0.1) is None
    assert decode_rate(10, wall_s=1.0, ttft_s=None) is None
    assert decode_rate(256, wall_s=2.0681, ttft_s=2.0674, deltas=1) is None   # one delta at the end: undefined
    assert prefill_rate(10_000, 0.25) == pytest.approx(40_000.0)
    assert prefill_rate(10_000, None) is None and prefill_rate(10_000, 0.0) is None


def test_aggregate_rate_spans_first_token_to_last_end():
    batch = [{"t_start": 100.0, "ttft_s": 1.0, "wall_s": 3.0, "completion_tokens": 100},
             {"t_start": 100.5, "ttft_s": 1.0, "wall_s": 4.5, "completion_tokens": 100}]
    assert aggregate_rate(batch) == pytest.approx(200 / (105.0 - 101.0))
    assert aggregate_rate([{"t_start": 0.0, "ttft_s": None, "wall_s": 1.0, "completion_tokens": 0}]) is None


def test_all_decoding_rates_count_only_the_span_every_stream_decodes():
    # stream 0 decodes from t=1 (10/s), stream 1 from t=3 (5/s) after its prefill; both until t=5
    first = [1 + i / 10 for i in range(41)]
    second = [3 + i / 5 for i in range(11)]
    rates = all_decoding_rates([first, second])
    assert rates[0] == pytest.approx(20 / 2.0) and rates[1] == pytest.approx(10 / 2.0)
    assert all_decoding_rates([[1.0, 1.1], [2.0, 2.1]]) == [None, None]     # one ended before the other began
    assert all_decoding_rates([[1.0], [1.0, 2.0]]) == [None, None]


def test_expert_metrics_parse_and_hit_rate():
    text = ('# HELP flashnext_expert_cache_hits_total hits\n'
            'flashnext_expert_cache_hits_total{layer="0"} 30\nflashnext_expert_cache_hits_total{layer="1"} 10\n'
            'flashnext_expert_cache_misses_total 10\nflashnext_expert_cache_bytes_copied_total 2.6e+07\n'
            'flashnext_expert_cache_hits_total_created 1.7e9\nother_metric 5\n')
    assert parse_metrics(text) == {"hits": 40.0, "misses": 10.0, "bytes_copied": 2.6e7}
    assert parse_metrics(None) == {} and parse_metrics("other 1\n") == {}
    assert hit_rate(40, 10) == pytest.approx(0.8)
    assert hit_rate(0, 0) is None and hit_rate(None, 3) is None


def test_expert_table_reports_stall_per_token_and_prefetch():
    from flashnext.bench.experts import table

    run = lambda t, **kw: {"traffic": t, "decode_tok_s": 100.0, "completion_tokens": 200, **kw}  # noqa: E731
    full = dict(hits=80, misses=20, bytes_copied=5e8, stall_seconds=0.1, prefetched=12, prefetch_used=9,
                admitted=40)
    out = table({"samples": [run("repeated", **full), run("repeated", **full), run("varied")]})
    repeated, varied = [line for line in out.splitlines() if line.startswith("| repeated") or line.startswith("| varied")]
    assert "| 80.0% | 1.00 | 0.500 | 24 (18 used) | 0.2 |" in repeated    # 0.2 s, 80 admitted over 400 tokens
    assert varied.endswith("| n/a | n/a | n/a | n/a | n/a |")             # a server without the counters


def test_model_bytes_from_props_log_or_checkpoint(tmp_path):
    assert model_bytes({"model_bytes": 123}, "") == (123, "/props model_bytes")
    assert model_bytes(None, "INFO model_bytes=44236593152 layers=48")[0] == 44236593152
    assert model_bytes({}, "loaded 41.5 GB of weights in 9.1 s") == (int(41.5e9), "server log")
    assert model_bytes({}, "loaded 2 GiB")[0] == 2 * 2**30
    assert model_bytes({}, "nothing here", "no-such-dir") == (None, None)
    (tmp_path / "model-00001.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "model-00002.safetensors").write_bytes(b"x" * 24)
    assert model_bytes({}, "", str(tmp_path)) == (1024, "checkpoint files")
    line = "INFO flashnext.server: loaded m from /ckpt in 12.5 s; serving it as 'm', max_model_len 4096"
    assert load_seconds(line) == 12.5 and load_seconds("serving") is None


# --- workload generators ------------------------------------------------------------------------

def test_varied_text_is_deterministic_varied_and_sized():
    a, b = varied_text(2000, seed=3), varied_text(2000, seed=3)
    assert a == b and a != varied_text(2000, seed=4)
    words = a.split()
    assert 2000 <= len(words) < 2030
    assert len(set(a.split(". "))) > 0.9 * len(a.split(". "))  # sentences rarely repeat


def test_salts_are_fresh():
    assert len({fresh_salt() for _ in range(100)}) == 100


def test_text_sizer_estimates_and_calibrates():
    sizer = TextSizer(tokens_per_word=1.5)
    assert sizer.words_for(1500) == 1000 and not sizer.measured
    assert abs(sizer.estimate(sizer.filler(3000, seed=1)) - 3000) < 60

    class Counting:
        async def count_tokens(self, text):
            return 2 * len(text.split())

    class NoTokenize:
        async def count_tokens(self, text):
            return None

    measured = asyncio.run(TextSizer.calibrate(Counting()))
    assert measured.measured and measured.tokens_per_word == pytest.approx(2.0)
    assert asyncio.run(measured.count(Counting(), "a b c")) == (6, True)
    estimated = asyncio.run(TextSizer.calibrate(NoTokenize()))
    assert not estimated.measured and asyncio.run(estimated.count(NoTokenize(), "a b")) == (3, False)


def test_tool_schemas_are_the_ten_of_the_protocol():
    names = [t["function"]["name"] for t in TOOLS]
    assert names == ["read", "bash", "edit", "write", "grep", "ls", "todo_read", "todo_write",
                     "web_search", "web_fetch"]
    assert all(t["function"]["parameters"]["type"] == "object" for t in TOOLS)
    assert {s.tool for s in session.STEPS} <= set(names)


@pytest.mark.parametrize("seed", [0, 1, 17])
def test_tool_results_are_exact_size_in_range_and_deterministic(seed):
    for turn, step in enumerate(session.STEPS):
        text = session.tool_result(turn, seed)
        assert len(text) == step.size and 300 <= step.size <= 35_000
        assert text.isascii() and text == session.tool_result(turn, seed)
    assert session.tool_result(4, seed) != session.tool_result(4, seed + 1)
    assert {len(session.tool_result(t, seed, scale=0.01)) for t in range(session.TURNS)} >= {session.MIN_RESULT_BYTES}


def _history(scale: float, turns: int = session.TURNS - 1) -> list[dict]:
    messages = session.opening_messages()
    for turn in range(turns):
        session.append_turn(messages, turn, session.scripted_call(turn), seed=0, scale=scale)
    return messages


def test_agentic_history_reaches_about_35k_tokens_at_turn_12():
    # Turn 12's prompt holds the 11 earlier calls and results.
    tokens = session.estimated_tokens(_history(1.0))
    assert 30_000 <= tokens <= 40_000
    growth = [session.estimated_tokens(_history(1.0, t)) for t in range(session.TURNS)]
    assert growth == sorted(growth)
    assert session.estimated_tokens(_history(0.1)) < tokens / 3
    assert _history(1.0) == _history(1.0)


def test_history_keeps_call_and_result_paired():
    messages = _history(0.05, turns=3)
    assert [m["role"] for m in messages] == ["system", "user"] + ["assistant", "tool"] * 3
    for call_msg, result in zip(messages[2::2], messages[3::2]):
        assert result["tool_call_id"] == call_msg["tool_calls"][0]["id"]
        json.loads(call_msg["tool_calls"][0]["function"]["arguments"])


def test_usable_call_takes_only_known_tools_with_object_arguments():
    good = {"id": "c1", "function": {"name": "grep", "arguments": '{"pattern": "x"}'}}
    assert session.usable_call([good])["function"]["name"] == "grep"
    assert session.usable_call([{"id": "c", "function": {"name": "rm", "arguments": "{}"}}]) is None
    assert session.usable_call([{"id": "c", "function": {"name": "read", "arguments": "{bad"}}]) is None
    assert session.usable_call([{"function": {"name": "read", "arguments": "[1]"}}, good])["id"] == "c1"
    assert session.usable_call([]) is None


# --- the SSE client -----------------------------------------------------------------------------

def _sse(*chunks) -> bytes:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks).encode() + b"data: [DONE]\n\n"


def _delta(**delta):
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


def _client(body: bytes, status: int = 200, seen: list | None = None) -> OpenAIClient:
    def handler(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(json.loads(request.content))
        return httpx.Response(status, content=body, headers={"content-type": "text/event-stream"})
    return OpenAIClient("http://x/v1", model="m", transport=httpx.MockTransport(handler))


def test_stream_timing_usage_and_request_body():
    seen: list = []
    body = _sse(_delta(role="assistant", content=""), _delta(content="Hel"), _delta(content="lo"),
                {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
                {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 2,
                                          "prompt_tokens_details": {"cached_tokens": 8}}})
    r = asyncio.run(_client(body, seen=seen).chat([{"role": "user", "content": "hi"}], 2, ignore_eos=True))
    assert (r.content, r.prompt_tokens, r.completion_tokens, r.cached_tokens) == ("Hello", 12, 2, 8)
    assert r.n_deltas == 2 and r.finish_reason == "length" and r.ttft_source == "delta"
    assert 0 <= r.first_chunk_s <= r.ttft_s <= r.last_delta_s <= r.wall_s
    assert r.sample()["first_chunk_s"] == r.first_chunk_s
    sent = seen[0]
    assert sent["stream"] and sent["stream_options"] == {"include_usage": True}
    assert (sent["temperature"], sent["top_p"], sent["top_k"], sent["min_p"]) == (0.6, 0.95, 20, 0.0)
    assert sent["chat_template_kwargs"] == {"enable_thinking": False}
    assert sent["ignore_eos"] and sent["min_tokens"] == 2 == sent["max_tokens"]


def test_stream_merges_tool_call_fragments_and_reasoning():
    body = _sse(_delta(reasoning_content="hmm"),
                _delta(tool_calls=[{"index": 0, "id": "call_1", "type": "function",
                                    "function": {"name": "read", "arguments": '{"pa'}}]),
                _delta(tool_calls=[{"index": 0, "function": {"arguments": 'th": "a.py"}'}}]),
                {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9}})
    r = asyncio.run(_client(body).chat([], 16, tools=TOOLS, tool_choice="required"))
    assert r.reasoning == "hmm" and r.cached_tokens is None and r.n_deltas == 3 and r.first_chunk_s is not None
    assert r.tool_calls == [{"id": "call_1", "type": "function",
                             "function": {"name": "read", "arguments": '{"path": "a.py"}'}}]


def test_a_reply_without_visible_text_times_its_finish_chunk():
    body = _sse(_delta(role="assistant", content=""), {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}})
    r = asyncio.run(_client(body).chat([], 4))
    assert r.ttft_source == "finish" and r.n_deltas == 0 and 0 <= r.ttft_s <= r.wall_s
    assert r.sample()["ttft_source"] == "finish"


def test_stream_errors_are_explained():
    with pytest.raises(BenchError, match="400"):
        asyncio.run(_client(b'{"error": "bad"}', status=400).chat([], 4))
    with pytest.raises(BenchError, match="usage"):
        asyncio.run(_client(_sse(_delta(content="x"))).chat([], 4))

    def refuse(request):
        raise httpx.ConnectError("connection refused")
    client = OpenAIClient("http://x", transport=httpx.MockTransport(refuse))
    with pytest.raises(BenchError, match="ConnectError"):
        asyncio.run(client.chat([], 4))


def test_api_root_accepts_v1_or_not():
    assert api_root("http://h:8/v1/") == api_root("http://h:8") == "http://h:8"


# --- flags, floors, results files, report ---------------------------------------------------------

def _parse(argv):
    import argparse
    parser = argparse.ArgumentParser()
    cli.add_bench_arguments(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_every_flag_is_also_an_env_var(monkeypatch):
    args = _parse(["bench", "decode", "--url", "http://x"])
    assert args.max_tokens == 1000 and args.runs is None and args.tool_choice == "required" and not args.no_plots
    monkeypatch.setenv("FLASHNEXT_BENCH_MAX_TOKENS", "7")
    monkeypatch.setenv("FLASHNEXT_BENCH_DEPTHS", "0,64")
    monkeypatch.setenv("FLASHNEXT_BENCH_NO_PLOTS", "1")
    monkeypatch.setenv("FLASHNEXT_BENCH_URL", "http://env")
    args = _parse(["bench", "all", "--depths", "0"])
    assert (args.max_tokens, args.depths, args.no_plots, args.url) == (7, "0", True, "http://env")
    monkeypatch.setenv("FLASHNEXT_BENCH_RUNS", "many")
    with pytest.raises(SystemExit):
        _parse(["bench", "decode"])


def test_restart_needs_a_server_the_bench_started(capsys, tmp_path):
    # Port 9 answers nothing: a connection attempt would fail with ConnectError instead of the flag's message.
    assert cli.main(["bench", "idle", "--url", "http://127.0.0.1:9", "--restart", "--out-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "--restart needs --model" in err and "ConnectError" not in err
    assert not list(tmp_path.iterdir())


def test_only_picks_benchmarks_of_all_and_names_a_wrong_one(capsys, tmp_path):
    assert cli.main(["bench", "all", "--url", "http://127.0.0.1:9", "--only", "agentic,bogus",
                     "--out-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "unknown benchmark bogus" in err and "ConnectError" not in err
    assert cli.main(["bench", "idle", "--url", "http://127.0.0.1:9", "--only", "idle", "--out-dir", str(tmp_path)]) == 1
    assert "--only picks benchmarks for `flashnext bench all`" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_only_runs_just_the_named_benchmarks_in_protocol_order(monkeypatch, capsys, tmp_path):
    import contextlib
    import types

    ran = []

    @contextlib.asynccontextmanager
    async def no_server(args):
        yield types.SimpleNamespace(server=None)

    async def record(name, target, args, progress):
        ran.append(name)
        raise BenchError("not run here")

    monkeypatch.setattr(cli, "open_target", no_server)
    monkeypatch.setattr(cli, "run_one", record)
    assert cli.main(["bench", "all", "--url", "http://x", "--only", "idle, agentic", "--out-dir", str(tmp_path)]) == 1
    assert ran == ["agentic", "idle"]


def test_idle_table_says_when_the_server_restarted():
    from flashnext.bench.idle import table

    samples = [{"phase": "resume", "conversation": 0, "history_tokens": 1000, "cached_tokens": 990, "warm": True,
                "ttft_s": 0.2}, {"phase": "cold", "conversation": 0, "ttft_s": 3.0}]
    plain = table({"samples": samples, "info": {"churn_tokens": 5000}})   # a results file from before --restart
    restarted = table({"samples": samples, "info": {"churn_tokens": 5000, "restarted": True,
                                                    "restart_startup_s": 41.5}})
    assert "restart" not in plain and "1/1 came back warm after 5,000 tokens of other traffic;" in plain
    assert "1/1 came back warm after 5,000 tokens of other traffic and after a server restart (up again in 41.50 s)" \
        in restarted


def test_floors_by_model_name_or_flag():
    assert floors.floor_for({"model_id": "flash-next-int4", "flags": {}}, "decode") == 775.0
    assert floors.floor_for({"model_id": "/ckpt/x", "flags": {"model": "/tmp/qwen3-next-80b"}}, "decode") == 1790.0
    assert floors.floor_for({"model_id": "qwen3-next-80b", "flags": {}}, "prefill") is None
    assert floors.floor_for({"model_id": "tiny-flash-next", "flags": {}}, "decode") is None
    assert floors.floor_for({"model_id": "whatever", "flags": {"floor": "flash-next"}}, "prefill") == 58_000.0


def _fake_result(tmp_path):
    samples = [{"phase": "run", "run": i, "prompt": "essay", "depth": 0, "depth_tokens": 0, "depth_measured": True,
                "decode_tok_s": 500.0 + i, "ttft_s": 0.1, "wall_s": 2.1, "completion_tokens": 1000,
                "prompt_tokens": 40, "cached_tokens": 0} for i in range(3)]
    describe = {"url": "http://x", "launched": False}
    target = type("T", (), {"model_id": "flash-next", "describe": lambda self: describe})()
    args = _parse(["bench", "decode", "--url", "http://x"])
    result = results.build("decode", target, args, samples, {"nan": float("nan")}, results.utc_now())
    return results.write(result, tmp_path)


def test_results_file_and_report(tmp_path):
    path = _fake_result(tmp_path)
    assert path.name.startswith("decode-flash-next-") and path.suffix == ".json"
    data = json.loads(path.read_text())
    assert data["schema_version"] == results.SCHEMA_VERSION and data["info"]["nan"] is None
    assert data["commit"] and data["gpu"] and data["flags"]["url"] == "http://x"
    text = report.render([path])
    assert "### decode — flash-next" in text and "| 0 | essay | 3 | 1,000 | 501.0 | 500.0 | 502.0 |" in text
    assert "775" in text and "64.6%" in text  # the floor and the share of it
    out = tmp_path / "section.md"
    assert cli.run_bench(_parse(["bench", "report", str(path), "--out", str(out)])) == 0
    assert out.read_text() == text
    assert _fake_result(tmp_path) != path  # same second, same bench: a new name, nothing overwritten


def test_report_refuses_foreign_json(tmp_path):
    p = tmp_path / "x.json"
    p.write_text('{"a": 1}')
    with pytest.raises(ValueError, match="not a flashnext bench results file"):
        report.load(p)


def test_command_line_carries_the_flashnext_switches(monkeypatch):
    """A result's command reproduces the run: the bench's FLASHNEXT_BENCH_* settings and the FLASHNEXT_* switches a
    server it starts inherits; not FLASHNEXT_COMMIT (the result names its commit apart), FLASHNEXT_CACHE (a place),
    nor other variables."""
    from flashnext.bench.results import command_line

    monkeypatch.setenv("FLASHNEXT_EXPERT_CLAIMS", "reference")
    monkeypatch.setenv("FLASHNEXT_BENCH_RUNS", "2")
    monkeypatch.setenv("FLASHNEXT_COMMIT", "abc1234")
    monkeypatch.setenv("FLASHNEXT_CACHE", "/tmp/somewhere")
    monkeypatch.setenv("OTHER_SETTING", "x")
    got = command_line(["flashnext", "bench", "experts"])
    assert "FLASHNEXT_EXPERT_CLAIMS=reference" in got and "FLASHNEXT_BENCH_RUNS=2" in got
    assert not any(name in got for name in ("FLASHNEXT_COMMIT", "FLASHNEXT_CACHE", "OTHER_SETTING"))
    assert got.endswith("flashnext bench experts")


@pytest.mark.parametrize("value,ok", [("f9e9142", True), ("87868ff+hc4", True), ("4", False), ("PLACEHOLDER", False)])
def test_a_commit_from_the_environment_must_be_one(monkeypatch, capsys, value, ok):
    """FLASHNEXT_COMMIT names the results' commit on a machine without .git: a value that is no commit stops the bench
    before it runs (no server is reached: the URL has none), and the cli says why."""
    monkeypatch.setenv("FLASHNEXT_COMMIT", value)
    if ok:
        assert results.git_commit() == value
        return
    with pytest.raises(BenchError, match="not a commit"):
        results.git_commit()
    assert cli.main(["bench", "decode", "--url", "http://127.0.0.1:9"]) == 1
    assert "is not a commit" in capsys.readouterr().err


def test_auto_scale_gives_the_results_qwens_token_count():
    """--scale auto: a tokenizer that spends twice Qwen's tokens on the tool results halves them (the protocol's
    ~35K tokens at turn 12 then holds on a synthetic tokenizer); Qwen's own rate keeps scale 1; no /tokenize, 1."""
    assert session.auto_scale(session.BYTES_PER_TOKEN) == 1.0
    assert session.auto_scale(session.BYTES_PER_TOKEN / 2) == 0.5
    assert session.auto_scale(None) == 1.0 and len(session.results_text(3)) > 100_000   # the 12 results at scale 1
    assert cli.scale_value("auto") == "auto" and cli.scale_value("0.25") == 0.25
    with pytest.raises(ValueError):
        cli.scale_value("0")
