"""GGUF tensor encodings (F32, BF16, Q8_0) and the figures that prove them, with and without the source.

Used at write time (the source is at hand: every error is measured) and by `test` (no source: the
file's own scales bound the error, and the recorded figures are recomputed from the file).

Q8_0 (ggml's, as `gguf.quants` implements it bit for bit): each block of 32 values `x` is stored as
one float16 scale `d_h = f16(d)`, `d = max|x| / 127` (float32), and 32 int8 `q = round(x / d)`
(computed as `x * (1/d)` in float32, ties away from zero); it reads back as `q * d_h`. So

    |x - q d_h| <= |x - q d| + |q| |d - d_h|
               <= d/2 (rounding) + 127 |d| 2^-22 (the float32 product x * (1/d)) + 127 |d - d_h|

and `d` rounds to `d_h` in float16, so `|d - d_h| <= h`, half a float16 ulp at `d_h` (2^-25 below the
float16 normal range; the ulp above a power of two is the larger one, so the bound holds on either
side), hence `d <= d_h + h` and the bound per block, from the file alone:

    B(d_h) = (d_h + h) / 2 + 127 h + 2^-15 (d_h + h)

(the last term is 127 * 2^-22 rounded up: the float32 products and the float32 dequantized values,
which are exact products of an int8 and a float16, never exceed it).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

GgufType = Literal["F32", "BF16", "Q8_0"]
Q8_0_BLOCK = 32
Q8_0_BYTES = 34  # a float16 scale and 32 int8


def sha256_array(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def q8_0_scales(raw: np.ndarray) -> np.ndarray:
    """The float16 scale of every Q8_0 block of a stored tensor (its raw uint8 bytes), as float64."""
    blocks = np.ascontiguousarray(raw).reshape(-1, Q8_0_BYTES)
    return blocks[:, :2].copy().view(np.float16).reshape(-1).astype(np.float64)


def q8_0_bounds(scales: np.ndarray) -> np.ndarray:
    """The largest dequantization error each block may have, from its stored scale alone (module docstring)."""
    d_h = np.abs(scales)
    exponent = np.floor(np.log2(np.maximum(d_h, 2.0**-14)))
    half_ulp = np.where(d_h < 2.0**-14, 2.0**-25, 2.0 ** (exponent - 11))
    top = d_h + half_ulp
    return top / 2 + 127 * half_ulp + 2.0**-15 * top


def encode(values: np.ndarray, kind: GgufType) -> np.ndarray:
    """The stored bytes (or float32 values) of a float32 tensor in `kind`; BF16 comes from `encode_bf16`."""
    import gguf

    if kind == "F32":
        return np.ascontiguousarray(values, dtype=np.float32)
    if kind == "Q8_0":
        return gguf.quants.quantize(np.ascontiguousarray(values, dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    raise ValueError(f"encode: {kind} is written from the bf16 cast, not quantized")


def dequantize(stored: np.ndarray, kind: GgufType) -> np.ndarray:
    """float32 values of a stored tensor, as `gguf.quants.dequantize` (what ComfyUI-GGUF computes) gives them."""
    import gguf

    return gguf.quants.dequantize(stored, gguf.GGMLQuantizationType[kind]).astype(np.float32, copy=False)


@dataclass(frozen=True)
class StoredFigures:
    """What the file alone says of one tensor: its bytes' and dequantized values' digests, its Q8_0 scales."""

    stored_sha256: str
    dequantized_sha256: str
    blocks: int = 0
    scale_min: float = 0.0
    scale_max: float = 0.0
    max_bound: float = 0.0  # the largest per-block bound B(d_h)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"stored_sha256": self.stored_sha256, "dequantized_sha256": self.dequantized_sha256}
        if self.blocks:
            out.update(blocks=self.blocks, scale_min=self.scale_min, scale_max=self.scale_max, max_bound=self.max_bound)
        return out


def stored_figures(stored: np.ndarray, kind: GgufType, dequantized: np.ndarray) -> StoredFigures:
    """The figures of a tensor as stored (raw bytes for Q8_0/BF16, float32 for F32) and as dequantized."""
    figures = StoredFigures(sha256_array(stored), sha256_array(dequantized))
    if kind != "Q8_0":
        return figures
    scales = q8_0_scales(stored)
    return StoredFigures(figures.stored_sha256, figures.dequantized_sha256, blocks=int(scales.size),
                         scale_min=float(np.abs(scales).min()), scale_max=float(np.abs(scales).max()),
                         max_bound=float(q8_0_bounds(scales).max()))


def q8_0_errors(source: np.ndarray, stored: np.ndarray, dequantized: np.ndarray) -> dict[str, float]:
    """Measured against the source (float32): the max abs error, the max error relative to each block's
    max |x| (0 for an all-zero block), and the max ratio of a block's error to its bound (must be <= 1)."""
    x = np.ascontiguousarray(source, dtype=np.float64).reshape(-1, Q8_0_BLOCK)
    err = np.abs(x - dequantized.astype(np.float64).reshape(-1, Q8_0_BLOCK)).max(axis=1)
    amax = np.abs(x).max(axis=1)
    rel = np.divide(err, amax, out=np.zeros_like(err), where=amax > 0)
    bounds = q8_0_bounds(q8_0_scales(stored))
    return {"max_abs_error": float(err.max()), "max_rel_error": float(rel.max()),
            "bound_ratio": float((err / bounds).max())}
