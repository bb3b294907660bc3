"""Named NCCL environment presets, validated before any process starts.

NCCL reads its tuning from environment variables once, at communicator creation, and silently
ignores values it does not understand. So the presets and any user override are checked here,
and what was applied is printed, so a run log always says which transport settings it used.

>>> env = preset_env("ethernet")
>>> env["NCCL_IB_DISABLE"], int(env["NCCL_NSOCKS_PERTHREAD"]) * int(env["NCCL_SOCKET_NTHREADS"]) <= 64
('1', True)
"""

from __future__ import annotations

import os
from typing import Mapping, MutableMapping

from ..errors import ConfigError

__all__ = ["PRESETS", "NCCL_DEFAULTS", "preset_env", "validate_nccl_env", "apply_preset", "format_env"]

#: NCCL's own defaults (NCCL 2.x docs), printed next to what a preset changes.
NCCL_DEFAULTS = {
    "NCCL_ALGO": "auto (NCCL's tuner picks per size)",
    "NCCL_BUFFSIZE": "4194304 (4 MiB per channel and peer)",
    "NCCL_NSOCKS_PERTHREAD": "auto (1 on most systems)",
    "NCCL_SOCKET_NTHREADS": "auto (1 on most systems)",
    "NCCL_IB_DISABLE": "0 (use InfiniBand/RoCE when found)",
    "NCCL_NET_GDR_LEVEL": "auto (by PCIe distance)",
}

PRESETS: dict[str, dict[str, str]] = {
    # NCCL's defaults are right for most machines; this preset only pins nothing and prints them.
    "default": {},
    # One node: NVLink/PCIe peer-to-peer carries everything, so skip probing network adapters.
    "single-node": {"NCCL_IB_DISABLE": "1"},
    # InfiniBand/RoCE: GPUDirect RDMA when GPU and NIC share a host bridge (PHB), and 8 MiB
    # buffers so large all-reduces pipeline over fewer, bigger chunks.
    "ib": {"NCCL_IB_DISABLE": "0", "NCCL_NET_GDR_LEVEL": "PHB", "NCCL_BUFFSIZE": "8388608"},
    # TCP: one socket per thread cannot fill a 25-100 Gbit/s link; 4 threads x 4 sockets (16,
    # within NCCL's cap of 64) does. Ring is bandwidth-optimal for the large gradient buckets.
    "ethernet": {
        "NCCL_IB_DISABLE": "1",
        "NCCL_SOCKET_NTHREADS": "4",
        "NCCL_NSOCKS_PERTHREAD": "4",
        "NCCL_ALGO": "Ring",
        "NCCL_BUFFSIZE": "8388608",
    },
}

_ALGOS = ("Ring", "Tree", "CollnetDirect", "CollnetChain", "NVLS", "NVLSTree", "PAT")
_GDR_LEVELS = ("LOC", "PIX", "PXB", "PHB", "SYS", "NVL")
_MAX_SOCKETS = 64  # NCCL refuses NSOCKS_PERTHREAD * SOCKET_NTHREADS above this


def _int_in(name: str, value: str, low: int, high: int | None = None) -> int:
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} must be an integer") from None
    if number < low or (high is not None and number > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise ConfigError(f"{name}={value!r} is out of range; use {bound}")
    return number


def _check_algo(value: str) -> None:
    # NCCL_ALGO takes a comma list, optionally negated with '^' ("^Tree" = anything but Tree).
    body = value[1:] if value.startswith("^") else value
    for algo in (a.strip() for a in body.split(",")):
        if ":" in algo:  # per-collective form "allreduce:tree"
            algo = algo.split(":", 1)[1]
        if algo.lower() not in {a.lower() for a in _ALGOS}:
            raise ConfigError(f"NCCL_ALGO={value!r}: {algo!r} is not an NCCL algorithm; choose from {', '.join(_ALGOS)}")


def validate_nccl_env(env: Mapping[str, str]) -> None:
    """Raise ConfigError, naming the variable and valid values, for any bad NCCL_* setting in ``env``."""
    if "NCCL_ALGO" in env:
        _check_algo(env["NCCL_ALGO"])
    if "NCCL_BUFFSIZE" in env:
        # Below 64 KiB NCCL's pipeline stalls; the default is 4 MiB (4194304).
        _int_in("NCCL_BUFFSIZE", env["NCCL_BUFFSIZE"], 65536)
    threads = _int_in("NCCL_SOCKET_NTHREADS", env["NCCL_SOCKET_NTHREADS"], 1, 16) if "NCCL_SOCKET_NTHREADS" in env else 1
    socks = _int_in("NCCL_NSOCKS_PERTHREAD", env["NCCL_NSOCKS_PERTHREAD"], 1, 64) if "NCCL_NSOCKS_PERTHREAD" in env else 1
    if threads * socks > _MAX_SOCKETS:
        raise ConfigError(
            f"NCCL_NSOCKS_PERTHREAD={socks} x NCCL_SOCKET_NTHREADS={threads} = {threads * socks} sockets; NCCL "
            f"allows at most {_MAX_SOCKETS}: lower one of them"
        )
    if "NCCL_IB_DISABLE" in env and env["NCCL_IB_DISABLE"] not in ("0", "1"):
        raise ConfigError(f"NCCL_IB_DISABLE={env['NCCL_IB_DISABLE']!r} must be 0 or 1")
    if "NCCL_NET_GDR_LEVEL" in env:
        value = env["NCCL_NET_GDR_LEVEL"]
        if value.upper() not in _GDR_LEVELS and not (value.isdigit() and int(value) <= 5):
            raise ConfigError(
                f"NCCL_NET_GDR_LEVEL={value!r} is not valid; use one of {', '.join(_GDR_LEVELS)} or 0..5"
            )


def preset_env(name: str) -> dict[str, str]:
    """The variables preset ``name`` sets (a copy)."""
    if name not in PRESETS:
        raise ConfigError(f"NCCL preset {name!r} is unknown; choose one of: {', '.join(PRESETS)}")
    return dict(PRESETS[name])


def apply_preset(name: str, overrides: Mapping[str, str] | None = None,
                 environ: MutableMapping[str, str] | None = None) -> dict[str, tuple[str, str]]:
    """Set preset ``name`` plus ``overrides`` in ``environ`` (os.environ by default); validate all of it.

    Variables the user already exported win over the preset (an explicit choice beats a named
    default); ``overrides`` win over both. Returns {variable: (value, source)} for printing.
    """
    environ = os.environ if environ is None else environ
    chosen: dict[str, tuple[str, str]] = {}
    for key, value in preset_env(name).items():
        if key in environ:
            chosen[key] = (environ[key], "environment")
        else:
            chosen[key] = (value, f"preset {name}")
    for key, value in (overrides or {}).items():
        if not key.startswith("NCCL_"):
            raise ConfigError(f"--nccl-env {key}={value}: only NCCL_* variables can be set here")
        chosen[key] = (str(value), "override")
    merged = {k: v for k, v in environ.items() if k.startswith("NCCL_")}
    merged.update({k: v for k, (v, _) in chosen.items()})
    validate_nccl_env(merged)
    for key, (value, _) in chosen.items():
        environ[key] = value
    return chosen


def format_env(chosen: Mapping[str, tuple[str, str]]) -> str:
    """Lines 'NCCL_X=value  (source)' for every tuned variable, defaults included."""
    lines = []
    for key in sorted(set(NCCL_DEFAULTS) | set(chosen)):
        if key in chosen:
            value, source = chosen[key]
            lines.append(f"  {key}={value}  ({source})")
        else:
            lines.append(f"  {key} unset: NCCL default {NCCL_DEFAULTS[key]}")
    return "\n".join(lines)
