"""GGUF tensor encodings (F32, BF16, Q8_0) and the figures that prove them, with and without the source.

Used at write time (the source is at hand: every error is measured) and by `test` (no source: gguf-py's
own `dequantize` reproduces the recorded digests, the file's own scales bound the error).

Q8_0 (ggml's, as `gguf.quants` implements it, and `q8_0_quantize_run` bit for bit): each block of 32
values `x` is stored as one float16 scale `d_h = f16(d)`, `d = max|x| / 127` (float32), and 32 int8 `q = round(x / d)`
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
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:
    import torch

GgufType = Literal["F32", "BF16", "Q8_0"]
Q8_0_BLOCK = 32
Q8_0_BYTES = 34  # a float16 scale and 32 int8


def sha256_array(array: np.ndarray) -> str:
    """sha256 of an array's bytes in C order (no copy of a contiguous array)."""
    return hashlib.sha256(memoryview(np.ascontiguousarray(array)).cast("B")).hexdigest()


def q8_0_dequantize(stored: torch.Tensor) -> torch.Tensor:
    """`q * d_h` in float32, as `gguf.quants.dequantize` computes it (each product of an int8 and a float16 is
    exact in float32, so the two agree bit for bit: `test` recomputes it with gguf-py), in torch: 3x faster."""
    import torch

    blocks = stored.reshape(-1, Q8_0_BYTES)
    d = blocks[:, :2].contiguous().view(torch.float16).to(torch.float32)
    q = blocks[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    return (q * d).reshape(*stored.shape[:-1], stored.shape[-1] // Q8_0_BYTES * Q8_0_BLOCK)


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


SCAN_VALUES = 1 << 18  # values per segment of scan_stored


def scan_stored(stored: np.ndarray, kind: GgufType, back_to: torch.dtype | None = None) -> tuple[StoredFigures, str | None]:
    """`stored_figures(stored, kind, dequantize(stored, kind))`, segment by segment on the machine's cores, and
    with `back_to` the sha256 of the dequantized values cast to that dtype (a source's bytes, where the stored
    type holds every source value); the same figures, without a tensor-sized float32 copy.

    gguf-py dequantizes each segment (Q8_0 blocks, BF16 and F32 values are independent, so a segment's
    values are the whole tensor's), and this thread takes the digests in order.
    """
    import torch

    from mergeflow.parallel import ordered_map

    raw = np.ascontiguousarray(stored).reshape(-1).view(np.uint8)
    unit, per_unit = (Q8_0_BYTES, Q8_0_BLOCK) if kind == "Q8_0" else (2 if kind == "BF16" else 4, 1)
    step = SCAN_VALUES // per_unit * unit

    def scan(start: int) -> tuple[np.ndarray, np.ndarray | None]:
        piece = raw[start:start + step]
        values = dequantize(piece.view(np.float32) if kind == "F32" else piece.reshape(1, -1), kind).reshape(-1)
        return values, (q8_0_scales(piece) if kind == "Q8_0" else None)

    digests = {name: hashlib.sha256() for name in ("stored", "dequantized", "back")}
    scale_min, scale_max, max_bound, blocks = np.inf, 0.0, 0.0, 0
    starts = range(0, raw.size, step)
    for start, (values, scales) in zip(starts, ordered_map(scan, starts), strict=True):
        digests["stored"].update(memoryview(raw[start:start + step]))
        digests["dequantized"].update(memoryview(values).cast("B"))
        if back_to is not None:
            with warnings.catch_warnings():  # an F32 file's values are its read-only mapping: only read here
                warnings.simplefilter("ignore", UserWarning)
                back = torch.from_numpy(values).to(back_to)
            digests["back"].update(memoryview(back.view(torch.uint8).numpy()))
        if scales is not None and scales.size:
            magnitudes = np.abs(scales)
            scale_min, scale_max = min(scale_min, float(magnitudes.min())), max(scale_max, float(magnitudes.max()))
            max_bound, blocks = max(max_bound, float(q8_0_bounds(scales).max())), blocks + int(scales.size)
    if kind != "Q8_0":
        figures = StoredFigures(digests["stored"].hexdigest(), digests["dequantized"].hexdigest())
    else:
        figures = StoredFigures(digests["stored"].hexdigest(), digests["dequantized"].hexdigest(), blocks=blocks,
                                scale_min=scale_min if blocks else 0.0, scale_max=scale_max, max_bound=max_bound)
    return figures, (digests["back"].hexdigest() if back_to is not None else None)


def _worst_of_run(worst: dict[str, float], x32: torch.Tensor, y32: torch.Tensor, bounds: torch.Tensor,
                  amax32: torch.Tensor) -> None:
    """Fold one run of blocks (rows of 32 float32 values, their dequantized values, bounds and max |x|)
    into `worst`, every figure as float64 arithmetic gives it.

    Each block's error is taken in float32 (two passes over the values, where float64 took six), then the
    blocks that could hold a maximum are measured again in float64. The float32 difference `x - q d_h` is
    exact but in rare blocks (x on the float32 grid of its own ulp, which q d_h's coarser grid is a multiple
    of, so exact while |x - q d_h| stays below the power of two above |x|: it can exceed it only for
    q = +-1, |x| within 2^-11 below a power of two and d_h rounded up), and within 2^-24 (relative) of the
    exact value there; a block whose float32 figure is below the run's largest by more than 2^-20 cannot
    hold the exact maximum, and the others are few (one, on real weights).
    """
    import torch

    err = (x32 - y32).abs_().amax(dim=1).to(torch.float64)
    amax = amax32.reshape(-1).to(torch.float64)

    def figures(err: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # A scale that overflowed float16 dequantizes to inf or nan: never within any bound (nan would
        # otherwise slip through the comparisons below).
        err = torch.nan_to_num(err, nan=torch.inf)
        rel = torch.where(amax > 0, err / torch.where(amax > 0, amax, 1.0), 0.0)
        return err, rel, torch.nan_to_num(err / bounds, nan=torch.inf)

    near = torch.zeros_like(err, dtype=torch.bool)
    for figure in figures(err):
        top = figure.max() if figure.numel() else figure.new_zeros(())
        near |= (figure >= top * (1 - 2.0**-20)) & (figure > 0)  # a float32 error of 0 is exact: x == q d_h
    rows = near.nonzero().reshape(-1)
    if rows.numel():
        x, y = x32[rows].to(torch.float64), y32[rows].to(torch.float64)
        err[rows] = (x - y).abs().amax(dim=1)
    for key, value in zip(("max_abs_error", "max_rel_error", "bound_ratio"), figures(err), strict=True):
        if value.numel():
            worst[key] = max(worst[key], float(value.max()))


@dataclass(frozen=True)
class Q8_0Encoded:
    """One tensor's Q8_0 bytes and every figure the writer records of it, from `q8_0_encode`."""

    stored: np.ndarray  # uint8, shaped as gguf-py shapes a quantized tensor's bytes
    source_sha256: str
    figures: StoredFigures
    errors: dict[str, float]


Q8_0_RUN = 1 << 18  # values per run of q8_0_encode (8,192 blocks, 1 MiB of float32): see there


def q8_0_quantize_run(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ggml's Q8_0 of a run of float32 values (whole blocks), as gguf-py computes it, bit for bit, in torch:
    the int8 values `q` (rows of 32), the float16 scales `d_h` and each block's max |x| (one per row).

    gguf-py: `d = max|x| / 127`, `id = 1/d` (0 where d is 0), `q = np_roundf(x * id)` (round half away from
    zero: `floor(|v|) + floor(2 (|v| - floor(|v|)))`, the sign put back), `d_h = f16(d)`. The same float32
    operations here: `|x * id| == |x| * id` exactly (the sign is the product's only dependence on x's),
    `floor(2 f) == (f >= 0.5)` for f in [0, 1), and x's sign copied onto the rounded magnitude (a -0.0 is
    the int8 0). Faster than gguf-py's numpy on a run, and torch's kernels release the GIL (numpy's
    small-array ops barely do). Sources are finite (the rebuild refuses inf/nan), so every rounded value is
    an int8.
    """
    import torch

    blocks = x.reshape(-1, Q8_0_BLOCK)
    v = blocks.abs()
    amax = v.amax(dim=1, keepdim=True)
    d = amax / 127
    inverse = torch.reciprocal(d).masked_fill_(d == 0, 0)
    v.mul_(inverse)
    floor = torch.floor(v)
    rounded = floor.add_(v.sub_(floor).ge_(0.5)).copysign_(blocks)
    return rounded.to(torch.int8), d.to(torch.float16), amax


def q8_0_encode(tensor: torch.Tensor, stored_shape: tuple[int, ...]) -> Q8_0Encoded:
    """ggml's Q8_0 of a tensor (`q8_0_quantize_run`, gguf-py's bytes) and its figures (`stored_figures`, the
    errors against the source as float64 gives them, the source's sha256), in one pass over runs of blocks.

    Q8_0 blocks are independent and a stored row is whole blocks, so quantizing the flat values run by run
    gives the bytes gguf-py gives the whole tensor; the digests are updated in file order and the maxima are
    per-block values, so every figure equals the whole-tensor computation's (tests/test_quantize_one_pass.py
    holds both to it, and to gguf-py's bytes). Only the stored bytes are tensor-sized; every other buffer
    is run-sized. A run is 256 Ki values: far fewer torch calls than runs under torch's grain size (each
    call's overhead, and the GIL it takes, dominated there: two threads encoding at 16 Ki were barely
    faster than one), small enough to stay in the last-level cache. Measured per 16.8 M-value bf16
    weight, 2 cores, best of 3 (one thread / two threads encoding different weights): 0.148 / 0.070 s;
    with the errors taken in float64, 0.197 / 0.119 s (and 0.345 / 0.283 s in runs of 16 Ki); before,
    with gguf-py's quantizer on 256 Ki segments, 0.232 / 0.198 s. The writer encodes the next tensors on
    threads of their own (`gguf_writer.encoded_ahead`).
    """
    import torch

    flat = tensor.contiguous().reshape(-1)
    n = flat.numel()
    if n % Q8_0_BLOCK or (stored_shape and stored_shape[-1] % Q8_0_BLOCK):
        raise ValueError(f"Q8_0 needs rows of whole {Q8_0_BLOCK}-value blocks, got shape {stored_shape}")
    stored = np.empty(n // Q8_0_BLOCK * Q8_0_BYTES, dtype=np.uint8)
    stored_blocks = torch.from_numpy(stored).view(-1, Q8_0_BYTES)
    run = max(Q8_0_BLOCK, min(Q8_0_RUN, n))
    values = torch.empty(min(run, n), dtype=torch.float32)
    digests = {name: hashlib.sha256() for name in ("source", "stored", "dequantized")}
    worst = {"max_abs_error": 0.0, "max_rel_error": 0.0, "bound_ratio": 0.0}
    scale_min, scale_max, max_bound = np.inf, 0.0, 0.0
    for start in range(0, n, run):
        end = min(n, start + run)
        digests["source"].update(memoryview(flat[start:end].view(torch.uint8).numpy()))
        x = values[:end - start]
        x.copy_(flat[start:end])
        q, d_h, amax = q8_0_quantize_run(x)
        encoded = stored_blocks[start // Q8_0_BLOCK:end // Q8_0_BLOCK]
        encoded[:, :2] = d_h.view(torch.uint8)
        encoded[:, 2:] = q.view(torch.uint8)
        digests["stored"].update(memoryview(encoded.numpy()).cast("B"))
        dequantized = q.to(torch.float32).mul_(d_h.to(torch.float32))  # q8_0_dequantize's values
        digests["dequantized"].update(memoryview(dequantized.numpy()).cast("B"))
        scales = d_h.reshape(-1).to(torch.float64).numpy()
        bounds = q8_0_bounds(scales)
        magnitudes = np.abs(scales)
        scale_min, scale_max = min(scale_min, float(magnitudes.min())), max(scale_max, float(magnitudes.max()))
        max_bound = max(max_bound, float(bounds.max()))
        _worst_of_run(worst, x.reshape(-1, Q8_0_BLOCK), dequantized, torch.from_numpy(bounds), amax)
    blocks = n // Q8_0_BLOCK
    figures = StoredFigures(digests["stored"].hexdigest(), digests["dequantized"].hexdigest(), blocks=blocks,
                            scale_min=scale_min if blocks else 0.0, scale_max=scale_max, max_bound=max_bound)
    byte_shape = (*stored_shape[:-1], stored_shape[-1] // Q8_0_BLOCK * Q8_0_BYTES) if stored_shape else (0,)
    return Q8_0Encoded(stored.reshape(byte_shape), digests["source"].hexdigest(), figures, worst)
