"""Every benchmark for real, through HTTP, against our server on the tiny model, at tiny sizes.

`flashnext bench all --model tiny-flash-next` starts the server once (its launch is the startup sample) and
runs the whole suite; the tests then check the files it wrote. Nothing here asserts a time.
FLASHNEXT_TEST_BENCH_URL points the suite at a running server instead (no startup sample then).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from flashnext.bench import idle, report
from flashnext.bench.cli import main
from flashnext.bench.idle import WARM_FRACTION
from flashnext.bench.prefill import MAX_TOKENS as PREFILL_TOKENS
from flashnext.bench.runner import ALL

URL = os.environ.get("FLASHNEXT_TEST_BENCH_URL")
MODEL = os.environ.get("FLASHNEXT_TEST_BENCH_MODEL")  # default: tiny-flash-next with a longer context
SERVER_ARGS = os.environ.get("FLASHNEXT_TEST_BENCH_SERVER_ARGS", "")
MAX_TOKENS, GEN_TOKENS, STREAMS, TURNS = 6, 5, (1, 3), 12
TINY = ["--max-tokens", str(MAX_TOKENS), "--warmups", "1", "--runs", "1", "--depths", "0,300", "--lengths", "400",
        "--scale", "0.01", "--turn-tokens", "8", "--conversations", "2", "--conv-tokens", "500",
        "--churn-tokens", "1000", "--cold-runs", "1", "--streams", ",".join(map(str, STREAMS)),
        "--prompt-tokens", "300", "--gen-tokens", str(GEN_TOKENS), "--metrics-interval", "0.2"]


def _our_server_exists() -> bool:
    if URL:
        return True
    probe = subprocess.run([sys.executable, "-m", "flashnext.cli", "serve", "--help"], capture_output=True)
    return probe.returncode == 0


pytestmark = pytest.mark.skipif(not _our_server_exists(), reason="`flashnext serve` is not there yet")


def _tiny_long_context(folder: Path) -> str:
    """tiny-flash-next with 32K positions: its 512-token vocabulary spends ~4 tokens per word, so the
    agent's tool schemas alone outgrow the preset's 4,096."""
    from flashnext.weights.presets import get_preset
    from flashnext.weights.synth import synthesize

    config = get_preset("tiny-flash-next")
    config["text_config"]["max_position_embeddings"] = 32768
    return str(synthesize(config, folder / "tiny-flash-next-32k"))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return MODEL or _tiny_long_context(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def run(tmp_path_factory, request) -> tuple[dict[str, dict], Path]:
    out = tmp_path_factory.mktemp("bench-results")
    target = ["--url", URL] if URL else ["--model", request.getfixturevalue("model"), "--server-args", SERVER_ARGS]
    assert main(["bench", "all", *target, *TINY, "--out-dir", str(out)]) == 0
    files = sorted(out.glob("*.json"))
    results = {json.loads(f.read_text())["bench"]: json.loads(f.read_text()) for f in files}
    assert len(results) == len(files)
    return results, out


def _requests(result):
    return [s for s in result["samples"] if "ttft_s" in s]


def test_every_benchmark_wrote_its_results(run):
    results, _ = run
    assert set(results) == set(ALL) - ({"startup"} if URL else set())


def test_results_say_what_ran_where(run):
    results, _ = run
    for result in results.values():
        assert result["schema_version"] == 1 and re.fullmatch(r"[0-9a-f]{40}|unknown", result["commit"])
        assert result["gpu"] == "cpu" or result["gpu"][0]["name"]
        assert "flashnext bench all " in result["command"] and "--max-tokens 6" in result["command"]
        assert result["started_at"] <= result["finished_at"]
        assert result["server"]["launched"] == (URL is None)
        assert result["model_id"] in [m["id"] for m in result["server"]["models"]["data"]]
        assert result["flags"]["max_tokens"] == MAX_TOKENS
        assert result["samples"]


def test_every_request_is_consistent(run):
    results, _ = run
    for result in results.values():
        for s in _requests(result):
            assert s["ttft_s"] is not None and 0 < s["ttft_s"] < s["wall_s"], (result["bench"], s)
            assert s["prompt_tokens"] > 0 and s["completion_tokens"] > 0
            assert s["cached_tokens"] is None or 0 <= s["cached_tokens"] <= s["prompt_tokens"]
            assert s["finish_reason"] and (s["n_deltas"] >= 1) == (s["ttft_source"] == "delta")


def test_decode_generates_the_exact_count_at_each_depth(run):
    result = run[0]["decode"]
    samples = result["samples"]
    assert {(s["phase"], s["depth"]) for s in samples} == {(p, d) for p in ("warmup", "run") for d in (0, 300)}
    runs = [s for s in samples if s["phase"] == "run"]
    assert sorted((s["depth"], s["prompt"]) for s in runs) == [(0, "essay"), (0, "quicksort"), (300, "essay"),
                                                               (300, "quicksort")]
    for s in samples:  # ignore_eos + min_tokens: the same count every run
        assert s["completion_tokens"] == MAX_TOKENS and s["finish_reason"] == "length"
        assert s["decode_tok_s"] == pytest.approx(MAX_TOKENS / (s["wall_s"] - s["ttft_s"]))
    for name in ("essay", "quicksort"):
        shallow, deep = ([s for s in runs if s["prompt"] == name and s["depth"] == d][0] for d in (0, 300))
        assert deep["prompt_tokens"] - shallow["prompt_tokens"] >= 0.8 * deep["depth_tokens"] > 0
        if deep["depth_measured"]:  # the filler's own count, +/- the joining newlines
            assert abs(deep["prompt_tokens"] - shallow["prompt_tokens"] - deep["depth_tokens"]) <= 4


def test_prefill_prompts_are_fresh_and_near_the_target(run):
    result = run[0]["prefill"]
    for s in result["samples"]:
        assert s["length"] == 400 and s["completion_tokens"] <= PREFILL_TOKENS
        assert s["prefill_tok_s"] == pytest.approx(s["prompt_tokens"] / s["ttft_s"])
        assert (s["cached_tokens"] or 0) < 0.5 * s["prompt_tokens"]  # the salt leaves only the template head
        if result["info"]["sizes_measured"]:
            assert 0.8 * 400 <= s["prompt_tokens"] <= 1.25 * 400 + 40


def test_agentic_session_grows_turn_by_turn(run):
    result = run[0]["agentic"]
    samples = result["samples"]
    assert [s["turn"] for s in samples] == list(range(1, TURNS + 1))
    prompts = [s["prompt_tokens"] for s in samples]
    assert prompts == sorted(prompts) and len(set(prompts)) == TURNS
    assert {s["call_source"] for s in samples} <= {"model", "scripted"}
    assert all(s["tool"] for s in samples) and samples[-1]["result_bytes"] >= 40
    # our server opens a choice with its first token: the first chunk never comes after the first text
    assert all(0 < s["first_chunk_s"] <= s["ttft_s"] for s in samples)


def test_idle_conversations_are_judged_by_their_cached_history(run):
    samples = run[0]["idle"]["samples"]
    fills = {s["conversation"]: s for s in samples if s["phase"] == "fill"}
    resumes = [s for s in samples if s["phase"] == "resume"]
    assert len(fills) == len(resumes) == 2 and len([s for s in samples if s["phase"] == "cold"]) == 1
    assert sum(s["prompt_tokens"] for s in samples if s["phase"] == "churn") >= 1000
    for s in resumes:
        assert s["history_tokens"] == fills[s["conversation"]]["prompt_tokens"] < s["prompt_tokens"]
        assert s["warm"] == ((s["cached_tokens"] or 0) >= WARM_FRACTION * s["history_tokens"])


@pytest.mark.skipif(URL is not None, reason="--restart restarts a server the bench started")
def test_idle_conversations_come_back_from_the_disk_tier_after_a_restart(model, tmp_path):
    # After the restart only the disk tier holds anything: the server wrote its cache there when the bench
    # stopped it (SIGTERM), the snapshot at the end of each conversation's history included.
    disk = ["--kv-disk-dir", str(tmp_path / "kv")]
    out = tmp_path / "results"
    assert main(["bench", "idle", "--model", model, "--server-args", f"{SERVER_ARGS} {shlex.join(disk)}", "--restart",
                 "--conversations", "2", "--conv-tokens", "500", "--churn-tokens", "500", "--cold-runs", "0",
                 "--no-plots", "--out-dir", str(out)]) == 0
    (path,) = out.glob("idle-*.json")
    result = json.loads(path.read_text())
    assert result["info"]["restarted"] and result["info"]["restart_startup_s"] > 0
    resumes = [s for s in result["samples"] if s["phase"] == "resume"]
    assert len(resumes) == 2
    for s in resumes:
        assert s["warm"] and s["cached_tokens"] >= WARM_FRACTION * s["history_tokens"], s
    assert "after a server restart" in idle.table(result)
    log = (out / "last-server.log").read_text()
    assert "stopped and started again" in log and "disk cache: " in log


def test_concurrency_runs_each_stream_count(run):
    samples = run[0]["concurrency"]["samples"]
    assert sorted(s["stream"] for s in samples if s["phase"] == "warmup") == list(range(max(STREAMS)))
    for n in STREAMS:
        batch = [s for s in samples if s["streams"] == n and s["phase"] == "run"]
        assert sorted(s["stream"] for s in batch) == list(range(n))
        assert all(s["completion_tokens"] == GEN_TOKENS for s in batch)
        resumed = [s for s in samples if s["streams"] == n and s["phase"] == "resumed"]
        assert sorted(s["stream"] for s in resumed) == list(range(n))
        history = {s["stream"]: s["prompt_tokens"] + s["completion_tokens"] for s in batch}
        for s in resumed:    # one more turn: with our server's prefix cache, warm from the reply's end
            assert s["completion_tokens"] == GEN_TOKENS and s["history_tokens"] == history[s["stream"]]
            assert s["prompt_tokens"] > s["history_tokens"]
            if URL is None:
                assert s["cached_tokens"] >= 0.9 * s["history_tokens"], s


def test_experts_reads_the_cache_counters_when_there_are_some(run):
    result = run[0]["experts"]
    assert {s["traffic"] for s in result["samples"]} == {"repeated", "varied"}
    for s in result["samples"]:
        assert s["completion_tokens"] == MAX_TOKENS
        if result["info"]["metrics_available"]:
            assert s["hit_rate"] is None or 0.0 <= s["hit_rate"] <= 1.0
        else:
            assert s["hit_rate"] is None


@pytest.mark.skipif(URL is not None, reason="startup is only measured when the bench starts the server")
def test_startup_is_the_launch_of_the_run(run):
    (sample,) = run[0]["startup"]["samples"]
    assert sample["startup_s"] > 0
    assert sample["load_gb_s"] is None or sample["load_gb_s"] > 0


def test_plots_are_pngs(run):
    pytest.importorskip("matplotlib")
    _, out = run
    for stem in ("decode-*-depth", "agentic-*-ttft", "idle-*-ttft", "concurrency-*-streams"):
        (png,) = out.glob(stem + ".png")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_renders_every_result(run, tmp_path):
    results, out = run
    md = tmp_path / "bench.md"
    assert main(["bench", "report", *map(str, sorted(out.glob("*.json"))), "--out", str(md)]) == 0
    text = md.read_text()
    assert text == report.render(sorted(out.glob("*.json")))
    for name in results:
        assert f"### {name} — " in text
    assert "| turn | prompt tokens |" in text and "Headline: turn-12 TTFT" in text


def test_agentic_stops_where_the_context_ends(tmp_path):
    """A server whose context is shorter than the session: the bench keeps what ran and says where it stopped."""
    code = main(["bench", "agentic", "--model", "tiny-flash-next", "--server-args", "--max-model-len 4096",
                 "--scale", "0.05", "--max-tokens", "4", "--no-plots", "--out-dir", str(tmp_path)])
    assert code == 0
    result = json.loads(next(tmp_path.glob("agentic-*.json")).read_text())
    stopped = result["info"]["stopped"]
    assert stopped is not None and "context_length_exceeded" in stopped["reason"]
    assert len(result["samples"]) == stopped["turn"] - 1
