"""Pruning with what is known without running a candidate, and the models that order the rest.

Rules, in order (the first that applies names the candidate's reason and axis):

1. hardware: bf16 modes where bf16 matmul is not native (no avx512_bf16/amx_bf16 flag on a CPU,
   compute capability < 8.0 on a GPU) or measures slower than fp32; fp16 modes on any CPU;
   fp16 on a GPU below capability 7.0.
2. the model: a fusion pattern with no site in it (found by probing one batch), "every pattern"
   when it fuses no more than a single pattern does, checkpointing without a block list, a
   checkpoint_every that picks the same blocks as a smaller one of an otherwise equal candidate
   (every N >= the block count checkpoints block 0 only).
3. the batch: an accumulation count that does not divide the batch's rows.
4. memory: the estimate below above ``max_memory``.

The data-parallel axes (compression x bucket size) are pruned by their own rules, priced by the
alpha-beta exchange model, in dp_prune.py.

The memory estimate and the ordering model are stated in MEMORY_MODEL and ORDERING_MODEL, which
every report prints.
"""

from __future__ import annotations

from ..config import FUSION_PATTERNS
from ..hardware import HardwareInfo, cuda_bf16_native, native_bf16_feature
from .facts import ModelFacts
from .space import Candidate, fusion_label

__all__ = ["hardware_reasons", "prune", "estimate_memory", "predict_seconds", "order", "checkpointed_share",
           "MEMORY_MODEL", "ORDERING_MODEL", "COMPILE_TRAFFIC", "CALL_OVERHEAD_S", "SELECTIVE_SHARE"]

MEMORY_MODEL = (
    'Memory estimate (bytes, per process): parameter state + activations. State per parameter: fp32 '
    'weights 4 + grads 4 + AdamW moments 8; autocast modes add a 2-byte cast copy of each weight; master '
    'modes hold 2-byte weights and grads plus 4-byte masters and master grads and the 8 of AdamW. '
    'Activations: the bytes autograd saved for backward in the FP32 analysis pass, scaled to the '
    'micro-batch, halved in bf16/fp16 (the FP32 keep-list is ignored); block checkpointing keeps the saved '
    "bytes outside the blocks, each block's input and one block's internals; selective is taken as "
    'halfway between none and blocks; checkpoint_every=N on B blocks checkpoints ceil(B/N) of them '
    '(blocks 0, N, 2N, ...), and its saving (the step from none to blocks, or to selective) is scaled by '
    'that share, ceil(B/N)/B; fused linear+cross-entropy removes one logits-sized tensor (the '
    'log-softmax cross-entropy saves). Compiled graphs and allocator caching are not modelled, which is why '
    'candidates are also measured.'
)
ORDERING_MODEL = (
    'Ordering model (seconds per optimizer step; it decides which candidates are measured first, it is '
    "never reported as a speed): matmul FLOPs / the measured matmul peak of the candidate's dtype, plus "
    'the bytes other ops move / the measured copy bandwidth. Low precision halves those bytes; compiling '
    'is assumed to halve them again (Inductor fuses elementwise chains; an assumption, not a '
    'measurement); fused linear+cross-entropy removes six logits-sized passes; block checkpointing adds '
    'one forward of the blocks (a third of the FLOPs and bytes), selective half of that, either scaled by '
    'the share of blocks checkpointed (ceil(B/N)/B with checkpoint_every=N); every micro-batch '
    'pays the dispatch of its ATen calls (counted in the analysis pass, at an assumed CALL_OVERHEAD_S each).'
)
#: Share of other ops' bytes a compiled graph still moves: an assumption of the ordering model only.
COMPILE_TRAFFIC = 0.5
#: Host cost assumed per ATen call of a micro-batch (dispatch, launch): an assumption of the ordering
#: model only, which is what separates accumulation counts that move the same FLOPs and bytes.
CALL_OVERHEAD_S = 5e-6
#: Share of the block recompute that selective checkpointing is taken to cost (and to save in memory).
SELECTIVE_SHARE = 0.5
_LOW = {"bf16": 2, "fp16": 2, "fp32": 4}


def _dtype(precision: str) -> str:
    return precision.split("-")[0]


def hardware_reasons(info: HardwareInfo, peaks: dict | None = None) -> dict[str, str]:
    """{'bf16': reason, 'fp16': reason} for the low-precision dtypes that cannot pay off on ``info``.

    ``peaks`` ({dtype: FLOP/s}, measured) adds a dtype whose matmul measures slower than fp32's.
    """
    out = {}
    if info.device == "cuda":
        major, minor = info.cuda_capability or (0, 0)
        if not cuda_bf16_native():
            out["bf16"] = (f"bf16 is not native on this GPU (compute capability {major}.{minor} < 8.0): torch "
                           "emulates it, slower than fp16")
        if major < 7:
            out["fp16"] = f"compute capability {major}.{minor} has no fp16 tensor cores"
    else:
        if native_bf16_feature(info) is None:
            flags = ", ".join(info.cpu_features) or "none"
            out["bf16"] = ("bf16 is emulated on this CPU: no avx512_bf16/amx_bf16 flag (found: " + flags + "), so "
                           "torch runs bf16 matmuls in software, tens of times slower than fp32")
        out["fp16"] = ("fp16 on a CPU: torch has no native CPU fp16 matmul for training but AMX-FP16, and the "
                       "fp16 modes add loss scaling; where the CPU has native low precision it is bf16, which "
                       "needs no scaler")
    for dtype, value in (peaks or {}).items():
        fp32 = (peaks or {}).get("fp32")
        if dtype != "fp32" and dtype not in out and fp32 and 0 < value < fp32:
            out[dtype] = (f"{dtype} matmul measures {value / 1e9:.1f} GFLOP/s here against fp32's {fp32 / 1e9:.1f} "
                          f"({fp32 / value:.1f}x slower)")
    return out


def checkpointed_share(c: Candidate, facts: ModelFacts) -> float:
    """Share of the model's blocks ``c`` checkpoints: ceil(B / every) of B (blocks 0, every, 2 every,
    ..., as memory/checkpoint.py picks them); 0 without checkpointing or without a block list."""
    if not c.checkpoint or not facts.block_count:
        return 0.0
    return len(range(0, facts.block_count, c.checkpoint_every)) / facts.block_count


def _mode_share(c: Candidate) -> float:
    """What a checkpointed block saves (and recomputes) in ``c``'s mode, against whole-block checkpointing."""
    return 1.0 if c.checkpoint == "blocks" else SELECTIVE_SHARE


def estimate_memory(c: Candidate, facts: ModelFacts) -> dict:
    """{'state_bytes', 'activation_bytes', 'total_bytes'} of ``c`` (see MEMORY_MODEL)."""
    p = facts.params
    dtype = _dtype(c.precision)
    if dtype == "fp32":
        state = 16 * p
    elif c.precision.endswith("-mixed"):
        state = 18 * p
    else:
        state = (2 + 2 + 4 + 4 + 8) * p
    scale = c.micro_batch / facts.batch_rows
    act = facts.activation_bytes
    outside = act - facts.block_saved_bytes
    if share := checkpointed_share(c, facts):
        blocks = outside + facts.block_input_bytes + facts.max_block_saved_bytes
        act = act - _mode_share(c) * share * (act - blocks)
    if "linear_cross_entropy" in c.fusion:
        act = max(act - facts.logits_bytes, 0)
    act = act * scale * (_LOW[dtype] / 4)
    return {"state_bytes": int(state), "activation_bytes": int(act), "total_bytes": int(state + act)}


def predict_seconds(c: Candidate, facts: ModelFacts, peaks: dict, bandwidth: float) -> float:
    """The ordering model's seconds per optimizer step of ``c`` (see ORDERING_MODEL)."""
    dtype = _dtype(c.precision)
    recompute = (1 / 3) * _mode_share(c) * checkpointed_share(c, facts) if c.checkpoint else 0.0
    moved = facts.other_bytes * (_LOW[dtype] / 4)
    if "linear_cross_entropy" in c.fusion:
        moved = max(moved - 6 * facts.logits_bytes * (_LOW[dtype] / 4), 0.0)
    if c.compile != "none":
        moved *= COMPILE_TRAFFIC
    peak = peaks.get(dtype) or peaks["fp32"]
    dispatch = facts.calls * c.accumulate * CALL_OVERHEAD_S
    return (facts.matmul_flops / peak + moved / bandwidth) * (1 + recompute) + dispatch


def _prune(c: Candidate, axis: str, reason: str) -> None:
    c.status, c.pruned_axis, c.reason = "pruned", axis, reason


def _same_blocks(candidates: list[Candidate], facts: ModelFacts) -> dict[int, str]:
    """{id(candidate): reason} for each checkpoint_every that picks the same blocks as a smaller one
    of an otherwise equal candidate (with B blocks, every N >= B checkpoints block 0 only); the
    smallest stands for them."""
    count = facts.block_count
    if not count:  # no block list: rule 2 prunes every checkpointing candidate on that already
        return {}
    kept: dict[tuple, Candidate] = {}
    out = {}
    for c in sorted((c for c in candidates if c.checkpoint), key=lambda c: c.checkpoint_every):
        picked = tuple(range(0, count, c.checkpoint_every))
        key = (c.precision, tuple(c.fusion), c.compile, c.checkpoint, c.accumulate, c.data_parallel, c.compression,
               c.bucket_mb, picked)
        first = kept.setdefault(key, c)
        if first is not c:
            which = "block 0 only" if len(picked) == 1 else "blocks " + ", ".join(map(str, picked))
            out[id(c)] = (f"the model has {count} block{'s' * (count != 1)}, so checkpoint_every={c.checkpoint_every} "
                          f"checkpoints {which}, as checkpoint_every={first.checkpoint_every} does; that candidate "
                          "stands for it")
    return out


def _structure_reason(c: Candidate, facts: ModelFacts, same_blocks: dict[int, str]) -> tuple[str, str] | None:
    found = [p for p in FUSION_PATTERNS if facts.sites.get(p)]
    missing = [p for p in c.fusion if not facts.sites.get(p)]
    if c.fusion and set(c.fusion) == set(FUSION_PATTERNS) and len(found) <= 1:
        return "fusion", (f"'all' fuses only {fusion_label(tuple(found))} in this model, the same as that pattern "
                          "alone" if found else "no fusion pattern finds a site in this model")
    if missing and len(c.fusion) == 1:
        p = missing[0]
        why = facts.site_problems.get(p)
        return "fusion", f"no fusable {p} site in this model" + (f" ({why})" if why else " (found by probing one batch)")
    if c.checkpoint and facts.block_problem:
        return "checkpoint", facts.block_problem
    if id(c) in same_blocks:
        return "checkpoint", same_blocks[id(c)]
    if facts.batch_rows % c.accumulate:
        return "accumulate", (f"a batch of {facts.batch_rows} rows does not split into {c.accumulate} equal "
                              "micro-batches")
    return None


def prune(candidates: list[Candidate], facts: ModelFacts, info: HardwareInfo, *, peaks: dict | None = None,
          max_memory: int | None = None) -> list[Candidate]:
    """Mark each candidate 'pruned' with its axis and reason, or leave it a candidate; fill its
    memory estimate. The baseline is never pruned (every ratio and loss check needs it). Returns
    the candidates that are left."""
    low = hardware_reasons(info, peaks)
    same_blocks = _same_blocks(candidates, facts)
    for c in candidates:
        if c.accumulate <= facts.batch_rows:
            c.estimates.update(estimate_memory(c, facts))
        if c.is_baseline:
            continue
        dtype = _dtype(c.precision)
        if dtype in low:
            _prune(c, "precision", low[dtype])
        elif found := _structure_reason(c, facts, same_blocks):
            _prune(c, *found)
        elif max_memory is not None and c.estimates["total_bytes"] > max_memory:
            _prune(c, "memory", f"estimated {c.estimates['total_bytes'] / 2**20:.0f} MiB "
                                f"(state {c.estimates['state_bytes'] / 2**20:.0f}, activations "
                                f"{c.estimates['activation_bytes'] / 2**20:.0f}) > max_memory "
                                f"{max_memory / 2**20:.0f} MiB")
    return [c for c in candidates if c.status == "candidate"]


def order(candidates: list[Candidate], facts: ModelFacts, peaks: dict, bandwidth: float) -> list[Candidate]:
    """The survivors, baseline first, then by the ordering model's seconds; ties go to the candidate
    with fewer micro-batches, then fewer transforms (the simpler recipe is measured first)."""
    for c in candidates:
        c.estimates["predicted_seconds"] = predict_seconds(c, facts, peaks, bandwidth)

    def key(c: Candidate):
        transforms = len(c.fusion) + (c.compile != "none") + (c.checkpoint is not None)
        return (not c.is_baseline, round(c.estimates["predicted_seconds"], 9), c.accumulate, transforms)

    return sorted(candidates, key=key)
