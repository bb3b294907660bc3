"""The benchmark ladder: each config trains the same workload, same seed and same batches, in its
own process; the report shows step time, throughput, speed-up, memory, MFU and loss next to the
plain-PyTorch peers.

Run it as ``turbotrain bench [--quick]``; register a row with ``register_config`` (see
turbotrain.bench.configs). Results schema: docs/benchmark-schema.md.
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
    "add_cli",
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


def add_cli(subparsers) -> None:
    """Register ``turbotrain bench`` (imported lazily so ``import turbotrain.bench`` stays light)."""
    from .cli import add_cli as _add_cli

    _add_cli(subparsers)


def __getattr__(name):
    if name in ("run_ladder", "LadderSettings"):
        from . import runner

        return getattr(runner, name)
    raise AttributeError(name)
