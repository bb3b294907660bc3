"""An alpha-beta cost model of the gradient exchange: what ``turbotrain comm-plan`` prints.

Every collective is priced as latency steps x alpha (seconds per message hop) plus the bytes
that cross the busiest link / its bandwidth (beta = 1 / bandwidth):

* ring all-reduce over N ranks: 2(N-1) steps, each rank's link carries 2(N-1)/N x S;
* tree all-reduce (NCCL's double binary tree between nodes, a chain inside one): 2 (log2 M + G-1)
  steps, 2 S per link (pipelined; about the ring's bandwidth, far fewer steps);
* hierarchical: reduce-scatter inside each node over NVLink, ring all-reduce of S/G per GPU
  between the M nodes (G rings share each node's NICs), all-gather inside the node;
* parameter server with P servers spread over the nodes: every worker pushes S/P to each
  server and pulls it back; a server node's NIC carries (N-G) S / min(P, M) each way, the
  topology's bottleneck;
* all_to_all (1-bit Adam's worker -> server step): pairwise exchange, N-1 steps, a node's NICs
  carry G (N-G)/N x S of each GPU's send buffer; all_gather: ring, N-1 steps, (N-1)/N x S.

N ranks = M nodes x G GPUs; a node's network bandwidth is the link's rate x efficiency x NICs.
Compressors change S and add work: bf16 halves S; PowerSGD rank r sends factors of
~1.5 r / d of the gradient for a transformer of width d (d estimated from the parameter count
as d ~ (128 P / 12)^(1/3), i.e. 12 L d^2 parameters with L = d / 128) in two all-reduces, and
reads the gradient ~5 times in HBM; 1-bit Adam after warm-up sends P/8 bytes by all_to_all and
P/8 by all_gather from inside optimizer.step() (not overlapped), and reads ~10 x 4P bytes.

Overlap: DDP reduces buckets while backward runs; backward is taken as 2/3 of the compute time,
and at least the last bucket's exchange is exposed. Step time = compute + exposed exchange +
compressor work. It is a model: it ignores congestion, stragglers, NCCL protocol switches and
kernel contention, and its link presets are nominal rates with stated efficiencies; fit alpha
and beta to your own ``comm-bench`` rows (``fit_alpha_beta``) to price your own network.

>>> rows = [r for r in predict(7e9, "100gbe", nodes=16, compute_s=1.0) if r["ranks"] == 128]
>>> best = min(rows, key=lambda r: r["step_s"]); best["compressor"], best["algorithm"]
('powersgd r=4', 'tree')
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import ConfigError

__all__ = ["Link", "LINKS", "Topology", "Fit", "fit_alpha_beta", "load_bench_rows", "link_from_fit",
           "collective_time", "exposed_seconds", "predict", "format_table", "format_scaling", "nccl_settings", "run_comm_plan",
           "DEFAULT_RANKS"]

#: The rank counts the scaling table covers.
DEFAULT_RANKS = (8, 16, 32, 64, 128, 256, 512, 1024)
BUCKET_BYTES = 25 * 2**20  # DDP's default bucket: the unit that is exposed after backward
BACKWARD_SHARE = 2 / 3  # backward ~ 2x forward FLOPs: the window DDP can overlap the exchange with
HBM_BYTES_PER_S = 2.5e12  # achievable HBM bandwidth of an H100-class GPU (3.35 TB/s peak)


@dataclass(frozen=True)
class Link:
    """One kind of link: nominal rate, the share of it collectives reach, per-hop latency."""

    name: str
    gbps: float
    """Nominal line rate in Gbit/s, one direction."""
    efficiency: float
    """Fraction of the rate NCCL's bus bandwidth reaches on it (nccl-tests busbw / line rate)."""
    alpha_s: float
    """Latency of one message hop, seconds (NCCL's per-step cost on this transport)."""
    kind: str
    """'ethernet' (TCP sockets), 'infiniband' (RDMA) or 'nvlink' (inside a node)."""

    @property
    def bytes_per_s(self) -> float:
        return self.gbps * 1e9 / 8 * self.efficiency


#: Link presets. Efficiencies: TCP over 10/25 GbE reaches ~90% of line rate, one host rarely
#: pushes more than ~80 Gbit/s through 100 GbE sockets; InfiniBand RDMA ~92%; H100 NVLink 4
#: (450 GB/s per direction) shows ~360 GB/s busbw in nccl-tests. Latencies: ~50/40/30 us per
#: TCP hop, ~5 us per IB hop, ~3 us per NVLink hop.
LINKS = {
    "10gbe": Link("10 GbE (TCP)", 10, 0.90, 50e-6, "ethernet"),
    "25gbe": Link("25 GbE (TCP)", 25, 0.90, 40e-6, "ethernet"),
    "100gbe": Link("100 GbE (TCP)", 100, 0.80, 30e-6, "ethernet"),
    "200ib": Link("200 Gb/s InfiniBand HDR", 200, 0.92, 5e-6, "infiniband"),
    "400ib": Link("400 Gb/s InfiniBand NDR", 400, 0.92, 5e-6, "infiniband"),
    "nvlink": Link("NVLink 4 (H100 SXM)", 3600, 0.80, 3e-6, "nvlink"),
}
_ALIASES = {"ib200": "200ib", "hdr": "200ib", "ib400": "400ib", "ndr": "400ib", "10g": "10gbe", "25g": "25gbe",
            "100g": "100gbe", "nvl": "nvlink"}


def get_link(name: str) -> Link:
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in LINKS:
        raise ConfigError(f"link {name!r} is not a preset; choose from {', '.join(LINKS)}")
    return LINKS[key]


@dataclass(frozen=True)
class Topology:
    """M nodes x G GPUs, the network between nodes and NVLink inside them."""

    nodes: int
    gpus_per_node: int
    inter: Link
    intra: Link = LINKS["nvlink"]
    nics_per_node: int = 1

    @property
    def ranks(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def network_bytes_per_s(self) -> float:
        return self.inter.bytes_per_s * self.nics_per_node

    @property
    def hop(self) -> Link:
        """The link a flat algorithm's slowest step crosses."""
        return self.inter if self.nodes > 1 else self.intra

    def flat_bytes_per_s(self) -> float:
        """What a flat ring over every rank gets: one ring edge per node crosses the network."""
        if self.nodes == 1:
            return self.intra.bytes_per_s
        return min(self.intra.bytes_per_s, self.network_bytes_per_s)


# -- collectives ----------------------------------------------------------------------------------
def ring_allreduce(size: float, topo: Topology) -> float:
    n = topo.ranks
    if n == 1:
        return 0.0
    return 2 * (n - 1) * topo.hop.alpha_s + 2 * (n - 1) / n * size / topo.flat_bytes_per_s()


def tree_allreduce(size: float, topo: Topology) -> float:
    if topo.ranks == 1:
        return 0.0
    steps_net = math.ceil(math.log2(topo.nodes)) if topo.nodes > 1 else 0
    latency = 2 * (steps_net * topo.inter.alpha_s + (topo.gpus_per_node - 1) * topo.intra.alpha_s)
    return latency + 2 * size / topo.flat_bytes_per_s()


def hierarchical_allreduce(size: float, topo: Topology) -> float:
    g, m = topo.gpus_per_node, topo.nodes
    inside = 0.0
    if g > 1:  # reduce-scatter, and the all-gather after, over NVLink
        inside = 2 * ((g - 1) * topo.intra.alpha_s + (g - 1) / g * size / topo.intra.bytes_per_s)
    between = 0.0
    if m > 1:  # G rings of S/G each share the node's NICs: 2(M-1)/M x S per node
        between = 2 * (m - 1) * topo.inter.alpha_s + 2 * (m - 1) / m * size / topo.network_bytes_per_s
    return inside + between


def parameter_server(size: float, topo: Topology, servers: int) -> float:
    n, g, m = topo.ranks, topo.gpus_per_node, topo.nodes
    if n == 1:
        return 0.0
    if m == 1:  # each server GPU receives (G-1)/P x S over its NVLink, and sends it back
        return 2 * (topo.intra.alpha_s + (g - 1) * size / (servers * topo.intra.bytes_per_s))
    incoming = (n - g) * size / min(servers, m)  # per server node, from workers on other nodes
    outgoing = g * size * (m - 1) / m  # per worker node: its G workers' pushes to other nodes
    return 2 * (topo.inter.alpha_s + max(incoming, outgoing) / topo.network_bytes_per_s)


def all_to_all(send_size: float, topo: Topology) -> float:
    n, g = topo.ranks, topo.gpus_per_node
    if n == 1:
        return 0.0
    if topo.nodes == 1:
        return (n - 1) * topo.intra.alpha_s + (n - 1) / n * send_size / topo.intra.bytes_per_s
    network = g * (n - g) / n * send_size / topo.network_bytes_per_s
    nvlink = (g - 1) / n * send_size / topo.intra.bytes_per_s
    return (n - 1) * topo.inter.alpha_s + max(network, nvlink)


def all_gather(total_size: float, topo: Topology) -> float:
    n = topo.ranks
    if n == 1:
        return 0.0
    return (n - 1) * topo.hop.alpha_s + (n - 1) / n * total_size / topo.flat_bytes_per_s()


_ALGORITHMS = {"ring": ring_allreduce, "tree": tree_allreduce, "hierarchical": hierarchical_allreduce}


def collective_time(algorithm: str, size: float, topo: Topology, servers: int | None = None) -> float:
    """Seconds for one all-reduce of ``size`` bytes per rank with ``algorithm``."""
    if algorithm == "parameter_server":
        return parameter_server(size, topo, servers or topo.nodes)
    if algorithm not in _ALGORITHMS:
        raise ConfigError(f"algorithm {algorithm!r} is not modelled; choose from "
                          f"{', '.join([*_ALGORITHMS, 'parameter_server'])}")
    return _ALGORITHMS[algorithm](size, topo)


# -- fitting comm-bench rows ----------------------------------------------------------------------
@dataclass(frozen=True)
class Fit:
    """t = alpha + beta x size for one collective at one world size, and how well that fits."""

    op: str
    world: int
    alpha_s: float
    beta_s_per_byte: float
    points: int
    median_error: float
    """Median of |fit - measured| / measured over the points."""
    max_error: float

    def time(self, size: float) -> float:
        return self.alpha_s + self.beta_s_per_byte * size

    def describe(self) -> str:
        bw = 1 / self.beta_s_per_byte / 1e9 if self.beta_s_per_byte > 0 else math.inf
        return (f"{self.op} on {self.world} ranks, {self.points} sizes: alpha {self.alpha_s * 1e6:.1f} us, "
                f"1/beta {bw:.3f} GB/s of buffer; error vs measured median {self.median_error:.1%}, "
                f"max {self.max_error:.1%}")


def load_bench_rows(source) -> list[tuple[str, int, int, float]]:
    """(op, world, size bytes, seconds) from comm-bench's JSON rows: a ``Path`` or a path string to
    its JSON file, the JSON text itself (a string starting with ``[``), or the rows.

    Takes both the written rows ({"config": {"op", "size", "world_size"}, "time_us"}) and the
    flat per-size rows of ``measure`` ({"op", "size", "time_us"} plus a "world_size" key).
    """
    rows = source
    if isinstance(source, (str, os.PathLike)):
        is_text = isinstance(source, str) and source.lstrip().startswith("[")
        where = "the JSON text given" if is_text else str(source)
        try:
            rows = json.loads(source if is_text else Path(source).read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read the comm-bench rows {where}: {exc.strerror or exc}; pass the "
                              "JSON file `turbotrain comm-bench --out FILE` wrote") from exc
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where} is not JSON ({exc.msg}, line {exc.lineno}); pass the JSON file "
                              "`turbotrain comm-bench --out FILE` wrote") from exc
    if not isinstance(rows, list):
        raise ConfigError(f"comm-bench rows are a JSON list, got {type(rows).__name__}; pass the JSON "
                          "file `turbotrain comm-bench --out FILE` wrote")
    out = []
    for r in rows:
        cfg = r.get("config", r)
        world = cfg.get("world_size", r.get("world_size"))
        if "time_us" not in r or "op" not in cfg or "size" not in cfg or world is None:
            raise ConfigError(f"{r!r} is not a comm-bench row (needs op, size, world_size and time_us)")
        out.append((cfg["op"], int(world), int(cfg["size"]), float(r["time_us"]) * 1e-6))
    return out


def _weighted_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """alpha, beta >= 0 minimising sum(((alpha + beta s - t) / t)^2): relative error, so that the
    microsecond points count as much as the second-long ones."""
    sw = swx = swxx = swy = swxy = 0.0
    for s, t in points:
        w = 1 / (t * t)
        sw, swx, swxx, swy, swxy = sw + w, swx + w * s, swxx + w * s * s, swy + w * t, swxy + w * s * t
    det = sw * swxx - swx * swx
    if det > 0:
        alpha, beta = (swxx * swy - swx * swxy) / det, (sw * swxy - swx * swy) / det
        if alpha >= 0 and beta >= 0:
            return alpha, beta
    # a negative term would predict negative times somewhere: drop it, fit the other alone
    beta_only = swxy / swxx if swxx else 0.0
    alpha_only = swy / sw
    err_b = sum(((beta_only * s - t) / t) ** 2 for s, t in points)
    err_a = sum(((alpha_only - t) / t) ** 2 for s, t in points)
    return (0.0, max(beta_only, 0.0)) if err_b <= err_a else (alpha_only, 0.0)


def fit_alpha_beta(rows) -> dict[tuple[str, int], Fit]:
    """One ``Fit`` per (collective, world size) in comm-bench rows (see ``load_bench_rows``)."""
    groups: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for op, world, size, seconds in load_bench_rows(rows):
        if seconds > 0:
            groups.setdefault((op, world), []).append((float(size), seconds))
    fits = {}
    for (op, world), points in groups.items():
        if len(points) < 2:
            continue
        alpha, beta = _weighted_line(points)
        errors = [abs(alpha + beta * s - t) / t for s, t in points]
        fits[(op, world)] = Fit(op, world, alpha, beta, len(points), statistics.median(errors), max(errors))
    return fits


#: latency steps and bytes-per-byte-of-buffer of the bandwidth-optimal algorithm comm-bench times
def _steps_and_factor(op: str, n: int) -> tuple[int, float]:
    if op == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return n - 1, (n - 1) / n
    if op == "broadcast":
        return 1, 1.0
    raise ConfigError(f"no link can be read from {op!r}; fit all_reduce, all_gather, reduce_scatter or broadcast")


def link_from_fit(fit: Fit, like: Link) -> Link:
    """The per-hop latency and link bandwidth a fit implies (``like`` gives the kind and name)."""
    steps, factor = _steps_and_factor(fit.op, fit.world)
    bytes_per_s = factor / fit.beta_s_per_byte if fit.beta_s_per_byte > 0 else like.bytes_per_s
    return replace(like, name=f"fitted ({fit.op}, {fit.world} ranks)", gbps=bytes_per_s * 8 / 1e9, efficiency=1.0,
                   alpha_s=fit.alpha_s / steps)


# -- predicting a step ----------------------------------------------------------------------------
def transformer_width(params: float) -> float:
    """d of a transformer with 12 L d^2 parameters and L = d / 128 (7B -> ~4200, GPT-2 small ~1100)."""
    return (128 * params / 12) ** (1 / 3)


def exposed_seconds(comm_s: float, compute_s: float, bucket_s: float) -> float:
    """What of an overlapped exchange backward does not hide: at least the last bucket."""
    return max(comm_s - BACKWARD_SHARE * compute_s, min(bucket_s, comm_s))


def _row(ranks, topo, algorithm, compressor, sent, comm_s, exposed_s, extra_s, compute_s, note=""):
    step = compute_s + exposed_s + extra_s
    return {"ranks": ranks, "nodes": topo.nodes, "gpus_per_node": topo.gpus_per_node, "link": topo.inter.name,
            "algorithm": algorithm, "compressor": compressor, "bytes_per_rank": sent, "comm_s": comm_s,
            "exposed_s": exposed_s, "compressor_s": extra_s, "compute_s": compute_s, "step_s": step,
            "overhead": step / compute_s - 1, "note": note}


def _rows_for(params: float, topo: Topology, compute_s: float, powersgd_rank: int, ps_servers: int | None,
              grad_bytes: int, hbm: float) -> list[dict]:
    n = topo.ranks
    full = grad_bytes * params
    rows = []
    servers = ps_servers or topo.nodes
    for compressor, size in (("none", full), ("bf16", 2 * params)):
        extra = 0.0 if compressor == "none" or grad_bytes == 2 else (4 + 2) * params / hbm
        bucket = min(BUCKET_BYTES * size / full, size)
        for algorithm in ("ring", "tree", "hierarchical", "parameter_server"):
            comm = collective_time(algorithm, size, topo, servers)
            bucket_s = collective_time(algorithm, bucket, topo, servers)
            note = f"{servers} servers" if algorithm == "parameter_server" else ""
            rows.append(_row(n, topo, algorithm, compressor, size, comm, exposed_seconds(comm, compute_s, bucket_s),
                             extra, compute_s, note))
    d = transformer_width(params)
    ratio = min(1.0, 1.5 * powersgd_rank / d)
    factors = 4 * params * ratio  # fp32 factors (bf16 buckets would halve them)
    psgd_extra = 5 * 4 * params / hbm  # error add, M Q, M^T P, residual, decompress: ~5 passes
    for algorithm in ("ring", "tree", "hierarchical"):
        # P and Q: two all-reduces of about half the factors each, so twice the latency
        comm = 2 * collective_time(algorithm, factors / 2, topo)
        bucket_s = 2 * collective_time(algorithm, factors / 2 * min(1.0, BUCKET_BYTES / full), topo)
        rows.append(_row(n, topo, algorithm, f"powersgd r={powersgd_rank}", factors, comm,
                         exposed_seconds(comm, compute_s, bucket_s), psgd_extra, compute_s, f"d~{d:.0f}"))
    signs = params / 8
    comm = all_to_all(signs, topo) + all_gather(signs, topo)
    onebit_extra = 10 * 4 * params / hbm  # compensate, norms, pack, unpack x3, residuals, decode
    rows.append(_row(n, topo, "all_to_all+all_gather", "onebit", signs + signs / n, comm, comm, onebit_extra,
                     compute_s, "after warm-up; in optimizer.step, not overlapped"))
    return rows


def default_compute_s(params: float) -> float:
    """6 P FLOPs per token x 8192 tokens per GPU at 400 TFLOP/s (an H100 at ~40% of bf16 peak)."""
    return 6 * params * 8192 / 400e12


def predict(model_params: float, link: str | Link, nodes: int, gpus_per_node: int = 8,
            compute_s: float | None = None, *, ranks=None, powersgd_rank: int = 4, ps_servers: int | None = None,
            nics_per_node: int | None = None, grad_bytes: int = 4, hbm_bytes_per_s: float = HBM_BYTES_PER_S,
            fit: Fit | None = None) -> list[dict]:
    """Rows of predicted exchange and step time for every algorithm x compressor.

    The job itself (``nodes`` x ``gpus_per_node``) and each N in ``ranks`` (default 8..1024, the
    same GPUs per node). ``nics_per_node`` defaults to one per GPU on InfiniBand (rail-optimised
    HGX) and one per node on Ethernet. ``fit`` (from ``fit_alpha_beta``) replaces the network
    link's alpha and bandwidth with measured ones.
    """
    if model_params <= 0 or nodes < 1 or gpus_per_node < 1:
        raise ConfigError("predict needs model_params > 0, nodes >= 1 and gpus_per_node >= 1")
    inter = get_link(link) if isinstance(link, str) else link
    if fit is not None:
        inter = link_from_fit(fit, inter)
    nics = nics_per_node or (gpus_per_node if inter.kind == "infiniband" else 1)
    compute = compute_s if compute_s is not None else default_compute_s(model_params)
    counts = sorted({nodes * gpus_per_node, *(ranks if ranks is not None else DEFAULT_RANKS)})
    rows = []
    for n in counts:
        g = min(gpus_per_node, n)
        topo = Topology(max(1, math.ceil(n / g)), g, inter, nics_per_node=nics)
        rows += _rows_for(model_params, topo, compute, powersgd_rank, ps_servers, grad_bytes, hbm_bytes_per_s)
    return rows


# -- NCCL settings --------------------------------------------------------------------------------
def nccl_settings(topo: Topology, bucket_bytes: int = BUCKET_BYTES) -> list[tuple[str, str, str]]:
    """(variable, value, one-line reason) that this model would set for ``topo``."""
    ring = ring_allreduce(bucket_bytes, topo)
    tree = tree_allreduce(bucket_bytes, topo)
    mib = bucket_bytes / 2**20
    if tree < ring:
        algo = ("NCCL_ALGO", "Tree", f"{mib:.0f} MiB buckets: tree {tree * 1e3:.2f} ms vs ring {ring * 1e3:.2f} ms, "
                f"whose {2 * (topo.ranks - 1)} latency steps outweigh its slightly lower traffic")
    else:
        algo = ("NCCL_ALGO", "Ring", f"{mib:.0f} MiB buckets: ring {ring * 1e3:.2f} ms vs tree {tree * 1e3:.2f} ms; "
                "bandwidth-bound, and the ring's 2(N-1)/N is the lowest traffic per link")
    out = [algo]
    if topo.nodes == 1:
        out.append(("NCCL_BUFFSIZE", "4194304", "NVLink only: NCCL's 4 MiB default already pipelines well"))
        return out
    out.append(("NCCL_BUFFSIZE", "8388608", f"{topo.inter.name}: 8 MiB chunks halve the per-chunk overhead of "
                                            "large buckets (the ib/ethernet presets' value)"))
    if topo.inter.kind == "ethernet":
        streams = 2 ** math.ceil(math.log2(max(1.0, topo.inter.gbps / 12.5)))
        threads = min(streams, 4)
        socks = max(1, streams // threads)
        out.append(("NCCL_SOCKET_NTHREADS", str(threads), f"one TCP stream moves ~12.5 Gbit/s on one core; "
                                                           f"{streams} streams fill {topo.inter.gbps:g} Gbit/s"))
        out.append(("NCCL_NSOCKS_PERTHREAD", str(socks), f"{threads} threads x {socks} sockets = {streams} streams "
                                                          "(NCCL caps the product at 64)"))
    return out


# -- formatting -----------------------------------------------------------------------------------
def _seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def _bytes(b: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= size:
            return f"{b / size:.2f} {unit}"
    return f"{b:.0f} B"


def format_table(rows: list[dict]) -> str:
    """One line per row: ranks, algorithm, compressor, bytes, exchange, exposed, step, overhead.

    ``payload/rank`` is what each rank hands to the collectives (the all-reduced buffer; 1-bit
    Adam's signs), not what it sends: a ring all-reduce of S bytes sends 2(N-1)/N x S per rank,
    and the exchange time counts that."""
    head = (f"{'ranks':>6} {'algorithm':<22} {'compressor':<13} {'payload/rank':>12} {'exchange':>10} "
            f"{'exposed':>10} {'extra':>9} {'step':>10} {'overhead':>9}  note")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['ranks']:>6} {r['algorithm']:<22} {r['compressor']:<13} {_bytes(r['bytes_per_rank']):>12} "
                     f"{_seconds(r['comm_s']):>10} {_seconds(r['exposed_s']):>10} {_seconds(r['compressor_s']):>9} "
                     f"{_seconds(r['step_s']):>10} {r['overhead']:>8.1%}  {r['note']}")
    return "\n".join(lines)


def format_scaling(rows: list[dict]) -> str:
    """Comm overhead (step / compute - 1) per algorithm x compressor (rows) and rank count (columns)."""
    counts = sorted({r["ranks"] for r in rows})
    keys = list(dict.fromkeys((r["algorithm"], r["compressor"]) for r in rows))
    cell = {(r["algorithm"], r["compressor"], r["ranks"]): r["overhead"] for r in rows}
    head = f"{'algorithm':<22} {'compressor':<13}" + "".join(f"{'N=' + str(n):>9}" for n in counts)
    lines = [head, "-" * len(head)]
    for alg, comp in keys:
        lines.append(f"{alg:<22} {comp:<13}" + "".join(f"{cell[(alg, comp, n)]:>9.1%}" for n in counts))
    return "\n".join(lines)


def _plot(rows: list[dict], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError("comm-plan --plot needs matplotlib: pip install turbotrain[bench]") from exc
    fig, ax = plt.subplots(figsize=(8, 5))
    for alg, comp in dict.fromkeys((r["algorithm"], r["compressor"]) for r in rows):
        mine = sorted((r for r in rows if (r["algorithm"], r["compressor"]) == (alg, comp)), key=lambda r: r["ranks"])
        ax.plot([r["ranks"] for r in mine], [100 * r["overhead"] for r in mine], marker="o", label=f"{alg}, {comp}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks (N)")
    ax.set_ylabel("comm overhead, % of compute (model)")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_comm_plan(model_params: float, link: str, nodes: int, gpus_per_node: int = 8,
                  compute_s: float | None = None, fit_json: str | None = None, plot: str | None = None) -> str:
    """``turbotrain comm-plan``: the prediction tables, the NCCL settings, and a plot if asked."""
    inter = get_link(link)
    lines = [f"# comm-plan: {model_params:.3g} parameters, {nodes} node(s) x {gpus_per_node} GPUs over {inter.name} "
             f"(alpha-beta model; assumptions in docs/comm-plan.md)"]
    fit = None
    if fit_json:
        fits = fit_alpha_beta(fit_json)
        for f in fits.values():
            lines.append(f"# fit: {f.describe()}")
        fit = next((f for (op, _), f in sorted(fits.items()) if op == "all_reduce"), None)
        if fit is None:
            raise ConfigError(f"{fit_json} has no all_reduce rows with two or more sizes to fit a link from")
        measured = link_from_fit(fit, inter)
        lines.append(f"# network link from the all_reduce fit: {measured.alpha_s * 1e6:.1f} us per hop, "
                     f"{measured.bytes_per_s / 1e9:.3f} GB/s (replaces the preset's)")
    if compute_s is None:
        lines.append(f"# compute per step not given: {default_compute_s(model_params):.3f} s assumed "
                     "(6 P FLOPs/token x 8192 tokens/GPU at 400 TFLOP/s)")
    rows = predict(model_params, link, nodes, gpus_per_node, compute_s, fit=fit)
    job = nodes * gpus_per_node
    topo_link = link_from_fit(fit, inter) if fit is not None else inter
    nics = gpus_per_node if topo_link.kind == "infiniband" else 1
    lines.append(f"# network per node: {nics} x {topo_link.bytes_per_s * 8 / 1e9:.0f} Gbit/s effective; "
                 f"NVLink {LINKS['nvlink'].bytes_per_s / 1e9:.0f} GB/s inside a node")
    lines += ["", f"## this job: N = {job}", format_table([r for r in rows if r["ranks"] == job]),
              "", "## comm overhead (step time / compute - 1) by rank count", format_scaling(rows), "",
              "## NCCL settings for this job"]
    topo = Topology(nodes, gpus_per_node, topo_link, nics_per_node=nics)
    for var, value, reason in nccl_settings(topo):
        lines.append(f"{var}={value}    # {reason}")
    if plot:
        _plot(rows, plot, f"{model_params:.3g} params over {inter.name}, {gpus_per_node} GPUs/node")
        lines.append(f"\n# plot written to {plot}")
    return "\n".join(lines)
