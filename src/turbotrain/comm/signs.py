"""Sign bits packed eight to a byte, and back: the wire format of 1-bit compression."""

import torch

__all__ = ["pack_signs", "unpack_signs"]

#: byte value -> its 8 signs as +-1 (bit i set = element i is >= 0), for one-look-up unpacking
_SIGN_TABLE = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).float() * 2 - 1
#: v * this moves bit 8i of v (the low bit of byte i) to bit 56 + i, for i = 0..7
_GATHER_BYTE_BITS = 0x0102040810204080


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
