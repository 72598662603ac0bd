"""The native kernels' weight layouts (serve/model/native/gemm.h says the bytes), made from a
[N, K] weight with torch: tiles of 16 output columns by 32 inputs, each tile's blocks along K
contiguous, so a thread streams its columns' bytes once per step whatever the row count.

- Q4: the GGUF's Q4_0/Q4_1 blocks, w = d * code + m, codes 0..15 (infra/formats/quant_codes.py
  recovers them from the dequantized weights), d and m in float16 as the GGUF keeps them.
- Q8: symmetric int8 blocks of 32 with a float16 scale (the GGUF's Q8_0), for the head.
"""

from __future__ import annotations

import torch

from infra.formats.quant_codes import INT4_GROUP, int4_codes
from infra.formats.quant_codes import q8_codes as quant_q8_codes

TILE = 16
BLOCK = INT4_GROUP  # 32


def _check(w: torch.Tensor) -> tuple[int, int]:
    if w.dim() != 2 or w.shape[0] % TILE or w.shape[1] % BLOCK:
        raise ValueError(f"native weights need [N, K] with N a multiple of {TILE} and K of {BLOCK}, "
                         f"got {tuple(w.shape)}")
    return w.shape[0], w.shape[1]


def _tiles(x: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """[N, K/32, ...] per-column, per-block values -> [N/16, K/32, 16, ...] (tile, block, column)."""
    return x.reshape(n // TILE, TILE, k // BLOCK, *x.shape[2:]).transpose(1, 2)


def _as_bytes(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[tiles, blocks, 16] values -> [tiles, blocks, 16 * itemsize] bytes."""
    x = x.to(dtype).contiguous()
    return x.view(torch.uint8).reshape(x.shape[0], x.shape[1], -1)


def pack_q4(w: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """[N, K] float weight -> the Q4 stream, uint8 [N/16 * K/32 * 320]; `scales`: the blocks'
    exact scale and minimum where known (infra/formats/quant_codes.py)."""
    _check(w)
    return pack_q4_codes(*int4_codes(w, BLOCK, scales))


def pack_q4_codes(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """codes [N, K] in 0..15, scale and minimum [N, K/32] -> the Q4 stream."""
    n, k = _check(codes)
    c = codes.to(torch.uint8).reshape(n // TILE, TILE, k // BLOCK, 4, 2, 4)  # tile, col, block, j, half, i
    c = c.permute(0, 2, 3, 1, 5, 4)  # tile, block, j, col, i, half
    nibbles = (c[..., 0] | (c[..., 1] << 4)).reshape(n // TILE, k // BLOCK, 256)
    d = _as_bytes(_tiles(scale, n, k), torch.float16)
    m = _as_bytes(_tiles(lo, n, k), torch.float16)
    return torch.cat([nibbles, d, m], dim=-1).reshape(-1).contiguous()


def q8_codes(w: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """infra/formats/quant_codes.py q8_codes (codes against the float16 scale the kernel reads, or the
    blocks' exact one where known) of a weight the Q8 tiles fit."""
    _check(w)
    return quant_q8_codes(w, scale, BLOCK)


def pack_q8(w: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """[N, K] float weight -> the Q8 stream, uint8 [N/16 * K/32 * 576]."""
    n, k = _check(w)
    codes, scale = q8_codes(w, scale)
    c = codes.reshape(n // TILE, TILE, k // BLOCK, 8, 4).permute(0, 2, 3, 1, 4)  # tile, block, g, col, i
    body = c.contiguous().view(torch.uint8).reshape(n // TILE, k // BLOCK, 512)
    sums = codes.reshape(n, k // BLOCK, BLOCK).sum(-1, dtype=torch.int32)
    d = _as_bytes(_tiles(scale, n, k), torch.float16)
    s = _as_bytes(_tiles(sums, n, k), torch.int16)
    return torch.cat([body, d, s], dim=-1).reshape(-1).contiguous()


def dequantize_q4(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The weights the Q4 stream holds, in float32 (scales through float16, as the kernel reads)."""
    n, k = codes.shape
    wg = codes.float().reshape(n, k // BLOCK, BLOCK) * scale.half().float().unsqueeze(-1)
    return (wg + lo.half().float().unsqueeze(-1)).reshape(n, k)
