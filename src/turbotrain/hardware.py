"""What this machine is, how fast it can multiply, and which precision to train in.

The matmul peak measured here is the denominator of every MFU figure turbotrain prints, so it is
measured the same way every time (square matmul in both operand layouts, warm-up, the *maximum*
over timed trials, 2 FLOPs per multiply-add) and cached per (device, dtype, torch version, CPU
model, threads) so a benchmark does not pay for it again. A maximum, because a median folds in
whatever else the machine was doing, and a denominator that is too low makes every MFU too high.
The benchmark ladder's peak (bench/peak.py) times its trials with the same :func:`timed_trials`.

>>> info = detect("cpu")
>>> precision, reason = recommend_precision(info)
>>> precision in ("fp32", "bf16-master", "fp16-master")
True
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

import torch

from .errors import ConfigError, HardwareError, check_choice
from .utils import atomic_write, sync_device

logger = logging.getLogger(__name__)

__all__ = [
    "HardwareInfo",
    "detect",
    "measure_matmul_peak",
    "timed_trials",
    "measure_memory_bandwidth",
    "recommend_precision",
    "native_bf16_feature",
    "cuda_bf16_native",
    "NATIVE_BF16_FEATURES",
    "cache_dir",
    "resolve_device",
    "default_matmul_size",
    "parse_cpuinfo",
    "environment_report",
    "malloc_env",
    "spinning_omp_env",
    "openmp_runtime",
    "check_idle_threads_sleep",
    "TUNED_MALLOC_ENV",
    "tune_malloc",
    "page_faults",
    "CPU_FEATURES",
]

#: /proc/cpuinfo flags that decide how fast low precision runs on a CPU.
#: CPU flags with which torch's bf16 matmul is native; without them it is emulated (tens of times slower).
NATIVE_BF16_FEATURES = ("amx_bf16", "avx512_bf16")
CPU_FEATURES = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512_fp16", "avx512f", "avx2")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: glibc malloc settings for a training process (``turbotrain bench --malloc-tuned`` starts every
#: row with them). A step frees and allocates the same large buffers again; by default glibc maps
#: each one above its mmap threshold (128 KiB, rising to at most 32 MiB) on its own and unmaps it
#: when freed, so every step faults its pages in afresh. With no mmap'd chunks and a trim threshold
#: above any heap, the freed pages stay mapped for the next step. Read once, when a process starts.
TUNED_MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(64 * 2**30)}
_MALLOPT = {"MALLOC_MMAP_MAX_": -4, "MALLOC_TRIM_THRESHOLD_": -1}  # glibc's M_MMAP_MAX, M_TRIM_THRESHOLD
_VERSIONED = ("torch", "rich", "tokenizers", "numpy", "matplotlib")


@dataclass(frozen=True)
class HardwareInfo:
    """The machine a run happens on; ``to_dict()`` is what benchmark headers record."""

    device: str
    """'cpu' or 'cuda': where tensors live."""
    cpu_model: str
    """CPU model name from /proc/cpuinfo (platform.processor() elsewhere)."""
    cpu_count: int
    """Logical CPUs the OS reports."""
    torch_threads: int
    """Intra-op threads torch uses (torch.get_num_threads())."""
    cpu_features: tuple[str, ...]
    """Those of CPU_FEATURES the CPU flags list."""
    cuda_name: str | None = None
    """GPU name, when device is 'cuda'."""
    cuda_capability: tuple[int, int] | None = None
    """Compute capability (major, minor), when device is 'cuda'."""
    versions: dict = field(default_factory=dict)
    """python and library versions."""

    def to_dict(self) -> dict:
        out = asdict(self)
        out["cpu_features"] = list(self.cpu_features)
        out["cuda_capability"] = list(self.cuda_capability) if self.cuda_capability else None
        return out


def resolve_device(device: str = "auto") -> str:
    """'auto' -> 'cuda' when a GPU is visible else 'cpu'; 'cuda' without one raises HardwareError."""
    check_choice("device", device, ("auto", "cpu", "cuda"))
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise HardwareError("device='cuda' was asked for but torch sees no GPU; use --device cpu or auto")
    return device


def parse_cpuinfo(text: str) -> tuple[str | None, frozenset[str]]:
    """(model name, flags) of the first processor listed in /proc/cpuinfo-formatted ``text``."""
    model, flags = None, frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    return model, flags


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> tuple[str, frozenset[str]]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: no flags, so recommend_precision falls back to fp32
        text = ""
    model, flags = parse_cpuinfo(text)
    return model or platform.processor() or "unknown", flags


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for name in _VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    out["torch"] = torch.__version__  # the runtime one: a +cpu/+cu suffix matters for peaks
    return out


def detect(device: str = "auto") -> HardwareInfo:
    """Describe the machine; see HardwareInfo for the fields."""
    device = resolve_device(device)
    model, flags = _cpuinfo()
    cuda_name = cuda_cap = None
    if device == "cuda":
        cuda_name = torch.cuda.get_device_name()
        cuda_cap = tuple(torch.cuda.get_device_capability())
    return HardwareInfo(
        device=device,
        cpu_model=model,
        cpu_count=os.cpu_count() or 1,
        torch_threads=torch.get_num_threads(),
        cpu_features=tuple(f for f in CPU_FEATURES if f in flags),
        cuda_name=cuda_name,
        cuda_capability=cuda_cap,
        versions=_versions(),
    )


def recommend_precision(info: HardwareInfo) -> tuple[str, str]:
    """The Config.precision to train in on ``info``, and the reason (naming the feature found)."""
    if info.device == "cuda" and info.cuda_capability:
        major, minor = info.cuda_capability
        if major >= 8:
            return "bf16-master", f"CUDA capability {major}.{minor} >= 8.0 has bf16 tensor cores"
        if major == 7:
            return "fp16-master", f"CUDA capability {major}.{minor} has fp16 tensor cores but no bf16"
        return "fp32", f"CUDA capability {major}.{minor} has no low-precision tensor cores"
    if feature := native_bf16_feature(info):
        return "bf16-master", f"CPU flag {feature} gives native bf16 matmul"
    return "fp32", f"no CPU flag for native bf16 matmul ({', '.join(NATIVE_BF16_FEATURES)}) was found"


def native_bf16_feature(info: HardwareInfo) -> str | None:
    """The CPU flag that gives ``info``'s CPU native bf16 matmul, or None where torch emulates it."""
    return next((f for f in NATIVE_BF16_FEATURES if f in info.cpu_features), None)


def cuda_bf16_native(device=None) -> bool:
    """True when the CUDA ``device`` (the current one by default) computes bf16 natively.

    ``torch.cuda.is_bf16_supported()`` also says True on pre-Ampere GPUs (V100, T4) where bf16
    only works emulated, many times slower than fp16 and without bf16 tensor cores; bf16 training
    there is a mistake. Native means compute capability >= 8.0 (ROCm: whatever torch says).

    >>> cuda_bf16_native() == (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0))
    True
    """
    if not torch.cuda.is_available():
        return False
    # is_bf16_supported asks the current device; make that ``device`` (None: leave it as it is).
    with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
        try:
            supported = torch.cuda.is_bf16_supported(including_emulation=False)
        except TypeError:  # a torch without the switch: the capability below decides alone
            supported = True
        if torch.version.hip:
            return supported
        return supported and tuple(torch.cuda.get_device_capability()) >= (8, 0)


# ----------------------------------------------------------------------------------------- caching
def cache_dir() -> Path:
    """Where measured peaks are kept: $TURBOTRAIN_CACHE, else ~/.cache/turbotrain."""
    return Path(os.environ.get("TURBOTRAIN_CACHE") or Path.home() / ".cache" / "turbotrain")


def _cache_key(kind: str, device: str, dtype: str, size: int) -> str:
    model, flags = _cpuinfo()
    gpu = torch.cuda.get_device_name() if device == "cuda" else "-"
    # threads are part of the key: a peak measured on 16 threads is no denominator for 2; so are the
    # CPU's matmul features: two machines both named "AMD EPYC", one with avx512_bf16, differ 900x in bf16.
    features = "+".join(f for f in CPU_FEATURES if f in flags) or "-"
    return "|".join([kind, device, gpu, dtype, str(size), torch.__version__, model, features,
                     str(torch.get_num_threads())])


def _cached(key: str, measure, force: bool) -> float:
    path = cache_dir() / "peaks.json"
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    if not force and key in table:
        return float(table[key]["value"])
    value = measure()
    table[key] = {"value": value, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # atomic, so two benchmarks measuring at once cannot corrupt it
        atomic_write(path, json.dumps(table, indent=1, sort_keys=True))
    except OSError as exc:  # a read-only home still gets a measured number, just not a cached one
        logger.warning("could not cache peaks in %s (%s); set TURBOTRAIN_CACHE", path, exc)
    return value


def _median_seconds(fn, device: str, seconds: float, min_repeats: int = 5) -> float:
    """Median wall time of ``fn()`` over repeats filling about ``seconds``, after one warm-up call."""
    fn()
    sync_device(device)
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(times) < min_repeats or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        fn()
        sync_device(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def timed_trials(fn, device: str, trials: int, trial_seconds: float, give_up_after: float = math.inf) -> list[float]:
    """Seconds per call of ``fn()`` in each of ``trials`` trials, for taking the best of.

    One warm-up call (kernel selection, lazy initialisation), one call that sizes the trials, then
    each trial times back-to-back calls filling at least ``trial_seconds``, ended by a device sync.
    Once ``give_up_after`` seconds have passed, it stops after the second trial (a slow shape).
    """
    fn()
    sync_device(device)
    t0 = time.perf_counter()
    fn()
    sync_device(device)
    reps = max(1, math.ceil(trial_seconds / max(time.perf_counter() - t0, 1e-6)))
    out: list[float] = []
    started = time.perf_counter()
    for i in range(trials):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync_device(device)
        out.append((time.perf_counter() - t0) / reps)
        if i >= 1 and time.perf_counter() - started > give_up_after:
            break
    return out


def default_matmul_size(dtype: str, device: str) -> int:
    """Big enough to be compute-bound; fp16 on a CPU is emulated (~25x slower) so kept small."""
    if device == "cuda":
        return 8192
    return 256 if dtype == "fp16" else 1024


def measure_matmul_peak(
    dtype: str | torch.dtype = "fp32",
    device: str = "cpu",
    size: int | None = None,
    seconds: float = 0.5,
    *,
    force: bool = False,
    use_cache: bool = True,
    trials: int = 5,
) -> float:
    """Best FLOP/s of a square ``size`` x ``size`` matmul (2 FLOPs per multiply-add): the fastest
    of ``trials`` timed trials in each operand layout, about ``seconds`` in all.

    Cached per (device, dtype, size, torch version, CPU model, threads); ``force=True`` (or
    TURBOTRAIN_REMEASURE=1) measures again and overwrites the cache.
    """
    name = _dtype_name(dtype)
    device = resolve_device(device)
    size = size or default_matmul_size(name, device)
    if name == "fp16" and device == "cpu":
        seconds = min(seconds, 0.3)  # emulated fp16: a few repeats of a small matmul are plenty

    def measure() -> float:
        gen = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(size, size, device=device, generator=gen).to(_DTYPES[name])
        b = torch.randn(size, size, device=device, generator=gen).to(_DTYPES[name])
        # both operand layouts: nn.Linear multiplies by a transposed weight, and on some CPUs the two
        # take different kernels (bf16 without native support: 0.6 vs 4.3 GFLOP/s at n=1024 seen here)
        best = min(min(timed_trials(lambda: torch.mm(a, b), device, trials, seconds / (2 * trials))),
                   min(timed_trials(lambda: torch.mm(a, b.t()), device, trials, seconds / (2 * trials))))
        return 2.0 * size**3 / best

    force = force or os.environ.get("TURBOTRAIN_REMEASURE") == "1"
    if not use_cache:
        return measure()
    # "matmul-max": entries of the older median method are not read as maxima
    return _cached(_cache_key("matmul-max", device, name, size), measure, force)


def measure_memory_bandwidth(
    device: str = "cpu", nbytes: int = 256 * 2**20, seconds: float = 0.5, *, force: bool = False
) -> float:
    """Copy bandwidth in bytes/s of a large buffer; counts read + write (2 x nbytes per copy)."""
    device = resolve_device(device)

    def measure() -> float:
        src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
        dst = torch.empty_like(src)
        return 2.0 * nbytes / _median_seconds(lambda: dst.copy_(src), device, seconds)

    force = force or os.environ.get("TURBOTRAIN_REMEASURE") == "1"
    return _cached(_cache_key("copy", device, "u8", nbytes), measure, force)


def _dtype_name(dtype) -> str:
    if isinstance(dtype, torch.dtype):
        for name, value in _DTYPES.items():
            if value == dtype:
                return name
    check_choice("dtype", dtype, tuple(_DTYPES))
    return dtype


# --------------------------------------------------------------------------------------------- CLI
def tune_malloc() -> bool:
    """Give this running process the settings of ``TUNED_MALLOC_ENV`` through glibc's ``mallopt``.

    The environment variables work only for a process about to start (glibc reads them once); this
    is the same remedy for the process that is already running, a notebook or a script launched by
    something else: large freed buffers stay mapped, so the next step does not fault their pages in
    afresh. Call it before training; it is process wide and stays in force. The cost: memory a step
    frees is kept by the process instead of returned to the system, so its resident size stays at
    its high-water mark. Returns True when applied; on a C library without ``mallopt`` (musl,
    macOS) it says so once and returns False.
    """
    import ctypes
    import ctypes.util
    import warnings

    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None or platform.libc_ver()[0] != "glibc":
        warnings.warn("tune_malloc: this C library is not glibc, so its allocator is left as it is", stacklevel=2)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    for variable, option in _MALLOPT.items():
        value = min(int(TUNED_MALLOC_ENV[variable]), 2**31 - 1)  # mallopt takes an int: 2 GiB is "never trim" enough
        if mallopt(option, value) != 1:
            raise HardwareError(f"glibc's mallopt refused {variable}={value}; set {variable} in the environment of "
                                "the process before it starts instead")
    return True


def page_faults() -> int:
    """This process's minor page faults so far: a fault maps a page without reading a disk, which is
    what a freshly mapped buffer costs on its first touch (glibc maps each large allocation afresh
    unless ``tune_malloc``'s settings are in force)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def malloc_env(environ=None) -> dict[str, str]:
    """The glibc ``MALLOC_*`` settings in ``environ`` (os.environ: what processes started from here get).

    >>> malloc_env({"MALLOC_MMAP_MAX_": "0", "PATH": "/bin"})
    {'MALLOC_MMAP_MAX_': '0'}
    """
    environ = os.environ if environ is None else environ
    return {k: v for k, v in sorted(environ.items()) if k.startswith("MALLOC_")}


#: libgomp's spin count when OMP_WAIT_POLICY is unset (its manual): well under a millisecond of spinning.
_GOMP_DEFAULT_SPINS = 300_000
#: Intel OpenMP's KMP_BLOCKTIME (milliseconds) above which an idle process still spins into the next row's step.
_KMP_MAX_BLOCK_MS = 1.0
_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}  # GOMP_SPINCOUNT's multipliers
_BLOCK_UNITS = {"": 1.0, "ms": 1.0, "us": 1e-3, "s": 1e3}  # KMP_BLOCKTIME's units, in ms


def _quantity(value: str, units: dict) -> float | None:
    """``value`` as a number with an optional unit from ``units`` (name -> multiplier), infinite as
    math.inf, or None where it is neither (a value the runtime parses its own way)."""
    text = value.strip().lower()
    if text in ("infinite", "infinity"):
        return math.inf
    number = text.rstrip("".join(units))
    unit = text[len(number):]
    return float(number) * units[unit] if number.isdigit() and unit in units else None


def openmp_runtime() -> str | None:
    """The OpenMP runtime this process has loaded: 'gnu' (libgomp: torch's Linux wheels), 'intel'
    (libiomp5), 'llvm' (libomp), or None (none loaded, or no /proc to tell)."""
    try:
        with open("/proc/self/maps") as f:
            names = {line.rsplit("/", 1)[-1].strip() for line in f if "omp" in line}
    except OSError:
        return None
    for prefix, runtime in (("libiomp5", "intel"), ("libomp.", "llvm"), ("libgomp", "gnu")):
        if any(name.startswith(prefix) for name in names):
            return runtime
    return None


def spinning_omp_env(environ=None, runtime: str | None = None) -> dict[str, str]:
    """The OpenMP settings in ``environ`` that keep a process's idle threads spinning for more than
    about a millisecond after its last parallel region: ``OMP_WAIT_POLICY=active``,
    ``GOMP_SPINCOUNT`` infinite or above libgomp's default of 300000, ``KMP_BLOCKTIME`` (Intel and
    LLVM OpenMP) infinite or above 1 ms, or unset where ``runtime`` is 'intel' or 'llvm' (their
    default is 200 ms). Values the runtimes would not parse are left to them. Without ``environ``:
    os.environ and the runtime this process has loaded (:func:`openmp_runtime`).

    >>> spinning_omp_env({"OMP_WAIT_POLICY": "ACTIVE", "KMP_BLOCKTIME": "1", "PATH": "/bin"})
    {'OMP_WAIT_POLICY': 'ACTIVE'}
    """
    if environ is None:
        environ, runtime = os.environ, openmp_runtime()
    found = {}
    if environ.get("OMP_WAIT_POLICY", "").strip().lower() == "active":
        found["OMP_WAIT_POLICY"] = environ["OMP_WAIT_POLICY"]
    spins = _quantity(environ.get("GOMP_SPINCOUNT", ""), _SUFFIX)
    if spins is not None and spins > _GOMP_DEFAULT_SPINS:
        found["GOMP_SPINCOUNT"] = environ["GOMP_SPINCOUNT"]
    block = _quantity(environ.get("KMP_BLOCKTIME", ""), _BLOCK_UNITS)
    if block is not None and block > _KMP_MAX_BLOCK_MS:
        found["KMP_BLOCKTIME"] = environ["KMP_BLOCKTIME"]
    elif "KMP_BLOCKTIME" not in environ and runtime in ("intel", "llvm"):
        found["KMP_BLOCKTIME"] = f"unset ({runtime} OpenMP's default, 200 ms)"
    return found


def check_idle_threads_sleep(environ=None) -> None:
    """ConfigError when ``environ`` keeps idle OpenMP threads spinning (:func:`spinning_omp_env`).

    The interleaved ladder (bench, compare, tune) keeps one process per row waiting while another
    row's steps are timed, and this process waits through all of them. With idle threads that spin,
    the waiting processes take the cores the timed row needs: on the 2-core AVX512-BF16 EPYC, with
    ``OMP_WAIT_POLICY=active`` the quick gpt ladder measured 2.48 s a step against 0.025 s, and the
    rows' ratios moved too. No setting made inside a running process undoes it (the runtime reads
    the variables when it loads), so the ladder refuses to start.
    """
    spinning = spinning_omp_env(environ)
    if not spinning:
        return
    fix = " ".join(["env", *(f"-u {name}" for name in spinning if name != "KMP_BLOCKTIME"),
                    *(["KMP_BLOCKTIME=1"] if "KMP_BLOCKTIME" in spinning else [])])
    settings = " ".join(f"{k}={v}" for k, v in spinning.items())
    raise ConfigError(
        f"{settings} keeps idle OpenMP threads spinning, and the interleaved ladder keeps a process per row "
        "waiting while another row is timed: their threads would take the timed row's cores (about 100x slower "
        f"steps on 2 cores); run it with idle threads sleeping, e.g. `{fix} turbotrain ...`"
    )


def environment_report(device: str = "auto", *, dtypes=("fp32", "bf16", "fp16"), force: bool = False) -> dict:
    """Everything ``turbotrain env`` prints, as one JSON-ready dict (also a benchmark header)."""
    info = detect(device)
    peaks = {d: measure_matmul_peak(d, info.device, force=force) for d in dtypes}
    precision, reason = recommend_precision(info)
    return {
        "hardware": info.to_dict(),
        "matmul_peak_flops": peaks,
        "matmul_peak_method": "square torch.mm, the faster of B and B^T layouts, maximum over timed trials after warm-up, 2 FLOPs per multiply-add; "
        + ", ".join(f"{d} n={default_matmul_size(d, info.device)}" for d in _DTYPES),
        "memory_bandwidth_bytes_per_s": measure_memory_bandwidth(info.device, force=force),
        "recommended_precision": precision,
        "recommended_precision_reason": reason,
        "malloc_env": malloc_env(),
        "spinning_omp_env": spinning_omp_env(),
    }


def print_environment(report: dict, console=None) -> None:
    """Human form of environment_report()."""
    from rich.console import Console

    console = console or Console()
    hw = report["hardware"]
    console.print(f"[bold]device[/] {hw['device']}   cpu {hw['cpu_model']} "
                  f"({hw['cpu_count']} logical CPUs, torch uses {hw['torch_threads']} threads)")
    if hw["device"] == "cuda":
        cap = ".".join(map(str, hw["cuda_capability"]))
        console.print(f"[bold]gpu[/] {hw['cuda_name']}   capability {cap}")
    console.print(f"[bold]cpu features[/] {', '.join(hw['cpu_features']) or 'none of ' + ', '.join(CPU_FEATURES)}")
    console.print("[bold]versions[/] " + ", ".join(f"{k} {v}" for k, v in hw["versions"].items()))
    peaks = ", ".join(f"{d} {v / 1e9:.1f}" for d, v in report["matmul_peak_flops"].items())
    console.print(f"[bold]matmul peak (GFLOP/s)[/] {peaks}   [dim]({report['matmul_peak_method']})[/]")
    console.print(f"[bold]copy bandwidth[/] {report['memory_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s (read + write)")
    console.print(f"[bold]recommended precision[/] {report['recommended_precision']}: "
                  f"{report['recommended_precision_reason']}")
    malloc = report.get("malloc_env") or {}
    hint = ("; a CPU training step maps its large buffers afresh each time, turbotrain.hardware.tune_malloc() "
            "keeps them mapped") if report.get("hardware", {}).get("device") == "cpu" else ""
    console.print("[bold]malloc settings[/] " + (" ".join(f"{k}={v}" for k, v in malloc.items())
                                                  or "glibc defaults (no MALLOC_* variables set)" + hint))
    if spinning := report.get("spinning_omp_env"):
        console.print("[bold]OpenMP idle threads[/] spin (" + " ".join(f"{k}={v}" for k, v in spinning.items())
                      + "): turbotrain bench and tune refuse to run with this, since waiting workers would take "
                        "the timed row's cores")
