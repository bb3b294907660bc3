"""Benchmark rows built from a whole Config: the tuner's candidates and ``bench --config-file``.

* ``tt-config``: the Engine with the Config dict the worker's spec carries (``WorkerSpec.engine_config``);
  every tune candidate is one.
* ``tt-tuned``: the Engine with the Config in the file $TURBOTRAIN_TUNED_CONFIG names
  (``turbotrain bench --config-file tuned.json`` sets it, so the workers see it too); in the
  default ladder when the file is given.

A Config with ``accumulate=k`` splits each batch the ladder gives it into k equal micro-batches and
steps the optimizer once, so a step still trains on the same rows as every other row's.

>>> [t.shape[0] for t in split_batch((torch.zeros(4, 3), torch.zeros(4)), 2)[1]]
[2, 2]
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from ..config import Config
from ..errors import ConfigError
from ..bench.configs import TUNED_ROW, make_optimizer, register_config
from ..bench.dp_worker import split_batch  # one cut for the tune rows and the data-parallel stage's jobs
from ..bench.tt import EngineTrainer

__all__ = ["ConfigTrainer", "split_batch", "register_tuned_row", "forget_tuned_row", "load_config_file", "TUNED_ENV", "TUNED_ROW",
           "CONFIG_ROW"]

logger = logging.getLogger(__name__)

TUNED_ENV = "TURBOTRAIN_TUNED_CONFIG"
CONFIG_ROW = "tt-config"
_DTYPE_NAMES = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class ConfigTrainer(EngineTrainer):
    """A workload behind ``Engine(model, optimizer factory, loss_fn, config=Config.from_dict(...))``.

    The optimizer factory is the workload's ``optimizer_fn`` (a user's, through turbotrain.tune) or
    the ladder's one AdamW.
    """

    def __init__(self, workload, device: str, config: dict):
        from .. import Engine

        config = Config.from_dict({**config, "device": device})
        factory = getattr(workload, "optimizer_fn", None) or make_optimizer
        self._optimizer = None
        self.engine = Engine(workload.build_model().to(device), factory, workload.loss_fn, config=config)
        self.compute_dtype = _DTYPE_NAMES[self.engine.precision.dtype]
        self.compiled = config.compile
        self.micro_batches = config.accumulate

    def step(self, batch):
        losses = [self.engine.step(micro).loss for micro in split_batch(batch, self.micro_batches)]
        return torch.stack(losses).mean() if len(losses) > 1 else losses[0]


def load_config_file(path) -> Config:
    """The Config in a JSON file (tuned.json); ConfigError naming the file when it is missing or invalid."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"--config-file {str(path)!r} cannot be read ({exc.strerror or exc}); give the tuned.json "
                          "that `turbotrain tune` wrote") from exc
    try:
        return Config.from_json(text)
    except ConfigError as exc:
        raise ConfigError(f"--config-file {str(path)!r}: {exc}") from exc


def _build_config_row(workload, device, engine_config=None):
    if engine_config is None:
        raise ConfigError(f"the {CONFIG_ROW} row needs a Config: it is built from WorkerSpec.engine_config "
                          "(turbotrain tune sets it); use tt-tuned with --config-file for a Config in a file")
    return ConfigTrainer(workload, device, engine_config)


def _build_tuned_row(workload, device, engine_config=None):
    path = os.environ.get(TUNED_ENV)
    if not path:
        raise ConfigError(f"the {TUNED_ROW} row runs the Config of a file: give it with "
                          "`turbotrain bench --config-file tuned.json`")
    config = load_config_file(path).to_dict()
    if config.pop("data_parallel", None) is not None:  # a bench row is one process: it times the compute recipe
        logger.info("%s: %s's data_parallel section is left out of this one-process row; `turbotrain bench --nproc "
                    "N` measures the exchange", TUNED_ROW, Path(path).name)
    return ConfigTrainer(workload, device, config)


def _dtype_of(config: Config) -> str:
    precision = config.precision
    if precision == "auto":
        from ..hardware import detect, recommend_precision

        precision = recommend_precision(detect("auto"))[0]
    return precision.split("-")[0]


def register_tuned_row(path) -> str:
    """Put the Config in ``path`` in the default ladder as ``tt-tuned`` (here and in every worker
    this process starts, through $TURBOTRAIN_TUNED_CONFIG); returns the row name."""
    config = load_config_file(path)
    os.environ[TUNED_ENV] = str(Path(path).resolve())
    register_config(TUNED_ROW, f"the Config of {Path(path).name} (turbotrain tune's choice)", _build_tuned_row,
                    default=True, group="turbotrain", replace=True, dtype=_dtype_of(config))
    return TUNED_ROW


def forget_tuned_row() -> None:
    """Take tt-tuned out of the default ladder again (and $TURBOTRAIN_TUNED_CONFIG out of the environment)."""
    os.environ.pop(TUNED_ENV, None)
    register_config(TUNED_ROW, "the Config of --config-file (turbotrain tune's choice)", _build_tuned_row,
                    default=False, group="turbotrain", replace=True)


register_config(CONFIG_ROW, "Engine with the Config the worker spec carries (tune candidates)", _build_config_row,
                default=False, group="tune", replace=True)
if os.environ.get(TUNED_ENV):
    register_tuned_row(os.environ[TUNED_ENV])
else:
    forget_tuned_row()
