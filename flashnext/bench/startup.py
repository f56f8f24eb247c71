"""startup: seconds from starting our server process to its first /health 200, and load GB/s."""
from __future__ import annotations

from flashnext.bench import markdown as md
from flashnext.bench.client import BenchError
from flashnext.bench.target import LaunchedServer, load_seconds, model_bytes

RUNS = 1


def launch_sample(server: LaunchedServer, props: dict | None, run: int) -> dict:
    log = server.log_path.read_text(errors="replace") if server.log_path else ""
    nbytes, source = model_bytes(props, log, server.model)
    load_s = load_seconds(log)
    # Over the loader's own time when the server logs it, else over the whole start (imports, allocation,
    # graph capture included): then a lower bound on the loader's rate.
    seconds = load_s or server.startup_s
    gbps = nbytes / 1e9 / seconds if nbytes and seconds else None
    return {"phase": "run", "run": run, "startup_s": server.startup_s, "load_s": load_s, "model_bytes": nbytes,
            "model_bytes_source": source, "load_gb_s": gbps}


async def run(ctx):
    args, target = ctx.args, ctx.target
    if target.server is None:
        raise BenchError("startup needs --model: it times our own server from process start.")
    # The run's own server is the first sample. Further runs need the GPU to themselves, so the run's
    # server stops first: that is why startup comes last in `all`.
    samples = [launch_sample(target.server, target.props, 0)]
    runs = ctx.count("runs", RUNS)
    if runs > 1:
        target.server.stop()
    for i in range(1, runs):
        server = LaunchedServer(args.model, args.server_args or "", args.server_timeout)
        ctx.progress.start(f"startup run {i + 1}:")
        try:
            await server.start()
        finally:
            server.stop()
        samples.append(launch_sample(server, None, i))
        ctx.progress.done(f"{server.startup_s:.2f} s to /health 200")
    return samples, {}


def table(result: dict) -> str:
    rows = [[s["run"] + 1, md.num(s["startup_s"], 2), md.num(s["load_s"], 2),
             md.num(s["model_bytes"] / 1e9, 3) if s["model_bytes"] else "n/a", s["model_bytes_source"] or "",
             md.num(s["load_gb_s"], 2)] for s in result["samples"]]
    return md.table(["run", "seconds to /health 200", "load s (server log)", "model GB", "bytes from",
                     "load GB/s"], rows)


def plot(result: dict, stem) -> list:
    return []
