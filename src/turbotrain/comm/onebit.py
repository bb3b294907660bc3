"""1-bit Adam (Tang et al., 2021): Adam whose traffic after warm-up is 1-bit momentum.

Warm-up: plain Adam on gradients that DDP all-reduces as usual. Adam's variance settles early and
changes little afterwards, so at the end of warm-up it is frozen; from then on the update is
linear in the momentum, and averaging momentum across ranks is what averaging gradients did.
For the compressed tensors DDP's all-reduce is switched off, each rank folds its *local*
gradient into the shared momentum, and the momenta are averaged with error-compensated sign
compression (the paper's Algorithm 1):

* worker side: x_i = m_i + e_i is sent as sign(x_i) times one scale per tensor,
  ||x||_2 / sqrt(numel) (it keeps the tensor's norm); e_i keeps what the signs lost;
* server side: rank j owns chunk j of the flat buffer of compressed tensors; it averages the n
  decompressed chunks it got (one all_to_all), adds its own error, compresses again with one
  scale per tensor piece in its chunk, and every rank gathers the compressed chunks (one
  all_gather). A scale never spans two tensors: a shared scale over ~35 tensors of different
  magnitudes is what cost the earlier chunk-scale design 4% of loss.

What is not compressed, and why:

* tensors below ``min_compress_numel`` elements or with fewer than 2 dims (biases, norms): the
  bytes they would save are noise, and their gradients are the least sign-friendly. Their
  gradients keep being all-reduced exactly (in their own dtype) by the DDP hook and they keep
  running plain Adam, variance included;
* elements whose variance is exactly 0 at the freeze (embedding rows no warm-up batch touched):
  a frozen v = 0 would turn the first compressed momentum (every element gets +-scale) into an
  update of scale / eps ~ 1e4 x lr. They stay on **plain Adam from exact gradients**: step()
  averages exactly those elements' gradients, their momentum and variance follow Adam, and the
  compressed exchange treats them as absent (zero in the buffers, outside every scale). The
  mask is fixed at the freeze. Most masked elements are rows of tokens that no rank sees in a
  given step either, whose gradient is exactly 0, so each rank sends only its blocks of 32
  masked values that hold a nonzero, with a block id (4 bytes per 128), by one all_gather;
  when more are touched than that saves, one fp32 all_reduce of them all (4 bytes each).

Steps after the freeze are clipped, element by element, at the largest step Adam itself could
take with the same betas (``adam_step_bound``: |m_hat| / sqrt(v_hat) <= (1 - b1) /
sqrt((1 - b2)(1 - b1^2 / b2)) by Cauchy-Schwarz, 7.27 for (0.9, 0.999)). A frozen v cannot grow
with a gradient that grows, so an element whose v was small at the freeze (a token seen once in
warm-up, an lm_head row whose probability later rises) is otherwise stepped by g / sqrt(v_small)
every step and drifts without bound: on the 2-layer gpt the run went from val 5.6 to 19 without
the clip, and stayed within 1% of AdamW with it. The clip only cuts steps larger than any Adam
could take, so it leaves alone every element whose frozen variance is still a fair one.

Bytes: after warm-up a rank hands its collectives (N/8 + N/(8n)) bytes of signs plus a few
scales for N compressed elements (n ranks), against 4N for an fp32 all-reduce: 1/32 + 1/(32n)
of it, e.g. 1/21 at n = 2 and -> 1/32 as n grows, plus the exact tensors and the masked blocks a
step touched. ``HookState.bytes_sent`` counts it from the tensors actually passed.

Warm-up, chosen the way the paper does: uncompressed Adam until its variance is stable, then
freeze. Tang et al. warm up for about 15-25% of the steps in BERT pre-training (the variance has
to be measured on enough data to be worth freezing). ``warmup_for(total_steps)`` is that rule of
thumb, max(100, 20% of the steps); without ``total_steps`` the default is 1000 steps. The
fraction is not enough on its own: from random weights the gradients shrink ~10x over the first
hundred steps, and a variance frozen then under-steps everything after (the 300-step slow test
warms up for 60 steps, 20%, after 200 AdamW steps). The DP ladder's rows are short timing runs
whose warm-up (stated in turbotrain.bench.dp_ladder) is far below this: their val loss says what
compression does to early training, not whether 1-bit Adam converges.

Host work per step is a fixed number of passes over the flat buffers plus one small op per
tensor: the layout (segments, scales slots, masks) is computed once at the freeze, signs are
packed straight from a comparison with 0 (one multiply per 8 signs) and unpacked with one table
look-up, scales are applied per tensor slice, never gathered per element (the decode looks bytes
up in a table already scaled), the errors' masked positions are zeroed once per step instead of
after every use, and masked elements are handled as whole rows wherever the mask holds whole
rows (``_Masked``). Send and receive buffers are allocated once per layout.

Two things cut what the exchange adds to a step on CPU hosts, where it is memory-bound work on
the training thread:

* the exchange is pipelined over up to ``PIPELINE_PARTS`` parts (column ranges of every server
  chunk): a part's all_to_all starts as soon as its signs are packed, the worker error and the
  server's average run while later parts travel, and so do the all_gathers and the decode. The
  parts together carry exactly the unsplit exchange's bytes and every element sees the same
  operations, so the result is bitwise the same; only the number of collectives grows.
* on layouts of ``COMPILE_MIN_NUMEL`` elements or more, the elementwise steps that eager torch
  runs as 2-4 passes each run as torch.compile'd single loops (dynamic sizes, compiled once, on
  the first compressed step): momentum plus its add into the worker error, the sign packing, the
  residual x - scale * sign(x) straight from x (no unpacking), and the clipped frozen update with
  the weight decay. The packing and residuals are bitwise the eager ones; the momentum kernel
  rounds b1 m + (1 - b1) g as the paper writes it (twice) where eager ``add_(g, alpha)`` fuses the
  multiply-add, so an element whose m + e sits within an ulp of 0 can send the other sign.
  Without a working compiler the kernels fall back to the eager steps, with one warning.

>>> import torch
>>> w = torch.nn.Parameter(torch.ones(3))
>>> opt = OneBitAdam([w], lr=0.1, warmup_steps=2)
>>> w.grad = torch.ones(3); opt.step(); opt.compressing
False
"""

# No `from __future__ import annotations`: DDP reads a comm hook's return annotation at run time.

import logging
import math
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import ConfigError
from .collectives import all_gather_flat
from .hooks import HookState, allreduce_hook, noop_hook

__all__ = ["OneBitAdam", "OneBitCompressor", "onebit_hook", "pack_signs", "unpack_signs", "warmup_for",
           "adam_step_bound", "DEFAULT_WARMUP_STEPS", "MIN_COMPRESS_NUMEL"]

logger = logging.getLogger(__name__)
logger.addHandler(logging.NullHandler())

#: Warm-up when neither ``warmup_steps`` nor ``total_steps`` is given.
DEFAULT_WARMUP_STEPS = 1000
#: Tensors smaller than this go exact: 4096 fp32 values are 16 KiB, below a collective's latency.
MIN_COMPRESS_NUMEL = 4096
_ALIGN = 32  # elements per server chunk are a multiple of 32: whole bytes of signs, 4-byte aligned scales
#: The exchange is cut into up to this many parts (columns of every server chunk), pipelined: a
#: part's signs travel while the next part is packed, and the server averages a part while the
#: later ones travel (gloo and NCCL run async collectives off the calling thread).
PIPELINE_PARTS = 4
#: Fewest elements per server chunk in a part: below it a part's collective is latency, not bytes.
MIN_PART_NUMEL = 1 << 18
#: byte value -> its 8 signs as +-1 (bit i set = element i is >= 0), for one-look-up unpacking
_SIGN_TABLE = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).float() * 2 - 1
#: v * this moves bit 8i of v (the low bit of byte i) to bit 56 + i, for i = 0..7
_GATHER_BYTE_BITS = 0x0102040810204080


def adam_step_bound(betas) -> float:
    """The most |m_hat / sqrt(v_hat)| can be in Adam (large t, eps ignored); inf when b1^2 >= b2."""
    b1, b2 = betas
    if b1 * b1 >= b2:
        return math.inf
    return (1 - b1) / math.sqrt((1 - b2) * (1 - b1 * b1 / b2))


def warmup_for(total_steps: int, fraction: float = 0.2, minimum: int = 100) -> int:
    """The paper's rule of thumb: warm up for ~15-25% of training (here 20%), and never under 100 steps."""
    return max(minimum, math.ceil(fraction * total_steps))


def pack_signs(x: torch.Tensor, out: torch.Tensor | None = None, bits: torch.Tensor | None = None,
               scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Eight signs per byte, element i of each 8 in bit i (set where x >= 0); ``x.numel() % 8 == 0``.

    Packed straight from the comparison with 0, no +-1 tensor made: the 8 comparison bytes of a
    group (0 or 1 each) are read as one little-endian int64 v, and v * 0x0102040810204080 carries
    byte i's bit to bit 56 + i with no other term reaching bits 56-63 (the 64 partial products
    land on distinct bits, so nothing carries), so one multiply and one shift pack the byte.
    ``x``: 1-D, or a (rows, cols) view with cols % 8 == 0 (e.g. the same columns of every server
    chunk), read in place; ``out``: uint8 holding x.numel() / 8 bytes, of any shape (e.g. the
    sign columns of a send buffer); ``bits``: a reusable bool buffer of at least x's size;
    ``scratch``: a reusable int64 buffer of at least x.numel() / 8 elements.
    """
    if x.dim() != 2:
        x = x.reshape(-1)
    n = x.numel()
    bits = torch.ge(x, 0, out=bits.view(-1)[:n].view(x.shape) if bits is not None else None)
    v = bits.view(torch.uint8).view(torch.int64)
    folded = torch.mul(v, _GATHER_BYTE_BITS,
                       out=scratch.view(-1)[:n // 8].view(v.shape) if scratch is not None else None)
    folded.bitwise_right_shift_(56).bitwise_and_(0xFF)  # the shift is arithmetic: drop the sign's copies
    if out is None:
        return folded.view(-1).to(torch.uint8)
    out.copy_(folded.view(out.shape))
    return out


_TABLES: dict = {}


def _sign_table(device, dtype) -> torch.Tensor:
    """The sign table on ``device`` (copied there once, not once per step)."""
    key = (str(device), dtype)
    if key not in _TABLES:
        _TABLES[key] = _SIGN_TABLE.to(device, dtype)
    return _TABLES[key]


def unpack_signs(packed: torch.Tensor, dtype=torch.float32, out: torch.Tensor | None = None,
                 index: torch.Tensor | None = None) -> torch.Tensor:
    """+1/-1 per bit of ``pack_signs``' output, by one table look-up per byte (into ``out`` if given;
    ``index``: a reusable int32 buffer of at least ``packed.numel()`` elements)."""
    table = _sign_table(packed.device, dtype)
    if index is None:
        index = packed.reshape(-1).to(torch.int32)
    else:
        index = index[:packed.numel()]
        index.view(packed.shape).copy_(packed)
    if out is None:
        return torch.index_select(table, 0, index).view(-1)
    torch.index_select(table, 0, index, out=out.view(-1, 8))
    return out.view(-1)


@dataclass
class _Layout:
    """Where every tensor, scale slot and masked element sits; built once per freeze."""

    sizes: list
    tensors: list
    """(start, end) of every tensor in the flat buffer."""
    total: int
    chunk: int
    sign_bytes: int
    slots: int
    """Scale slots per server chunk (the most tensor pieces any chunk holds)."""
    inv_sqrt_counts: torch.Tensor
    """Per tensor: 1/sqrt(unmasked elements), 0 for a tensor that is all masked."""
    slot_tensor: torch.Tensor
    """(n, slots): the tensor whose worker scale fills each slot; ``len(sizes)`` (a zero) pads."""
    segments: list
    """(server, slot, start, end) in global positions: every tensor piece of every chunk."""
    my_segments: list
    """(start, end) local to this rank's chunk."""
    my_inv_sqrt_counts: torch.Tensor
    mask: torch.Tensor | None
    """Global positions kept out of the compression, or None."""
    my_mask: torch.Tensor | None
    parts: list
    """The pipeline's stages (``_Part``): column ranges of every server chunk, sent one after another."""

    @property
    def row_bytes(self) -> int:
        return self.sign_bytes + 4 * self.slots


@dataclass
class _Part:
    """Columns [lo, hi) of every server chunk: one all_to_all and one all_gather of the pipeline.

    The first part's rows also carry the scale slots, so the parts together send exactly the
    bytes of one unsplit exchange. Pieces are the layout's tensor pieces cut at the part's columns.
    """

    lo: int
    hi: int
    worker: list
    """(server j, tensor k, start, end) in global positions: worker pieces in these columns."""
    server: list
    """(slot s, start, end) local to this rank's chunk."""
    decode: list
    """(server j, slot s, start, end) in global positions."""

    @property
    def sign_bytes(self) -> int:
        return (self.hi - self.lo) // 8


def _cut(pieces, lo: int, hi: int):
    """The parts of (..., a, b) pieces inside [lo, hi), keeping the leading fields."""
    return [(*rest, max(a, lo), min(b, hi)) for *rest, a, b in pieces if max(a, lo) < min(b, hi)]


def _build_parts(chunk: int, count: int, world: int, tensors, segments, my_segments) -> list:
    """``count`` column ranges of a chunk (multiples of _ALIGN, so every part's sign bytes keep the
    scale slots 4-byte aligned) with their pieces."""
    step = max(_ALIGN, math.ceil(chunk / (count * _ALIGN)) * _ALIGN)
    parts = []
    for lo in range(0, chunk, step):
        hi = min(lo + step, chunk)
        worker = [(j, *piece) for j in range(world)
                  for piece in _cut([(k, a, b) for k, (a, b) in enumerate(tensors)], j * chunk + lo, j * chunk + hi)]
        decode = [piece for j in range(world) for piece in _cut([sg for sg in segments if sg[0] == j],
                                                                j * chunk + lo, j * chunk + hi)]
        server = _cut([(s, a, b) for s, (a, b) in enumerate(my_segments)], lo, hi)
        parts.append(_Part(lo, hi, worker, server, decode))
    return parts


def _build_layout(sizes: list[int], mask: torch.Tensor | None, world: int, rank: int, device,
                  parts: int | None = None) -> _Layout:
    total = sum(sizes)
    chunk = max(_ALIGN, math.ceil(total / (world * _ALIGN)) * _ALIGN)
    if parts is None:
        parts = max(1, min(PIPELINE_PARTS, chunk // MIN_PART_NUMEL))
    starts = [0]
    for s in sizes:
        starts.append(starts[-1] + s)
    mask_sorted = torch.sort(mask.cpu()).values if mask is not None and mask.numel() else None

    def masked_in(a: int, b: int) -> int:
        if mask_sorted is None:
            return 0
        lo, hi = torch.searchsorted(mask_sorted, torch.tensor([a, b])).tolist()
        return hi - lo

    def inv_sqrt(count: int) -> float:
        return 1.0 / math.sqrt(count) if count > 0 else 0.0

    inv_counts = [inv_sqrt(s - masked_in(starts[k], starts[k + 1])) for k, s in enumerate(sizes)]
    per_server, k = [], 0
    for j in range(world):
        lo, hi = j * chunk, min((j + 1) * chunk, total)
        pieces = []
        while k < len(sizes) and lo < hi:
            a, b = max(lo, starts[k]), min(hi, starts[k + 1])
            if a < b:
                pieces.append((k, a, b))
            if starts[k + 1] <= hi:
                k += 1
            else:
                break
        per_server.append(pieces)
    slots = max(1, max(len(p) for p in per_server))
    slot_tensor = torch.full((world, slots), len(sizes), dtype=torch.long)
    segments = []
    for j, pieces in enumerate(per_server):
        for s, (k_, a, b) in enumerate(pieces):
            slot_tensor[j, s] = k_
            segments.append((j, s, a, b))
    mine = per_server[rank]
    base = rank * chunk
    my_mask = None
    if mask_sorted is not None:
        local = mask_sorted[(mask_sorted >= base) & (mask_sorted < base + chunk)] - base
        my_mask = local.to(device) if local.numel() else None
    tensors = [(starts[k], starts[k + 1]) for k in range(len(sizes))]
    my_segments = [(a - base, b - base) for _, a, b in mine]
    return _Layout(
        sizes=list(sizes), tensors=tensors, total=total,
        chunk=chunk, sign_bytes=chunk // 8, slots=slots,
        inv_sqrt_counts=torch.tensor(inv_counts + [0.0], device=device),
        slot_tensor=slot_tensor.to(device), segments=segments,
        my_segments=my_segments,
        my_inv_sqrt_counts=torch.tensor([inv_sqrt((b - a) - masked_in(a, b)) for _, a, b in mine] or [0.0],
                                        device=device),
        mask=mask_sorted.to(device) if mask_sorted is not None else None, my_mask=my_mask,
        parts=_build_parts(chunk, parts, world, tensors, segments, my_segments))


def _piece_scales(x: torch.Tensor, pieces, inv_sqrt_counts: torch.Tensor) -> torch.Tensor:
    """||x_piece|| / sqrt(count) per piece (masked elements are zero in x and outside count)."""
    norms = torch._foreach_norm([x[a:b] for a, b in pieces])
    return torch.stack(norms).mul_(inv_sqrt_counts[:len(pieces)])


class OneBitCompressor:
    """Error-compensated 1-bit mean of one flat fp32 buffer over the group (worker and server errors)."""

    def __init__(self, group=None, parts: int | None = None, compile_kernels: bool | None = None):
        if parts is not None and (isinstance(parts, bool) or not isinstance(parts, int) or parts < 1):
            raise ConfigError(f"OneBitCompressor parts={parts!r} must be an integer >= 1 (or None: by size)")
        self.parts = parts
        """Pipeline parts of the exchange; None: up to PIPELINE_PARTS, none under MIN_PART_NUMEL columns."""
        self.compile_kernels = compile_kernels
        """Run the elementwise steps through torch.compile; None: for layouts of COMPILE_MIN_NUMEL or more."""
        self._compiled = False
        self.worker_error: torch.Tensor | None = None
        self.server_error: torch.Tensor | None = None
        self.hook_state: HookState | None = None
        """A HookState whose ``calls``/``bytes_sent`` this exchange bumps too (set by comm.prepare)."""
        self.calls = 0
        self.bytes_sent = 0
        """Payload bytes handed to the two collectives (the send buffer of the all_to_all, this rank's
        part of the all_gather); 0 in one process, where nothing is sent."""
        self._layout: _Layout | None = None
        self._key = None
        self._signs = self._bits = self._fold = self._index = None
        self._wire: dict = {}
        self.bind(group)

    def bind(self, group=None) -> None:
        """Use ``group`` (the default group when None; a single process when none is running)."""
        self.group = group
        running = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(group) if running else 1
        self.rank = dist.get_rank(group) if running else 0
        self._layout, self._key = None, None

    @property
    def configured(self) -> bool:
        """False after ``bind`` or a load: the next ``configure`` lays the buffers out again."""
        return self._layout is not None

    def configure(self, sizes: list[int], mask: torch.Tensor | None, device) -> int:
        """Lay out tensors of ``sizes`` (``mask``: global positions to leave out); returns the padded
        length the buffers passed to ``allreduce_`` must have. Cached: same arguments, no work."""
        key = (tuple(sizes), None if mask is None else (mask.data_ptr(), mask.numel()), self.world, self.rank,
               str(device), self.parts)
        if self._key == key:
            return self._layout.chunk * self.world
        self._layout = _build_layout(list(sizes), mask, self.world, self.rank, device, self.parts)
        self._key = key
        self._compiled = (self.compile_kernels if self.compile_kernels is not None
                          else self._layout.total >= COMPILE_MIN_NUMEL) and not _COMPILE_FAILED
        if self._compiled:
            logger.info("1-bit Adam: %d compressed elements; residuals and the frozen update run as "
                        "torch.compile'd kernels (compiled on the first compressed step)", self._layout.total)
        padded, chunk = self._layout.chunk * self.world, self._layout.chunk
        if self.worker_error is None or self.worker_error.numel() != padded:
            if self.worker_error is not None:
                logger.warning("1-bit Adam: error buffers do not fit this layout (world size changed?); reset")
            self.worker_error = torch.zeros(padded, device=device)
            self.server_error = torch.zeros(chunk, device=device)
        self.worker_error = self.worker_error.to(device)
        self.server_error = self.server_error.to(device)
        # reused every step: on CPU a fresh 4N-byte tensor per step costs its page faults
        self._signs = torch.empty(padded, device=device)
        self._bits = torch.empty(padded, dtype=torch.bool, device=device)
        self._fold = torch.empty(padded // 8, dtype=torch.int64, device=device)
        self._index = torch.empty(padded // 8, dtype=torch.int32, device=device)
        self._wire = self._wire_buffers(device)
        return padded

    def _wire_buffers(self, device) -> dict:
        """Per part: the all_to_all's send and receive rows (n, part bytes) and the all_gather's reply
        row and gathered rows; part 0's rows end in the scale slots. Allocated once per layout."""
        lay, n = self._layout, self.world
        widths = [p.sign_bytes + (4 * lay.slots if i == 0 else 0) for i, p in enumerate(lay.parts)]

        def rows(count):
            flat = torch.zeros(count * sum(widths), dtype=torch.uint8, device=device)
            out, at = [], 0
            for w in widths:
                out.append(flat[at:at + count * w].view(count, w))
                at += count * w
            return out

        sends = rows(n)
        replies = [r.view(-1) for r in rows(1)]
        one = n == 1  # one process: nothing travels, what is received is what was sent
        return {"send": sends, "recv": sends if one else rows(n), "reply": replies,
                "gathered": [r.view(1, -1) for r in replies] if one else rows(n)}

    def allreduce_(self, buf: torch.Tensor, compensated: bool = False) -> torch.Tensor:
        """In place: ``buf[:total]`` (this rank's values) becomes the compressed mean, identical on
        every rank. Masked positions and the padding hold nothing of use: the caller puts its exact
        values back (``exchange`` zeroes them). The errors' masked positions are don't-cares too:
        each is zeroed after the add that would read it, so no pass resets them after use.

        Pipelined over the layout's parts: every part's all_to_all is started as soon as its signs
        are packed, the worker error is updated while they travel, the server averages part k as
        soon as it has arrived, and the decode of part k runs while the later all_gathers travel.
        Every element sees the same operations as in one unsplit exchange, so parts change no bit.
        ``compensated``: the caller has already added ``buf`` into the worker error (``momentum_``)."""
        lay, wire = self._layout, self._wire
        n, c = self.world, lay.chunk
        first = lay.parts[0]
        # Worker: compensate, one scale per tensor, keep the residual as the next error.
        w = self.worker_error
        if not compensated:
            w[:lay.total].add_(buf[:lay.total])
        if lay.mask is not None:
            w.index_fill_(0, lay.mask, 0.0)
        scales = _piece_scales(w, lay.tensors, lay.inv_sqrt_counts)
        wire["send"][0][:, first.sign_bytes:].view(torch.float32).copy_(
            torch.cat([scales, scales.new_zeros(1)])[lay.slot_tensor])
        rows = w.view(n, c)
        sent = []
        for part, send, recv in zip(lay.parts, wire["send"], wire["recv"]):
            self._pack(rows[:, part.lo:part.hi], send[:, :part.sign_bytes])
            sent.append(self._all_to_all(send, recv, async_op=True))
        for part, send in zip(lay.parts, wire["send"]):
            signs = None
            for j, k, a, b in part.worker:
                if self.kernel(_sub_sign, w[a:b], scales[k]):
                    continue
                if signs is None:
                    signs = self._unpacked(send[:, :part.sign_bytes])
                at = a - j * c - part.lo
                w[a:b].addcmul_(signs[j, at:at + b - a], scales[k], value=-1.0)

        # Server for chunk `rank`: average the n decompressed chunks, compensate, compress again.
        z = self.server_error
        for part, recv, work in zip(lay.parts, wire["recv"], sent):
            _wait(work)
            signs = self._unpacked(recv[:, :part.sign_bytes])
            worker_scales = wire["recv"][0][:, first.sign_bytes:].view(torch.float32)
            for s, a, b in part.server:
                z[a:b].addmv_(signs[:, a - part.lo:b - part.lo].t(), worker_scales[:, s], alpha=1.0 / n)
        if lay.my_mask is not None:
            z.index_fill_(0, lay.my_mask, 0.0)
        server_scales = None
        if lay.my_segments:
            server_scales = _piece_scales(z, lay.my_segments, lay.my_inv_sqrt_counts)
            wire["reply"][0][first.sign_bytes:first.sign_bytes + 4 * len(lay.my_segments)].view(
                torch.float32).copy_(server_scales)
        gathered = []
        for part, reply, out in zip(lay.parts, wire["reply"], wire["gathered"]):
            self._pack(z[part.lo:part.hi].view(1, -1), reply[:part.sign_bytes].view(1, -1))
            gathered.append(self._all_gather(reply, out.view(-1), async_op=True))
        if server_scales is not None:
            for part, reply in zip(lay.parts, wire["reply"]):
                signs = None
                for s, a, b in part.server:
                    if self.kernel(_sub_sign, z[a:b], server_scales[s]):
                        continue
                    if signs is None:
                        signs = self._unpacked(reply[:part.sign_bytes].view(1, -1))[0]
                    z[a:b].addcmul_(signs[a - part.lo:b - part.lo], server_scales[s], value=-1.0)

        # Everyone: decode all chunks straight into buf, one scale per tensor piece.
        table = _sign_table(buf.device, buf.dtype)
        for part, out, work in zip(lay.parts, wire["gathered"], gathered):
            _wait(work)
            scales_back = wire["gathered"][0][:, first.sign_bytes:].view(torch.float32)
            index = self._index[:out.shape[0] * part.sign_bytes].view(out.shape[0], -1)
            index.copy_(out[:, :part.sign_bytes])
            for j, s, a, b in part.decode:
                at = a - j * c - part.lo
                if at % 8 == 0 and (b - a) % 8 == 0:  # whole bytes: one look-up in the scaled table
                    torch.index_select(table * scales_back[j, s], 0, index[j, at // 8:(at + b - a) // 8],
                                       out=buf[a:b].view(-1, 8))
                else:
                    lo = at // 8
                    hi = -(-(at + b - a) // 8)
                    signs = unpack_signs(out[j, lo:hi], out=self._signs[:8 * (hi - lo)])
                    torch.mul(signs[at - 8 * lo:at - 8 * lo + b - a], scales_back[j, s], out=buf[a:b])
        return buf

    def kernel(self, fn, *args) -> bool:
        """Run ``fn`` (one of this module's elementwise steps) compiled, if this layout uses the
        compiled kernels; False: the caller runs its eager version."""
        if not self._compiled:
            return False
        if _run_compiled(fn, *args):
            return True
        self._compiled = False
        return False

    def momentum_(self, m: torch.Tensor, g: torch.Tensor, start: int, beta1: float) -> None:
        """m <- beta1 m + (1 - beta1) g, also added into the worker error at flat position ``start``
        (x = m + e, for ``allreduce_(buf, compensated=True)``): one compiled pass where the layout
        uses the kernels, else the eager steps."""
        e = self.worker_error[start:start + m.numel()]
        if not self.kernel(_momentum_into_error, m.view(-1), g.reshape(-1), e, *_scalars(m, beta1, 1 - beta1)):
            m.mul_(beta1).add_(g, alpha=1 - beta1)
            e.add_(m.view(-1))

    def _pack(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """``pack_signs`` of (rows, cols) ``x`` into (rows, cols / 8) ``out``, compiled where the layout is."""
        if not self.kernel(_pack_rows, x, out):
            pack_signs(x, out=out, bits=self._bits, scratch=self._fold)

    def scratch(self, shape) -> torch.Tensor:
        """A view of ``shape`` (at most the padded length) of the sign buffer, which holds nothing
        between exchanges: the optimizer's update temporaries reuse it instead of allocating."""
        return self._signs[:math.prod(shape)].view(shape)

    def _unpacked(self, packed: torch.Tensor) -> torch.Tensor:
        """(rows, 8 x bytes) +-1 signs of (rows, bytes) packed ones, in the reused sign buffer."""
        count = packed.numel() * 8
        return unpack_signs(packed, out=self._signs[:count], index=self._index).view(packed.shape[0], -1)

    def exchange(self, flat: torch.Tensor, sizes: list[int], mask: torch.Tensor | None = None) -> torch.Tensor:
        """The compressed mean of ``flat`` (laid out as tensors of ``sizes``) over the group, as a new
        tensor; positions in ``mask`` come back 0."""
        padded = self.configure(sizes, mask, flat.device)
        buf = torch.zeros(padded, device=flat.device)
        buf[:flat.numel()] = flat
        self.allreduce_(buf)
        if self._layout.mask is not None:
            buf.index_fill_(0, self._layout.mask, 0.0)
        return buf[:flat.numel()].clone()

    def _count(self, nbytes: int) -> None:
        self.calls += 1
        self.bytes_sent += nbytes
        if self.hook_state is not None:
            self.hook_state.count(nbytes)

    def _all_to_all(self, send: torch.Tensor, recv: torch.Tensor | None = None, async_op: bool = False):
        """``send``'s rows scattered over the ranks; with ``async_op`` returns (recv, work or None)."""
        if self.world == 1:
            return (send, None) if async_op else send
        recv = torch.empty_like(send) if recv is None else recv
        self._count(send.numel() * send.element_size())
        work = dist.all_to_all_single(recv, send, group=self.group, async_op=async_op)
        return (recv, work) if async_op else recv

    def _all_gather(self, send: torch.Tensor, out: torch.Tensor | None = None, async_op: bool = False):
        """Every rank's ``send``, concatenated; with ``async_op`` returns (out, work or None)."""
        if self.world == 1:
            return (send, None) if async_op else send
        out = send.new_empty(self.world * send.numel()) if out is None else out
        self._count(send.numel() * send.element_size())
        work = all_gather_flat(out, send, group=self.group, async_op=async_op)
        return (out, work) if async_op else out

    def state_dict(self) -> dict:
        def copy(t):
            return None if t is None else t.detach().to("cpu", copy=True)

        return {"worker_error": copy(self.worker_error), "server_error": copy(self.server_error)}

    def load_state_dict(self, sd: dict) -> None:
        self.worker_error = sd.get("worker_error")
        self.server_error = sd.get("server_error")
        self._layout, self._key = None, None


#: Layouts of at least this many elements run their residual and parameter update as compiled
#: kernels (one fused loop each instead of 2-4 eager passes; sizes are dynamic, so each kernel is
#: compiled once); below it a compile costs more than it saves.
COMPILE_MIN_NUMEL = 1 << 20
_COMPILED: dict = {}
_COMPILE_FAILED: list = []


def _sub_sign(x: torch.Tensor, scale: torch.Tensor) -> None:
    """x <- x - scale * sign(x), sign +1 at 0 as packed: the residual, from x alone (no unpacking)."""
    x.copy_(torch.where(x >= 0, x - scale, x + scale))


def _pack_rows(x: torch.Tensor, out: torch.Tensor) -> None:
    """``pack_signs`` as one loop: byte i of a row holds the signs of its elements 8i .. 8i + 7."""
    bits = (x >= 0).view(x.shape[0], -1, 8).to(torch.int32)
    packed = bits[..., 0]
    for i in range(1, 8):
        packed = packed | (bits[..., i] << i)
    out.copy_(packed.to(torch.uint8))


def _momentum_into_error(m, g, e, beta1, rest) -> None:
    """m <- beta1 m + rest g (the paper's two roundings) and e <- e + m, in one loop."""
    new = m * beta1 + g * rest
    m.copy_(new)
    e.copy_(e + new)


def _clipped_update(p, m, denom, decay, alpha, bound) -> None:
    """p <- p * decay + alpha * clamp(m / denom, -bound, bound): weight decay and the clipped step."""
    p.copy_(p * decay + torch.clamp(m / denom, -bound, bound) * alpha)


def _scalars(like: torch.Tensor, *values: float) -> list:
    """0-d tensors for a compiled kernel: Python floats would be baked in and recompile each step."""
    return [torch.tensor(v, dtype=like.dtype, device=like.device) for v in values]


def _run_compiled(fn, *args) -> bool:
    """``fn`` compiled (once, dynamic sizes); False, after one warning, where torch.compile cannot run."""
    if _COMPILE_FAILED:
        return False
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=True, fullgraph=True)
    try:
        _COMPILED[fn](*args)
    except Exception as exc:  # e.g. no C++ compiler for Inductor: said once, eager from here on
        _COMPILE_FAILED.append(exc)
        warnings.warn(f"1-bit Adam: torch.compile of its kernels failed ({type(exc).__name__}: {exc}); they run "
                      "eagerly (2-4 passes over memory each instead of one). Inductor on CPU needs a C++ "
                      "compiler (e.g. apt-get install g++).", RuntimeWarning, stacklevel=3)
        return False
    return True


def _wait(started) -> None:
    """Wait for an async collective's (result, work) pair (work is None in one process)."""
    if started[1] is not None:
        started[1].wait()


def _starts(sizes):
    out, at = [], 0
    for s in sizes:
        out.append(at)
        at += s
    return out


@dataclass
class _Masked:
    """One parameter's elements with v = 0 at the freeze: whole rows of its (shape[0], rest) view
    (an embedding's unseen tokens) plus single elements. Row-wise index ops on the rows run ~10x
    faster on CPU than per-element ones on the same count, and masks are mostly whole rows."""

    rows: torch.Tensor
    elems: torch.Tensor
    """Flat indices of the masked elements outside ``rows``."""
    cols: int

    @classmethod
    def of(cls, flat_index: torch.Tensor, shape: torch.Size) -> "_Masked":
        cols = shape.numel() // shape[0]
        row_of = flat_index // cols
        full = torch.bincount(row_of, minlength=shape[0]) == cols
        return cls(torch.nonzero(full).reshape(-1), flat_index[~full[row_of]], cols)

    @property
    def numel(self) -> int:
        return self.rows.numel() * self.cols + self.elems.numel()

    def take(self, t: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` (numel values) <- t's masked elements: the rows' first, then the single ones."""
        k = self.rows.numel() * self.cols
        torch.index_select(t.view(-1, self.cols), 0, self.rows, out=out[:k].view(-1, self.cols))
        torch.index_select(t.view(-1), 0, self.elems, out=out[k:])

    def put_(self, t: torch.Tensor, values: torch.Tensor) -> None:
        """t's masked elements <- ``values`` (in ``take``'s order)."""
        k = self.rows.numel() * self.cols
        t.view(-1, self.cols).index_copy_(0, self.rows, values[:k].view(-1, self.cols))
        t.view(-1).index_copy_(0, self.elems, values[k:])

    def taken(self, t: torch.Tensor) -> torch.Tensor:
        out = t.new_empty(self.numel)
        self.take(t, out)
        return out


_BLOCK = 32
"""Masked gradients travel in blocks of 32 values with one int32 block id: 3% over the values."""


def _sparse_or_dense_sum(values: torch.Tensor, size: int, comp: "OneBitCompressor") -> torch.Tensor:
    """Sum over the group of ``values[:size]`` (fp32, zero-padded to a multiple of _BLOCK), in
    place or as a new tensor.

    Each rank sends only its blocks that hold a nonzero value, as (block id, 32 values) rows of one
    all_gather, when that moves fewer bytes than a ring all_reduce would (n k (B + 1) < 2 N, with k
    the most blocks any rank has); else one all_reduce. An embedding row no batch of the step
    touched has an exactly zero gradient, so most masked blocks are skipped. Every rank sums the
    gathered rows in rank order, so all get the same bits.
    """
    n = comp.world
    blocks = values.view(-1, _BLOCK)
    ids = torch.nonzero(blocks.ne(0).any(1)).reshape(-1)
    counts = comp._all_gather(torch.tensor([ids.numel()], dtype=torch.int64, device=values.device)).tolist()
    width = max(counts)
    if width == 0:  # no rank touched any of them: the sum is 0, already in place
        return values
    if n * width * (_BLOCK + 1) >= 2 * size or blocks.shape[0] >= 2 ** 31:
        comp._count(size * values.element_size())
        dist.all_reduce(values[:size], group=comp.group)
        return values
    send = torch.zeros(width, _BLOCK + 1, dtype=torch.int32, device=values.device)
    send[:ids.numel(), 0] = ids
    send[:ids.numel(), 1:] = blocks.index_select(0, ids).view(torch.int32)
    rows = comp._all_gather(send.view(-1)).view(n * width, _BLOCK + 1)
    out = torch.zeros_like(blocks)
    for r, k in enumerate(counts):
        mine = rows[r * width:r * width + k]
        out.index_add_(0, mine[:, 0].long(), mine[:, 1:].view(torch.float32))
    return out.view(-1)


@dataclass
class _Flat:
    """The compressed parameters' momenta as views of one padded buffer the exchange works in."""

    params: list
    buffer: torch.Tensor
    views: list
    mask: torch.Tensor | None
    starts: dict
    """Parameter position -> where its momentum starts in ``buffer``."""


class OneBitAdam(torch.optim.Optimizer):
    """Adam with frozen variance and 1-bit momentum exchange after ``warmup_steps`` steps.

    Weight decay is decoupled (AdamW style); bias corrections are Adam's, with the variance's
    frozen at the warm-up's last step. Use it through ``DataParallelConfig(compression='onebit')``
    so DDP's gradient all-reduce is narrowed to the exact tensors at the right step; alone (one
    process) it behaves the same with the compression applied locally.

    ``warmup_steps``: uncompressed Adam steps before the variance is frozen; default
    ``warmup_for(total_steps)`` when ``total_steps`` is given, else ``DEFAULT_WARMUP_STEPS``.
    ``min_compress_numel``: tensors below it (and every 1-D tensor) are exchanged exactly.
    ``clip_updates``: after the freeze, clip each element's step at ``adam_step_bound(betas)`` x lr.

    Memory: after the freeze it keeps the compressed tensors' frozen denominator sqrt(v_hat) + eps
    (4 bytes per element) rather than recompute it every step, and the two error buffers (4 bytes
    per element on the worker side, 4 / n on the server side).
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, warmup_steps: int | None = None, group=None, *,
                 total_steps: int | None = None, min_compress_numel: int = MIN_COMPRESS_NUMEL,
                 clip_updates: bool = True):
        if warmup_steps is None:
            warmup_steps = warmup_for(total_steps) if total_steps is not None else DEFAULT_WARMUP_STEPS
            logger.info("1-bit Adam: warm-up of %d steps (%s)", warmup_steps,
                        "20% of total_steps, at least 100" if total_steps is not None else "default; "
                        "pass total_steps to get 20% of the run")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ConfigError(
                f"OneBitAdam warmup_steps={warmup_steps!r} must be an integer >= 1: the variance that "
                "gets frozen has to be measured first"
            )
        if lr <= 0 or eps <= 0 or not all(0 <= b < 1 for b in betas):
            raise ConfigError("OneBitAdam needs lr > 0, eps > 0 and betas in [0, 1)")
        if not isinstance(min_compress_numel, int) or min_compress_numel < 1:
            raise ConfigError(f"OneBitAdam min_compress_numel={min_compress_numel!r} must be an integer >= 1")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.warmup_steps = warmup_steps
        self.min_compress_numel = min_compress_numel
        self.clip_updates = clip_updates
        self._exact_params: set[int] = set()
        self.steps_done = 0
        self.compressor = OneBitCompressor(group)
        self._exact_idx: dict[int, torch.Tensor] = {}
        """Parameter position -> flat indices of its elements with v = 0 at the freeze."""
        self._flat: _Flat | None = None
        self._masks: dict | None = None
        self._denoms: dict[int, tuple] = {}
        """Parameter position -> (eps, sqrt(v_hat) + eps) of a compressed tensor after the freeze."""

    @property
    def compressing(self) -> bool:
        """True once warm-up is over: gradients stay local and momentum goes out in 1 bit."""
        return self.steps_done >= self.warmup_steps

    def compresses(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s momentum goes through the 1-bit exchange (else: exact gradient, plain Adam)."""
        return p.dim() >= 2 and p.numel() >= self.min_compress_numel and id(p) not in self._exact_params

    def keep_exact(self, params) -> None:
        """Never compress these (e.g. sparse embeddings, whose gradients are averaged exactly elsewhere)."""
        self._exact_params |= {id(p) for p in params}

    def _params(self):
        i = 0
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    yield i, group, p
                i += 1

    def _state(self, p):
        st = self.state[p]
        if not st:
            st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        return st

    def _freeze(self) -> None:
        """End of warm-up: remember which elements have no variance to freeze."""
        self._exact_idx = {}
        for i, _, p in self._params():
            if self.compresses(p):
                idx = torch.nonzero(self._state(p)["exp_avg_sq"].reshape(-1) == 0).reshape(-1)
                if idx.numel():
                    self._exact_idx[i] = idx
        self._masks = None
        self._denoms = {}
        masked = sum(t.numel() for t in self._exact_idx.values())
        if masked:
            logger.info("1-bit Adam: %d elements had v = 0 at the freeze; they stay on exact Adam", masked)

    def _masked(self) -> dict:
        """Parameter position -> its _Masked, built from ``_exact_idx`` on first use (and after a load)."""
        if self._masks is None:
            params = {i: p for i, _, p in self._params()}
            self._masks = {i: _Masked.of(idx.to(params[i].device), params[i].shape)
                           for i, idx in sorted(self._exact_idx.items())}
        return self._masks

    def _flat_momentum(self) -> _Flat:
        """The compressed momenta as views of one buffer, rebuilt if someone replaced the state."""
        flat = self._flat
        entries = [(i, p) for i, _, p in self._params() if self.compresses(p)]
        if (flat is not None and self.compressor.configured and len(entries) == len(flat.params)
                and all(p is q and self.state[p].get("exp_avg") is v
                        for (_, p), q, v in zip(entries, flat.params, flat.views))):
            return flat
        device = entries[0][1].device
        sizes = [p.numel() for _, p in entries]
        starts = _starts(sizes)
        masks = [self._exact_idx[i].to(device) + s for (i, _), s in zip(entries, starts) if i in self._exact_idx]
        mask = torch.cat(masks) if masks else None
        padded = self.compressor.configure(sizes, mask, device)
        buffer = torch.zeros(padded, device=device)
        views = []
        for (_, p), a in zip(entries, starts):
            view = buffer[a:a + p.numel()].view(p.shape)
            view.copy_(self._state(p)["exp_avg"])
            self.state[p]["exp_avg"] = view
            views.append(view)
        self._flat = _Flat([p for _, p in entries], buffer, views, mask, {i: a for (i, _), a in zip(entries, starts)})
        return self._flat

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compress = self.compressing
        t = self.steps_done + 1
        grads = {}
        for i, _, p in self._params():
            g = p.grad if p.grad is not None else torch.zeros_like(self._state(p)["exp_avg"])
            grads[i] = (g.to_dense() if g.is_sparse else g).float().contiguous()
        masks = self._masked() if compress else {}
        if masks:
            self._average_masked(grads, masks)
        flat = self._flat_momentum() if compress and any(self.compresses(p) for _, _, p in self._params()) else None
        entries = []
        for i, group, p in self._params():
            st = self._state(p)
            beta1, beta2 = group["betas"]
            g = grads[i]
            frozen = compress and self.compresses(p)
            if frozen:  # the momentum, and x = m + e of the exchange in the same pass
                self.compressor.momentum_(st["exp_avg"], g, flat.starts[i], beta1)
            else:
                st["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)
            running_v = None
            if not frozen:
                st["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
            elif i in masks:  # masked elements: exact mean gradient, plain Adam
                gm, running_v = masks[i].taken(g), masks[i].taken(st["exp_avg_sq"])
                running_v.mul_(beta2).addcmul_(gm, gm, value=1 - beta2)
                masks[i].put_(st["exp_avg_sq"], running_v)
            entries.append((i, group, p, st, frozen, running_v))
        if flat is not None:
            # the exchange leaves nothing of use at masked positions: their exact momenta go back after it
            kept = [(masks[i], st["exp_avg"], masks[i].taken(st["exp_avg"]))
                    for i, _, _, st, frozen, _ in entries if frozen and i in masks]
            self.compressor.allreduce_(flat.buffer, compensated=True)
            for mask, momentum, values in kept:
                mask.put_(momentum, values)
        for i, group, p, st, frozen, running_v in entries:
            beta1, beta2 = group["betas"]
            if frozen:
                denom = self._frozen_denominator(i, st, beta2, group["eps"])
            else:
                denom = st["exp_avg_sq"].sqrt().div_(math.sqrt(1 - beta2 ** t)).add_(group["eps"])
            if running_v is not None:
                masks[i].put_(denom, running_v.sqrt_().div_(math.sqrt(1 - beta2 ** t)).add_(group["eps"]))
            decay = 1 - group["lr"] * group["weight_decay"]
            step_size = group["lr"] / (1 - beta1 ** t)
            bound = adam_step_bound((beta1, beta2))
            clipped = frozen and self.clip_updates and bound < math.inf
            # m / denom clipped at bound x (1 - b1^t), scaled by lr / (1 - b1^t): the clip of
            # m_hat / denom at bound, with the bias correction folded into the bound and the step
            c1 = 1 - beta1 ** t
            if clipped and p.dtype == torch.float32 and self.compressor.kernel(
                    _clipped_update, p, st["exp_avg"], denom, *_scalars(p, decay, -group["lr"] / c1, bound * c1)):
                continue
            if group["weight_decay"]:
                p.mul_(decay)
            if clipped:  # eager: in the exchange's free sign buffer
                step = torch.div(st["exp_avg"], denom, out=self.compressor.scratch(p.shape))
                step.clamp_(-bound * c1, bound * c1)
                p.add_(step.to(p.dtype), alpha=-group["lr"] / c1)
            elif p.dtype == torch.float32:
                p.addcdiv_(st["exp_avg"], denom, value=-step_size)
            else:
                p.add_((st["exp_avg"] / denom).to(p.dtype), alpha=-step_size)
        self.steps_done = t
        if t == self.warmup_steps:
            self._freeze()
        return loss

    def _frozen_denominator(self, i: int, st: dict, beta2: float, eps: float) -> torch.Tensor:
        """sqrt(v_hat) + eps of a compressed tensor, computed once per freeze since v no longer
        changes there (4 bytes per element kept, three passes a step saved); its masked elements
        are overwritten every step with their running values."""
        found = self._denoms.get(i)
        if found is None or found[0] != eps:
            denom = st["exp_avg_sq"].sqrt().div_(math.sqrt(1 - beta2 ** self.warmup_steps)).add_(eps)
            self._denoms[i] = found = (eps, denom)
        return found[1]

    def _average_masked(self, grads: dict, masks: dict) -> None:
        """Replace the masked elements' local gradients by their exact mean over the group.

        Done here rather than in the DDP hook because the hook sees the model's parameters, which
        are not the optimizer's when the Engine keeps FP32 masters. Blocking, and sparse where that
        pays (``_sparse_or_dense_sum``): most masked rows are tokens no rank saw this step either.
        """
        comp = self.compressor
        if comp.world == 1:
            return
        sizes = [m.numel for m in masks.values()]
        local = grads[next(iter(masks))].new_zeros(math.ceil(sum(sizes) / _BLOCK) * _BLOCK)
        for (i, m), at in zip(masks.items(), _starts(sizes)):
            m.take(grads[i], local[at:at + m.numel])
        mean = _sparse_or_dense_sum(local.div_(comp.world), sum(sizes), comp)
        for (i, m), at in zip(masks.items(), _starts(sizes)):
            m.put_(grads[i], mean[at:at + m.numel])

    # -- checkpoints ----------------------------------------------------------------------------
    def onebit_state_dict(self) -> dict:
        """What Adam's per-parameter state does not hold: progress, the freeze's mask, the errors."""
        return {"steps_done": self.steps_done, "warmup_steps": self.warmup_steps,
                "exact_idx": {i: t.detach().to("cpu", copy=True) for i, t in self._exact_idx.items()},
                "compressor": self.compressor.state_dict()}

    def load_onebit_state_dict(self, sd: dict) -> None:
        self.steps_done = int(sd.get("steps_done", 0))
        self._exact_idx = {int(i): t.clone() for i, t in sd.get("exact_idx", {}).items()}
        if "compressor" in sd:
            self.compressor.load_state_dict(sd["compressor"])
        self._flat = self._masks = None
        self._denoms = {}

    def state_dict(self):
        sd = super().state_dict()
        sd["onebit"] = self.onebit_state_dict()
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        extra = state_dict.pop("onebit", {})
        super().load_state_dict(state_dict)
        for st in self.state.values():  # torch casts state to the parameter's dtype; ours is fp32
            for key in ("exp_avg", "exp_avg_sq"):
                if key in st and st[key].dtype != torch.float32:
                    st[key] = st[key].float()
        self.load_onebit_state_dict(extra)


def onebit_hook(state: HookState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook for 1-bit Adam: the exact all-reduce during warm-up; after it, only the tensors the
    optimizer does not compress (small ones, 1-D ones) are all-reduced, in the bucket's dtype; the
    compressed ones keep their local gradient for the momentum exchange."""
    opt: OneBitAdam = state.extra["optimizer"]
    if not opt.compressing:
        return allreduce_hook(state, bucket)
    index = _bucket_exact_index(state, opt, bucket)
    if index is None:
        return noop_hook(state, bucket)
    if isinstance(index, str):
        return allreduce_hook(state, bucket)
    buffer = bucket.buffer()
    send = buffer.index_select(0, index).div_(state.world_size)
    work = state.allreduce(send)
    state.close_bucket(bucket)

    def scatter_back(fut):
        buffer.index_copy_(0, index, fut.value()[0])
        return buffer

    return work.get_future().then(scatter_back)


def _bucket_exact_index(state: HookState, opt: OneBitAdam, bucket):
    """Positions in the bucket to all-reduce exactly: None, 'all', or a LongTensor (cached per layout).

    Decided from the bucket's parameters' shapes (``OneBitAdam.compresses``), which are the model's:
    under FP32 masters they are not the optimizer's own tensors, but they have the same shapes.
    """
    params = bucket.parameters()
    cache = state.extra.setdefault("onebit_index", {})
    key = tuple(id(p) for p in params)
    if key in cache:
        return cache[key]
    parts, offset = [], 0
    device = bucket.buffer().device
    for p in params:
        if not opt.compresses(p):
            parts.append(torch.arange(offset, offset + p.numel(), device=device))
        offset += p.numel()
    if not parts:
        found = None
    elif sum(t.numel() for t in parts) == offset:
        found = "all"
    else:
        found = torch.cat(parts)
    cache[key] = found
    return found
