"""The benchmark harness: it imports the library, and nothing in the library imports it.

* ``runner`` / ``interleave`` / ``worker``: the ladder. Each config trains the same workload, same
  seed and same batches, in its own long-lived process, and the rows are measured in alternating
  rounds; the report shows step time, throughput, the ratio to the strongest peer
  (``torch-compile-step``) with its bootstrap interval, an A/A row for the noise floor, memory, MFU
  over a measured maximum matmul peak (``peak``) and loss, FAILED where a row's val loss leaves its
  tolerance. ``turbotrain bench [--quick]``; register a row with ``register_config`` (see
  turbotrain.bench.configs). Results schema: docs/benchmark-schema.md. ``compare(model_fn, batches,
  ...)``: the same ladder on a model of yours.
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
    "compare",
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
    if name == "compare":
        from .user_ladder import compare

        return compare
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
