"""Several GPUs of one host: tensor and expert parallel through torch.distributed (docs/parallel.md).

`shard_model` cuts a loaded model down to one rank; `launch_engine` starts the engine over all ranks from
one process; `spawn_ranks` runs a function on every rank (tests, scripts).
"""
from flashnext.parallel.runtime import ParallelPlan, world_size


def __getattr__(name):
    # Lazy: flashnext.engine.loading imports this package, and launch imports the engine.
    if name == "shard_model":
        from flashnext.parallel.shard import shard_model
        return shard_model
    if name in ("launch_engine", "spawn_ranks", "shutdown"):
        from flashnext.parallel import launch
        return getattr(launch, name)
    raise AttributeError(name)


__all__ = ["ParallelPlan", "world_size", "shard_model", "launch_engine", "spawn_ranks", "shutdown"]
