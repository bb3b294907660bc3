"""The error-compensated 1-bit mean behind 1-bit Adam: layout, pipelined exchange, decode.

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
* on layouts of ``COMPILE_MIN_NUMEL`` elements or more, the elementwise steps run as compiled
  single loops (``onebit_kernels``).
"""

import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import ConfigError
from .collectives import all_gather_flat
from .hooks import HookState
from .onebit_kernels import (COMPILE_MIN_NUMEL, _momentum_into_error, _pack_rows, _run_compiled, _scalars, _sub_sign,
                             compile_failed)
from .signs import _sign_table, pack_signs, unpack_signs

__all__ = ["OneBitCompressor"]

logger = logging.getLogger(__name__)
logger.addHandler(logging.NullHandler())

_ALIGN = 32  # elements per server chunk are a multiple of 32: whole bytes of signs, 4-byte aligned scales
#: The exchange is cut into up to this many parts (columns of every server chunk), pipelined: a
#: part's signs travel while the next part is packed, and the server averages a part while the
#: later ones travel (gloo and NCCL run async collectives off the calling thread).
PIPELINE_PARTS = 4
#: Fewest elements per server chunk in a part: below it a part's collective is latency, not bytes.
MIN_PART_NUMEL = 1 << 18


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
                          else self._layout.total >= COMPILE_MIN_NUMEL) and not compile_failed()
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


def _wait(started) -> None:
    """Wait for an async collective's (result, work) pair (work is None in one process)."""
    if started[1] is not None:
        started[1].wait()
