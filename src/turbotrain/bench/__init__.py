"""The benchmark harness: it imports the library, and nothing in the library imports it.

* ``runner`` / ``worker``: the ladder. Each config trains the same workload, same seed and same
  batches, in its own process; the report shows step time, throughput, speed-up, memory, MFU and
  loss next to the plain-PyTorch peers. ``turbotrain bench [--quick]``; register a row with
  ``register_config`` (see turbotrain.bench.configs). Results schema: docs/benchmark-schema.md.
* ``dp_ladder`` / ``dp_worker``: the data-parallel ladder, ``turbotrain bench --nproc 2``.
* ``comm_bench``: nccl-tests style collective bandwidth, ``turbotrain comm-bench``.
* ``fusion_timing``: each fused op against its reference, ``python -m turbotrain.bench.fusion_timing``.
"""

from .configs import (
    BenchConfig,
    Trainer,
    default_configs,
    get_config,
    list_configs,
    make_optimizer,
    register_config,
    unregister_config,
)

__all__ = [
    # running
    "run_ladder",
    "LadderSettings",
    # registry
    "register_config",
    "unregister_config",
    "get_config",
    "list_configs",
    "default_configs",
    "BenchConfig",
    "Trainer",
    "make_optimizer",
]


def __getattr__(name):
    # lazy, so `import turbotrain.bench` (the registry) stays light
    if name in ("run_ladder", "LadderSettings"):
        from . import runner

        return getattr(runner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
