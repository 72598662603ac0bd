"""The target's linear layers as the lean forward calls them: dense, or weight-only int4.

A decoder layer multiplies by four weights (fused q|k|v, o, fused gate|up, down), each
through one of these, so the forward does not care how a weight is stored:

- `Dense`: the weight as it is (float32, bfloat16 or float16), through oneDNN/MKL.
- `Int4`: weights in groups of 32 along the input dimension, each group stored as 4-bit
  codes with a scale and a zero point, multiplied by `aten._weight_int4pack_mm_for_cpu`
  on CPU. It reads a quarter of bfloat16's bytes, and a one-row step of a
  135M model is bound by the bytes it reads.

Why int4 can be exact for a GGUF target: its Q4_0 and Q4_1 blocks are int4 codes with a
scale and a minimum per group of 32, which infra/formats/quant_codes.py recovers bit for bit (the
loader keeps their float16 scales on each weight). The kernel computes w = (q - 8)·s + z, so
z = m + 8·d.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from infra.formats.quant_codes import INT4_GROUP, dequantize_int4, int4_codes  # noqa: F401 (re-exported)

QUANT_MODES = ("none", "int4")


class AddAfter:
    """The residual add of a weight-only kernel: h + (x @ W^T), the product first."""

    def add(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return h + self(x)  # type: ignore[operator]


@dataclass(frozen=True)
class Dense:
    weight: torch.Tensor  # [out, in]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def add(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """h + x @ W^T. On CUDA one GEMM (the residual rides on it: one kernel fewer per graph
        replay); on the CPU the GEMM and then the add, because addmm's result for a row depends
        on how many rows it multiplies, and a verify forward must round as decode forwards do."""
        if self.weight.is_cuda:
            return torch.addmm(h, x, self.weight.t())
        return h + F.linear(x, self.weight)


@dataclass(frozen=True)
class Upcast(AddAfter):
    """A float32 weight under lower-precision activations: x in float32, the product back in
    x's dtype. The many-row weights of an int4 target on a CPU without native bfloat16
    (infra/common/cpu.py native_bf16_gemm): there a float32 GEMM of many rows is several times faster
    than an emulated bfloat16 one, and the two casts cost little beside it."""

    weight: torch.Tensor  # [out, in] float32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight).to(x.dtype)


@dataclass(frozen=True)
class Int4(AddAfter):
    packed: torch.Tensor  # the kernel's own layout of the codes
    scales_zeros: torch.Tensor  # [in/group, out, 2] in the activation dtype
    group: int = INT4_GROUP

    @classmethod
    def from_weight(cls, w: torch.Tensor, dtype: torch.dtype, group: int = INT4_GROUP,
                    scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> "Int4":
        codes, scale, lo = int4_codes(w, group, scales)
        zero = lo + 8 * scale
        if w.shape[0] % 16:
            raise ValueError(f"int4 needs the output dim ({w.shape[0]}) to be a multiple of 16")
        if w.device.type != "cpu":
            # The CUDA kernel wants another packing and bf16 only; the GPU is not bound by
            # these bytes the way 2 CPU cores are (graphs make its step launch-bound).
            raise ValueError("model.quant int4 is the CPU path; use quant none on a GPU")
        sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
        return cls(packed, sz, group)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self.scales_zeros)


@dataclass(frozen=True)
class Int8(AddAfter):
    """Weight-only int8, one symmetric scale per output row: the head of an int4 target,
    which the GGUF keeps in 8 bits (Q8_0) rather than 4."""

    weight: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out] in the activation dtype

    @classmethod
    def from_weight(cls, w: torch.Tensor, dtype: torch.dtype) -> "Int8":
        if w.device.type != "cpu":
            raise ValueError("int8 weights are the CPU path; use quant none on a GPU")
        wf = w.detach().float()
        scale = wf.abs().amax(dim=1).clamp_min(1e-12) / 127
        return cls((wf / scale.unsqueeze(1)).round_().clamp_(-127, 127).to(torch.int8), scale.to(dtype))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scales)


def make_linear(w: torch.Tensor, quant: str, dtype: torch.dtype,
                scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> Dense | Int4 | Int8 | Upcast:
    """w as `quant` keeps it; `scales`: int4's exact block scales where known (infra/formats/quant_codes.py)."""
    if quant == "none":
        return Dense(w)
    if quant == "upcast":  # internal: a runner's wide weights (LlamaRunner), never a user's quant
        return Upcast(w.detach().float())
    if quant == "int8":  # a head draft's weights beside an int4 target (serve/spec_decode/head/draft.py)
        return Int8.from_weight(w, dtype)
    if quant == "int4":
        # The kernel's tiles: rows in 16s, the input dim in groups. A weight that does not fit
        # (a head draft's odd vocabulary) stays dense rather than failing the runner.
        if w.shape[0] % 16 or w.shape[1] % INT4_GROUP:
            return Dense(w)
        return Int4.from_weight(w, dtype, scales=scales)
    raise ValueError(f"unknown quant {quant!r}: expected one of {', '.join(QUANT_MODES)}")
