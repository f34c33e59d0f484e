"""GGUF tensor encodings (F32, BF16, Q8_0) and the figures that prove them, with and without the source.

Used at write time (the source is at hand: every error is measured) and by `test` (no source: gguf-py's
own `dequantize` reproduces the recorded digests, the file's own scales bound the error).

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


def q8_0_quantize(values: np.ndarray) -> np.ndarray:
    """ggml's Q8_0 of a float32 array, by gguf-py (`gguf.quants.quantize`, bit for bit ggml's reference)."""
    import gguf

    return gguf.quants.quantize(np.ascontiguousarray(values, dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)


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


def q8_0_errors(source: torch.Tensor, stored: torch.Tensor, dequantized: torch.Tensor) -> dict[str, float]:
    """Measured against the source (float32): the max abs error, the max error relative to each block's
    max |x| (0 for an all-zero block), and the max ratio of a block's error to its bound (must be <= 1).

    In float64, in runs of blocks, so the float64 copies stay a few MB whatever the tensor's size."""
    import torch

    x_all = source.to(torch.float32).reshape(-1, Q8_0_BLOCK)
    y_all = dequantized.reshape(-1, Q8_0_BLOCK)
    bounds = torch.from_numpy(q8_0_bounds(q8_0_scales(stored.numpy())))
    worst = {"max_abs_error": 0.0, "max_rel_error": 0.0, "bound_ratio": 0.0}
    for start in range(0, x_all.shape[0], _ERROR_RUN):
        end = start + _ERROR_RUN
        _worst_of_run(worst, x_all[start:end], y_all[start:end], bounds[start:end])
    return worst


def _worst_of_run(worst: dict[str, float], x32: torch.Tensor, y32: torch.Tensor, bounds: torch.Tensor) -> None:
    """Fold one run of blocks (rows of 32 float32 values, their dequantized values and bounds) into `worst`."""
    import torch

    x = x32.to(torch.float64)
    err = (x - y32.to(torch.float64)).abs().amax(dim=1)
    amax = x.abs().amax(dim=1)
    # A scale that overflowed float16 dequantizes to inf or nan: never within any bound (nan would
    # otherwise slip through the comparisons below).
    err = torch.nan_to_num(err, nan=torch.inf)
    rel = torch.where(amax > 0, err / torch.where(amax > 0, amax, 1.0), 0.0)
    ratio = torch.nan_to_num(err / bounds, nan=torch.inf)
    for key, value in (("max_abs_error", err.max()), ("max_rel_error", rel.max()), ("bound_ratio", ratio.max())):
        worst[key] = max(worst[key], float(value))


_ERROR_RUN = 1 << 15  # blocks per run of q8_0_errors: 1 Mi values


@dataclass(frozen=True)
class Q8_0Encoded:
    """One tensor's Q8_0 bytes and every figure the writer records of it, from `q8_0_encode`."""

    stored: np.ndarray  # uint8, shaped as gguf-py shapes a quantized tensor's bytes
    source_sha256: str
    figures: StoredFigures
    errors: dict[str, float]


Q8_0_RUN = 1 << 14  # values per run of q8_0_encode's checks (512 blocks): see there
Q8_0_SEGMENT_RUNS = 16  # runs per call of gguf-py's quantizer


def q8_0_encode(tensor: torch.Tensor, stored_shape: tuple[int, ...]) -> Q8_0Encoded:
    """gguf-py's Q8_0 of a tensor and its figures (`stored_figures`, `q8_0_errors`, the source's sha256), in one
    pass over segments of runs of blocks.

    Q8_0 blocks are independent and a stored row is whole blocks, so gguf-py quantizing the flat values
    segment by segment gives the bytes it gives the whole tensor; the digests are updated in file order and
    the maxima are per-block values, so every figure equals the whole-tensor computation's. Only the stored
    bytes are tensor-sized; the whole-tensor path's float32 and float64 copies (each a fresh allocation the
    kernel zero-fills page by page) become segment- and run-sized buffers that stay in cache.

    gguf-py quantizes a segment (16 runs) per call, its per-call row grouping paid once a segment; the checks
    go run by run: a run stays under torch's grain size (32,768 elements), so its ops run on the calling
    thread (split over torch's threads, the float64 per-block reductions waited on a core that a loaded
    machine's other work held, and ran 5x slower). Measured per 16.8 M-value weight, 2 cores: 0.47-0.51 s
    against 0.59-0.63 s run by run; two Python threads of segments took 0.78 s (the GIL, on two hyperthreads).
    """
    import gguf
    import torch

    flat = tensor.contiguous().reshape(-1)
    n = flat.numel()
    if n % Q8_0_BLOCK or (stored_shape and stored_shape[-1] % Q8_0_BLOCK):
        raise ValueError(f"Q8_0 needs rows of whole {Q8_0_BLOCK}-value blocks, got shape {stored_shape}")
    stored = np.empty(n // Q8_0_BLOCK * Q8_0_BYTES, dtype=np.uint8)
    run = max(Q8_0_BLOCK, min(Q8_0_RUN, n))
    segment = run * Q8_0_SEGMENT_RUNS
    values = torch.empty(min(segment, n), dtype=torch.float32)
    digests = {name: hashlib.sha256() for name in ("source", "stored", "dequantized")}
    worst = {"max_abs_error": 0.0, "max_rel_error": 0.0, "bound_ratio": 0.0}
    scale_min, scale_max, max_bound = np.inf, 0.0, 0.0
    for begin in range(0, n, segment):
        end = min(n, begin + segment)
        digests["source"].update(memoryview(flat[begin:end].view(torch.uint8).numpy()))
        x_all = values[:end - begin]
        x_all.copy_(flat[begin:end])
        encoded_all = gguf.quants.quantize(x_all.numpy(), gguf.GGMLQuantizationType.Q8_0)
        stored[begin // Q8_0_BLOCK * Q8_0_BYTES:end // Q8_0_BLOCK * Q8_0_BYTES] = encoded_all
        digests["stored"].update(memoryview(encoded_all))
        for start in range(0, end - begin, run):
            m = min(run, end - begin - start)
            encoded = encoded_all[start // Q8_0_BLOCK * Q8_0_BYTES:(start + m) // Q8_0_BLOCK * Q8_0_BYTES]
            dequantized = q8_0_dequantize(torch.from_numpy(encoded))
            digests["dequantized"].update(memoryview(dequantized.numpy()).cast("B"))
            scales = q8_0_scales(encoded)
            bounds = q8_0_bounds(scales)
            magnitudes = np.abs(scales)
            scale_min, scale_max = min(scale_min, float(magnitudes.min())), max(scale_max, float(magnitudes.max()))
            max_bound = max(max_bound, float(bounds.max()))
            _worst_of_run(worst, x_all[start:start + m].reshape(-1, Q8_0_BLOCK), dequantized.reshape(-1, Q8_0_BLOCK),
                          torch.from_numpy(bounds))
    blocks = n // Q8_0_BLOCK
    figures = StoredFigures(digests["stored"].hexdigest(), digests["dequantized"].hexdigest(), blocks=blocks,
                            scale_min=scale_min if blocks else 0.0, scale_max=scale_max, max_bound=max_bound)
    byte_shape = (*stored_shape[:-1], stored_shape[-1] // Q8_0_BLOCK * Q8_0_BYTES) if stored_shape else (0,)
    return Q8_0Encoded(stored.reshape(byte_shape), digests["source"].hexdigest(), figures, worst)
