"""Distance between low-precision tensors in units in the last place."""

from __future__ import annotations

import torch


def operand_ulps(ours: torch.Tensor, theirs: torch.Tensor, scale: torch.Tensor) -> float:
    """Largest |ours - theirs| in units in the last place of `scale` (elementwise), in ours' dtype."""
    mantissa = {torch.bfloat16: 7, torch.float16: 10}[ours.dtype]
    subnormal_step = torch.finfo(ours.dtype).smallest_normal * 2.0**-mantissa
    _, exponent = torch.frexp(scale)
    ulp = torch.clamp(torch.ldexp(torch.ones_like(scale), exponent - 1 - mantissa), min=subnormal_step)
    return float(((ours.float() - theirs.float()).abs() / ulp).max())
