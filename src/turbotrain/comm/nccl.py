"""Named NCCL environment presets, validated before any process starts.

NCCL reads its tuning from environment variables once, at communicator creation, and silently
ignores values it does not understand. So the presets and any user override are checked here,
against the NCCL release torch was built with (the algorithms and the syntax differ by release),
and what was applied is printed, so a run log always says which transport settings it used.
Setting them in a process whose NCCL communicators may already exist warns: that is too late.

>>> env = preset_env("ethernet")
>>> env["NCCL_IB_DISABLE"], int(env["NCCL_NSOCKS_PERTHREAD"]) * int(env["NCCL_SOCKET_NTHREADS"]) <= 64
('1', True)
"""

from __future__ import annotations

import os
import warnings
from typing import Mapping, MutableMapping

from ..errors import ConfigError

__all__ = ["PRESETS", "NCCL_DEFAULTS", "preset_env", "validate_nccl_env", "apply_preset", "format_env",
           "installed_nccl_version"]

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

#: NCCL_ALGO names -> (first release, first release without it), from ncclAlgoStr in NCCL's
#: src/init.cc across its tags; 2.5 is the oldest release checked. 2.14 split CollNet into
#: CollNetDirect and CollNetChain.
_ALGOS = {
    "Ring": ((2, 5), None),
    "Tree": ((2, 5), None),
    "CollNet": ((2, 6), (2, 14)),
    "CollNetDirect": ((2, 14), None),
    "CollNetChain": ((2, 14), None),
    "NVLS": ((2, 17), None),
    "NVLSTree": ((2, 18), None),
    "PAT": ((2, 23), None),
}
_PROTOS = {"LL": ((2, 5), None), "LL128": ((2, 5), None), "Simple": ((2, 5), None)}
#: Since 2.24 NCCL_ALGO and NCCL_PROTO take "list;collective:list;...". Older releases split on
#: commas only and skip names they do not know, so "allreduce:tree" there enables no algorithm.
_PER_COLLECTIVE_SINCE = (2, 24)
_COLLECTIVES = ("Broadcast", "Reduce", "AllGather", "ReduceScatter", "AllReduce")
#: Where the NCCL release is unknown (a torch without NCCL): the newest this table knows.
_NEWEST = (2, 30)
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


def installed_nccl_version() -> tuple[int, ...] | None:
    """The NCCL release torch was built with, e.g. (2, 21, 5); None for a torch without NCCL."""
    try:
        import torch.cuda.nccl

        version = torch.cuda.nccl.version()
    except (ImportError, AttributeError, RuntimeError):  # CPU builds have no _nccl_version
        return None
    return tuple(version) if isinstance(version, tuple) else None


def _release(version) -> str:
    return ".".join(map(str, version)) if version else f"unknown (checked as {'.'.join(map(str, _NEWEST))})"


def _check_name(var: str, value: str, name: str, table: dict, kind: str, version) -> None:
    """ConfigError unless ``name`` (compared as NCCL does: whole, case-insensitive) exists in ``version``."""
    have = version or _NEWEST
    valid = [k for k, (since, gone) in table.items() if since <= have and (gone is None or have < gone)]
    match = next((k for k in table if k.lower() == name.lower()), None)
    if match in valid:
        return
    listed = ", ".join(valid)
    if match is None:
        hint = " (NCCL does not strip spaces)" if name != name.strip() else ""
        raise ConfigError(f"{var}={value!r}: {name!r} is not an NCCL {kind}{hint}; choose from {listed}")
    since, gone = table[match]
    when = f"NCCL >= {'.'.join(map(str, since))}" if have < since else f"NCCL < {'.'.join(map(str, gone))}"
    raise ConfigError(f"{var}={value!r}: {match} needs {when}, and this torch has NCCL {_release(version)}; "
                      f"choose from {listed}")


def _check_tuning_list(var: str, value: str, table: dict, kind: str, version) -> None:
    """NCCL_ALGO / NCCL_PROTO: 'a,b', '^a' (all but a) and, from 2.24, 'a,b;allreduce:^c;...'."""
    entries = value.split(";")
    if (len(entries) > 1 or ":" in value) and (version or _NEWEST) < _PER_COLLECTIVE_SINCE:
        raise ConfigError(
            f"{var}={value!r}: per-collective lists ('collective:list;...') need NCCL >= 2.24, and this torch "
            f"has NCCL {_release(version)}, which would read it as unknown names; give one list for all "
            "collectives (e.g. 'Ring,Tree' or '^Tree')"
        )
    for position, entry in enumerate(entries):
        if entry.count(":") > 1:
            raise ConfigError(f"{var}={value!r}: {entry!r} has more than one ':'; write 'collective:list'")
        collective, _, names = entry.rpartition(":")
        if collective and collective.lower() not in {c.lower() for c in _COLLECTIVES}:
            raise ConfigError(f"{var}={value!r}: {collective!r} is not a collective; "
                              f"choose from {', '.join(_COLLECTIVES)}")
        if not collective and position > 0:
            raise ConfigError(f"{var}={value!r}: only the first entry may leave out its 'collective:' prefix")
        for name in names.removeprefix("^").split(","):
            _check_name(var, value, name, table, kind, version)


def validate_nccl_env(env: Mapping[str, str], nccl_version: tuple[int, ...] | None = None) -> None:
    """Raise ConfigError, naming the variable and valid values, for any bad NCCL_* setting in ``env``.

    Names and syntax are those of ``nccl_version`` (default: installed_nccl_version(), or the newest
    release known here where torch has no NCCL).
    """
    version = nccl_version or installed_nccl_version()
    for var, table, kind in (("NCCL_ALGO", _ALGOS, "algorithm"), ("NCCL_PROTO", _PROTOS, "protocol")):
        if env.get(var):  # set but empty: NCCL ignores it
            _check_tuning_list(var, env[var], table, kind, version)
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


_LATE_WARNED = [False]


def _warn_if_too_late(environ: MutableMapping[str, str]) -> None:
    """Warn (once per process) when this process's own NCCL may already have read its environment."""
    if environ is not os.environ or _LATE_WARNED[0]:
        return  # a child's environment (turbotrain launch) is always in time
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        _LATE_WARNED[0] = True
        warnings.warn(
            "NCCL settings were applied after torch.distributed was initialised; NCCL reads NCCL_* when it "
            "creates a communicator (and caches some for the whole process), so they may be ignored here. "
            "Apply the preset before init_process_group, or start the job with turbotrain launch --nccl-preset.",
            RuntimeWarning, stacklevel=3,
        )


def apply_preset(name: str, overrides: Mapping[str, str] | None = None,
                 environ: MutableMapping[str, str] | None = None,
                 nccl_version: tuple[int, ...] | None = None) -> dict[str, tuple[str, str]]:
    """Set preset ``name`` plus ``overrides`` in ``environ`` (os.environ by default); validate all of it.

    Variables the user already exported win over the preset (an explicit choice beats a named
    default); ``overrides`` win over both. Returns {variable: (value, source)} for printing.
    Applied to os.environ once torch.distributed is initialised, it warns once: too late for NCCL.
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
    validate_nccl_env(merged, nccl_version)
    if chosen:
        _warn_if_too_late(environ)
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
