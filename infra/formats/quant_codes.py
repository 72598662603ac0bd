"""Group-wise 4-bit codes of a weight, and the exact scales of a GGUF's 4-bit and 8-bit blocks.

A GGUF target's weights arrive dequantized in float32. Its 4-bit blocks come back exactly as
codes with a scale and a minimum per group of 32:
- Q4_1 (w = d·q + m): llama.cpp's quantizer sets m to the block's minimum and d to
  (max - min) / 15, so every block holds codes 0 and 15 and min/max gives back q, d and m;
- Q4_0 (w = d·(q - 8)): the quantizer maps the block's largest magnitude to code 0, so
  d = -that value / 8, and the minimum is -8·d.
Each block takes the first reading that reproduces it bit for bit; a block neither reproduces
(a Q4_K block, which need not hold both extremes) falls back to min/max, a second rounding.

The served model is bfloat16, which cannot hold those float32 values, so the loader
(infra/target.py) reads the scales off the float32 weights first and keeps them on each weight
(`EXACT_SCALES`); the int4 and Q8 packers take the codes under those scales.
"""

from __future__ import annotations

from typing import Any

import torch

INT4_GROUP = 32  # the GGUF's Q4_0/Q4_1 block size, and its Q8_0's
EXACT_SCALES = "osd_exact_scales"  # attribute of a weight: (scale, minimum) float16, or (scale,) for Q8


def _int4_scales(wg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block of wg [N, B, G] float32: (scale, minimum), the symmetric (Q4_0) reading where it
    reproduces the block exactly, else min/max."""
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale = (hi - lo) / 15
    safe = torch.where(scale != 0, scale, 1).unsqueeze(-1)
    if torch.equal(((wg - lo.unsqueeze(-1)) / safe).round_().clamp_(0, 15) * safe + lo.unsqueeze(-1), wg):
        return scale, lo  # every block min/max exact (a Q4_1 tensor): the common case, once over it
    peak = wg.gather(-1, wg.abs().argmax(-1, keepdim=True)).squeeze(-1)
    d = -peak / 8
    q = (wg / torch.where(d != 0, d, 1).unsqueeze(-1) + 8).round_().clamp_(0, 15)
    symmetric = (q * d.unsqueeze(-1) - 8 * d.unsqueeze(-1) == wg).all(-1) & (d != 0)
    return torch.where(symmetric, d, scale), torch.where(symmetric, -8 * d, lo)


def int4_codes(w: torch.Tensor, group: int = INT4_GROUP,
               scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
    """(codes [N, K] int32 in 0..15, scale [N, K/group] fp32, minimum [N, K/group] fp32), w ≈
    codes·scale + minimum. `scales`: the block scales known exactly (EXACT_SCALES), under which
    the codes are w's nearest; else read off w itself (the module doc)."""
    n, k = w.shape
    if k % group:
        raise ValueError(f"int4 needs the input dim ({k}) to be a multiple of the group size {group}")
    wg = w.detach().float().reshape(n, k // group, group)
    scale, lo = (s.float() for s in scales) if scales is not None else _int4_scales(wg)
    safe = torch.where(scale != 0, scale, torch.ones_like(scale))
    codes = ((wg - lo.unsqueeze(-1)) / safe.unsqueeze(-1)).round_().clamp_(0, 15).to(torch.int32)
    return codes.reshape(n, k), scale, lo


def dequantize_int4(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor,
                    group: int = INT4_GROUP) -> torch.Tensor:
    n, k = codes.shape
    wg = codes.float().reshape(n, k // group, group) * scale.unsqueeze(-1) + lo.unsqueeze(-1)
    return wg.reshape(n, k)


def q8_scale(w: torch.Tensor, group: int = INT4_GROUP) -> torch.Tensor:
    """Symmetric int8 per block of `group`: the scale [N, K/group] float32, rounded through float16
    (the GGUF's Q8_0 keeps it so; its blocks' largest magnitude is code ±127, so a Q8_0 tensor's
    own scales come back exactly)."""
    n, k = w.shape
    return (w.detach().float().reshape(n, k // group, group).abs().amax(-1) / 127).half().float()


def q8_codes(w: torch.Tensor, scale: torch.Tensor | None = None,
             group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per block of `group`: (codes [N, K] int8, scale [N, K/group] float32), the
    codes computed against the float16-rounded scale (q8_scale), or `scale` where known."""
    n, k = w.shape
    wg = w.detach().float().reshape(n, k // group, group)
    scale = q8_scale(w, group) if scale is None else scale.float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (wg / safe.unsqueeze(-1)).round_().clamp_(-127, 127).to(torch.int8)
    return codes.reshape(n, k), scale


def _reproduces(w: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> bool:
    return torch.equal(dequantize_int4(codes, scale, lo), w.detach().float())


def _exact_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    if w.dim() != 2 or w.shape[1] % INT4_GROUP:
        return None
    codes, scale, lo = int4_codes(w)
    s16, lo16 = scale.half(), lo.half()
    if not (torch.equal(s16.float(), scale) and torch.equal(lo16.float(), lo) and _reproduces(w, codes, scale, lo)):
        return None
    return s16, lo16


def _exact_q8(w: torch.Tensor) -> tuple[torch.Tensor] | None:
    if w.dim() != 2 or w.shape[1] % INT4_GROUP:
        return None
    codes, scale = q8_codes(w)
    if not _reproduces(w, codes, scale, torch.zeros_like(scale)):  # codes·scale, a zero minimum
        return None
    return (scale.half(),)


def keep_exact_scales(model: Any, known: dict[str, torch.Tensor] | None = None) -> int:
    """On a float32 model fresh from a GGUF: record on each decoder linear weight whose every block
    is exactly 4-bit its blocks' scales, and on the output head (8-bit) likewise, before a cast to
    bfloat16 loses them. `known`: scales read from the file's blocks (BLOCK_SCALES_FILE:
    `<param>.scale`, `<param>.min`, float32), taken where they reproduce the weight. Returns how
    many weights got them."""
    known = known or {}
    kept = 0
    for name, w in model.named_parameters():
        if not name.startswith("model.layers.") or w.dim() != 2:
            continue
        found: tuple[torch.Tensor, ...] | None = None
        if f"{name}.scale" in known and fits(w, known[f"{name}.scale"], known[f"{name}.min"]):
            found = (known[f"{name}.scale"], known[f"{name}.min"])
        elif w.shape[1] % INT4_GROUP == 0:
            found = _exact_int4(w)
        if found is not None:
            setattr(w, EXACT_SCALES, found)
            kept += 1
    head = model.lm_head.weight
    found_q8 = _exact_q8(head)
    if found_q8 is not None:
        setattr(head, EXACT_SCALES, found_q8)
        kept += 1
    return kept


# ---------------------------------------------------------------- Q4_K, from the file's blocks

BLOCK_SCALES_FILE = "osd-int4-scales.safetensors"  # in a converted GGUF's cache directory


def q4k_scales(raw: Any, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q4_K tensor's blocks (uint8 [rows, bytes]) -> per group of 32 (scale, minimum) float32
    [rows, K/32], w = scale·q + minimum exactly as gguf dequantizes it (scale = d·sc, minimum =
    -dmin·m, the 6-bit sc and m unpacked by gguf's own Q4_K.get_scale_min). A k-quant block
    need not hold codes 0 and 15, so these cannot be read off the weights; they come from here."""
    import numpy as np
    from gguf.quants import Q4_K

    blocks = np.asarray(raw).reshape(-1, 144)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16].copy())
    scale = d * sc.astype(np.float32)
    lo = -(dmin * m.astype(np.float32))
    return torch.from_numpy(scale.reshape(rows, -1)), torch.from_numpy(lo.reshape(rows, -1))


def unpermute_rows(x: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's converter order of a llama q/k weight's rows (each head's two rotary
    halves interleaved), for anything row-aligned with that weight."""
    return x.reshape(n_head, x.shape[0] // n_head // 2, 2, *x.shape[1:]).transpose(1, 2).reshape(x.shape)


def fits(w: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> bool:
    """Whether (scale, lo) reproduce the float32 weight w exactly with codes 0..15."""
    if scale.shape != (w.shape[0], w.shape[1] // INT4_GROUP) or scale.shape != lo.shape:
        return False
    return _reproduces(w, int4_codes(w, scales=(scale, lo))[0], scale, lo)
