"""FP8 "scaled" single files (`--output_format single_file --quantize fp8`), as ComfyUI loads them.

ComfyUI's checkpoint format (its QUANTIZATION.md, `comfy/quant_ops.py`): a quantized linear layer
`L` stores `L.weight` as float8_e4m3fn and `L.weight_scale` as a float32 scalar, the weight being
`weight.float() * weight_scale`; the safetensors metadata `_quantization_metadata` is the JSON
`{"format_version": "1.0", "layers": {"L": {"format": "float8_e4m3fn"}}}` naming every such layer
by its key in the file. Every other tensor is plain bf16.

Which tensors are quantized is the architecture's rule (an `FP8Rule` on its `OriginalLayout`): the
2-D `.weight`s inside the transformer blocks, less what the rule keeps (modulation, norms). Embedders
and the final layer sit outside the blocks and stay bf16.

The numbers (all deterministic: torch's own casts, no random rounding):
- scale `s = float32(amax) / 448` per tensor (448 is e4m3fn's largest finite value). A tensor
  whose amax is 0, or so small that `amax / 448` is no normal float32, gets `s = 1.0`: its values
  are then below e4m3's smallest subnormal ulp and all encode as 0, within the bound below.
- `q = fp8(clamp(float32(x) / s, -448, 448))`, torch's round-to-nearest-even cast.
- the bound, per element: `|q * s - x| <= s * ulp(y) / 2 + |x| * 2**-21`, where `y = x / s`,
  `ulp(y)` is e4m3's spacing at |y| (`2**(max(floor(log2|y|), -6) - 3)`: 3 mantissa bits, and
  the fixed subnormal spacing `2**-9` below the smallest normal `2**-6`). The second term covers
  float32's own roundings of the division and the check (each within 2**-24 relative); the clamp
  only ever removes float32's rounding of `amax / s` above 448, which that term covers too.
- per tensor that gives `max_abs_error <= s * 16 + amax * 2**-21` (half an ulp in e4m3's top
  binade [256, 448] is 16), which `test` checks against the recorded scale without the source.

Module imports stay light (no torch): `test` reads the rule and checks the records.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

FP8 = "fp8"
FP8_DTYPE = "float8_e4m3fn"  # torch's name; the safetensors tag is F8_E4M3
COMFY_FORMAT = "float8_e4m3fn"  # ComfyUI's QUANT_ALGOS name of the per-tensor scaled layout
METHOD = "comfyui_fp8_scaled_e4m3fn_per_tensor"
METADATA_KEY = "_quantization_metadata"
FORMAT_VERSION = "1.0"
SCALE_SUFFIX = ".weight_scale"
E4M3_MAX = 448.0
E4M3_MIN_NORMAL_EXP = -6
E4M3_MANTISSA_BITS = 3
FLOAT32_SLACK = 2.0 ** -21  # float32 roundings in the division and the error check (see above)
QUANTIZE_PARAM = "quantize"  # the conversion parameter: "fp8" when the file is quantized
OP_WEIGHT = "fp8_weight"
OP_SCALE = "fp8_scale"
OPS: tuple[str, ...] = (OP_WEIGHT, OP_SCALE)


@dataclass(frozen=True)
class FP8Rule:
    """An architecture's choice of quantized tensors, by file key.

    `blocks`: a regex matching the keys of the transformer blocks; `keep`: a regex (searched in the
    key) for block tensors that stay bf16 (modulation, norms). Only 2-D `.weight`s are quantized.
    """

    blocks: str
    keep: str

    def quantizes(self, key: str, shape: tuple[int, ...]) -> bool:
        return (key.endswith(".weight") and len(shape) == 2 and re.match(self.blocks, key) is not None
                and re.search(self.keep, key) is None)

    def describe(self) -> dict[str, str]:
        return {"blocks": self.blocks, "keep": self.keep, "only": "2-D .weight tensors"}


def quantized_keys(rule: FP8Rule, shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
    """The file keys the rule quantizes, sorted."""
    return sorted(k for k, shape in shapes.items() if rule.quantizes(k, tuple(shape)))


def scale_key(weight_key: str) -> str:
    return weight_key.removesuffix(".weight") + SCALE_SUFFIX


def layer_name(weight_key: str) -> str:
    return weight_key.removesuffix(".weight")


def comfy_metadata(keys: Iterable[str]) -> str:
    """The `_quantization_metadata` header value ComfyUI reads (sorted keys: the same bytes every run)."""
    layers = {layer_name(k): {"format": COMFY_FORMAT} for k in sorted(keys)}
    return json.dumps({"format_version": FORMAT_VERSION, "layers": layers}, sort_keys=True)


def max_error_bound(scale: float, amax: float) -> float:
    """The largest dequantization error any element of a tensor of this scale (and amax) may have."""
    return scale * 2.0 ** (8 - E4M3_MANTISSA_BITS - 1) + amax * FLOAT32_SLACK  # ulp(256..448) / 2 = 16


# --- the numbers (torch) --------------------------------------------------------------------------

def scale_of(x: torch.Tensor) -> torch.Tensor:
    """The float32 scalar scale of a tensor: amax / 448, or 1.0 for an all-zero (or subnormal-range) one."""
    import torch

    low, high = torch.aminmax(x)  # one pass, no |x| copy
    amax = torch.maximum(high.float().abs(), low.float().abs())
    if not torch.isfinite(amax):
        from mergeflow.errors import CheckpointError

        raise CheckpointError("a tensor to quantize holds inf or nan values; refusing to export a broken weight")
    scale = amax / torch.tensor(E4M3_MAX, dtype=torch.float32)
    if float(amax) == 0.0 or float(scale) < torch.finfo(torch.float32).tiny:
        scale = torch.tensor(1.0, dtype=torch.float32)
    return scale.to(torch.float32).reshape(())


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`fp8(clamp(float32(x) / scale, -448, 448))`: one float32 copy, divided and clamped in place."""
    import torch

    y = x.to(torch.float32, copy=True)
    y.div_(scale).clamp_(-E4M3_MAX, E4M3_MAX)
    return y.to(torch.float8_e4m3fn)


# Elements per block of quantize_pieces: its float32 buffers (128 KiB each) stay in the core's cache. The
# export quantizes on threads of their own (WeightsAhead, mergeflow/export/write/quantized.py), beside the
# writer, the hashers and the read-back, so a block is at most torch's grain size (32,768): each op runs as one
# chunk on the calling thread. Larger blocks spread each op over torch's OpenMP threads, which a second Python
# thread calling torch gets a team of its own for: measured at real depth, whole fp8 exports of 27.8-30.1 s at
# 65,536 against 16.1-17.2 s at 32,768 (and 16.0-18.5 s at 16,384; 17.3-20.8 s quantizing on the writer's thread).
MEASURE_BLOCK = 32768


def quantize_measured(source: torch.Tensor, scale: torch.Tensor, name: str) -> tuple[torch.Tensor, dict[str, Any]]:
    """`quantize(source, scale)` and `error_stats` of it, in one pass over the tensor, block by block."""
    q, record, _ = quantize_pieces([source], source.dtype, tuple(source.shape), scale, name)
    return q, record


def quantize_pieces(pieces: Sequence[torch.Tensor], dtype: torch.dtype, shape: tuple[int, ...], scale: torch.Tensor,
                    name: str) -> tuple[torch.Tensor, dict[str, Any], float]:
    """Quantize the tensor whose values, in row-major order, are `pieces`' one after another, each cast
    to `dtype` (the source dtype: what is measured and hashed); returns (float8 tensor, record, amax).

    Each block is cast to `dtype` (where the piece is wider: the rank pieces of an fp32 checkpoint, so no
    whole cast copy is made), then to float32, divided and cast to float8 exactly as `quantize` does
    (the same torch ops on the same values, so the same bytes), dequantized through the 256-entry e4m3
    table (`fp8 -> float32` is exact, the table is torch's own cast of every byte), and checked against
    the bound with the same float32 operations as `error_stats`; the maxima and the source's sha256
    accumulate per block. Elementwise float32 results do not depend on the blocking, so the record equals
    `error_stats`'s. Reused block buffers replace `error_stats`' whole-tensor temporaries (each a fresh
    allocation the kernel zero-fills page by page): the pass costs a few times the cast instead of tens
    of times. The amax returned lets a caller prove that `scale` is this tensor's (`scale_of_amax`).
    """
    import math

    import torch

    from mergeflow.errors import CheckpointError

    flats = [p.contiguous().reshape(-1) for p in pieces]
    n = sum(f.numel() for f in flats)
    if n != math.prod(shape):
        raise CheckpointError(f"{name}: its pieces hold {n} values, its shape {list(shape)} needs {math.prod(shape)}")
    out = torch.empty(n, dtype=torch.float8_e4m3fn)
    size = max(1, min(MEASURE_BLOCK, n))
    x, y, err, bound = (torch.empty(size, dtype=torch.float32) for _ in range(4))
    exponent, index = torch.empty(size, dtype=torch.int32), torch.empty(size, dtype=torch.int32)
    in_dtype = torch.empty(size, dtype=dtype) if any(f.dtype != dtype for f in flats) else None
    table = _e4m3_table()
    half_scale = 0.5 * float(scale)
    digest = hashlib.sha256()
    max_abs = amax = 0.0
    offset = 0
    for flat in flats:
        for begin in range(0, flat.numel(), size):
            m = min(size, flat.numel() - begin)
            start = offset + begin
            src, xb, yb, eb, bb, ib = flat[begin:begin + m], x[:m], y[:m], err[:m], bound[:m], index[:m]
            if src.dtype != dtype:
                assert in_dtype is not None
                # An overflow of the narrower dtype is an inf here, refused below with the block's other
                # non-finite values; the caller reads the tensor again, checked, to name which it was.
                src = in_dtype[:m].copy_(src)
            digest.update(memoryview(src.view(torch.uint8).numpy()))
            xb.copy_(src)
            torch.div(xb, scale, out=yb)
            torch.frexp(yb, out=(bb, exponent[:m]))  # y = x / scale before the clamp, as error_stats takes it
            q = out[start:start + m]
            q.copy_(yb.clamp_(-E4M3_MAX, E4M3_MAX))
            ib.copy_(q.view(torch.uint8))
            torch.index_select(table, 0, ib, out=eb)
            eb.mul_(scale).sub_(xb).abs_()
            # Half an ulp times the scale, 2**(max(e - 1, -6) - 3) * (scale / 2): the power of two built from
            # its exponent bits (exp2 of those integers is exact, so this is its value), then error_stats' product.
            ib.copy_(exponent[:m]).sub_(1).clamp_(min=E4M3_MIN_NORMAL_EXP).add_(127 - E4M3_MANTISSA_BITS)
            torch.mul(ib.bitwise_left_shift_(23).view(torch.float32), half_scale, out=bb)
            block_amax = float(torch.abs(xb, out=yb).max())
            if not math.isfinite(block_amax):  # scale_of refuses them first; an inf would pass the bound (inf <= inf)
                raise CheckpointError(f"{name} holds inf or nan values; refusing to export a broken weight")
            bb.add_(yb, alpha=FLOAT32_SLACK)
            if not bool(torch.le(eb, bb).all()):
                worst = int(torch.argmax(eb - bb))
                raise _beyond_bound(name, start + worst, float(eb[worst]), float(bb[worst]))
            max_abs = max(max_abs, float(eb.max()))
            amax = max(amax, block_amax)
        offset += flat.numel()
    return out.reshape(shape), _record(float(scale), amax, max_abs, dtype, digest.hexdigest()), amax


def scale_of_amax(amax: float) -> torch.Tensor:
    """`scale_of` of any tensor whose largest absolute value is `amax` (exact in float32: it is one of the values)."""
    import torch

    return scale_of(torch.tensor([amax], dtype=torch.float32))


def _e4m3_table() -> torch.Tensor:
    """float32 value of each of the 256 e4m3fn bytes, by torch's own cast."""
    import torch

    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)


def _beyond_bound(name: str, element: int, err: float, bound: float) -> Exception:
    from mergeflow.errors import CheckpointError

    return CheckpointError(f"{name}: dequantized element {element} is {err:.3e} from its source, "
                           f"beyond half an e4m3 ulp times the scale ({bound:.3e})")


def _record(scale: float, amax: float, max_abs: float, dtype: torch.dtype, sha256: str) -> dict[str, Any]:
    return {
        "scale": scale,
        "amax": amax,
        "max_abs_error": max_abs,
        # Relative to the tensor's absolute maximum: element-wise relative errors are 1 for every
        # value that rounds to 0, so the tensor's range is the meaningful denominator.
        "max_rel_error": max_abs / amax if amax else 0.0,
        "source_dtype": str(dtype).removeprefix("torch."),
        "source_sha256": sha256,
    }


def error_stats(source: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, name: str) -> dict[str, Any]:
    """Dequantize `q`, check every element against the bound, and return the manifest's record.

    `source` is the unquantized tensor in the export dtype (its bytes are hashed here).
    """
    import torch

    # Few full-size temporaries (float32 and int32 copies of the tensor): peak about four of them.
    x = source.to(torch.float32)
    s = float(scale)
    err = q.to(torch.float32).mul_(scale).sub_(x).abs_()
    _, exponent = torch.frexp(x / scale)  # y = x / scale as quantize computes it; |y| = m * 2**e, m in [0.5, 1)
    # floor(log2|y|) = e - 1, never below e4m3's smallest normal exponent (the subnormals' fixed spacing).
    bound = exponent.sub_(1).clamp_(min=E4M3_MIN_NORMAL_EXP).sub_(E4M3_MANTISSA_BITS).to(torch.float32)
    del exponent
    torch.exp2(bound, out=bound).mul_(0.5 * s)  # half an ulp times the scale: powers of two, exact
    bound.add_(x.abs(), alpha=FLOAT32_SLACK)
    if not bool((err <= bound).all()):
        worst = int(torch.argmax(err - bound))
        raise _beyond_bound(name, worst, float(err.reshape(-1)[worst]), float(bound.reshape(-1)[worst]))
    del bound
    if x.numel():
        low, high = torch.aminmax(x)
        amax = max(abs(float(low)), abs(float(high)))
    else:
        amax = 0.0
    max_abs = float(err.max()) if err.numel() else 0.0
    raw = source.contiguous().reshape(-1).view(torch.uint8).numpy()
    return _record(s, amax, max_abs, source.dtype, hashlib.sha256(memoryview(raw)).hexdigest())


def check_record(key: str, record: Mapping[str, Any], file_scale: float) -> str | None:
    """Why a manifest's record of one quantized tensor is wrong (None: within the bound, scale as in the file)."""
    try:
        scale, amax = float(record["scale"]), float(record["amax"])
        max_abs, max_rel = float(record["max_abs_error"]), float(record["max_rel_error"])
        sha = str(record["source_sha256"])
    except (KeyError, TypeError, ValueError):
        return f"{key}: the quantization record lacks scale, amax, errors or source_sha256"
    if scale != file_scale:
        return f"{key}: the file's scale {file_scale!r} is not the recorded {scale!r}"
    if not (scale > 0 and amax >= 0 and 0 <= max_abs <= max_error_bound(scale, amax)):
        return f"{key}: the recorded error {max_abs!r} exceeds the fp8 bound for scale {scale!r}"
    if amax and abs(max_rel - max_abs / amax) > 1e-12 * max(1.0, max_rel):
        return f"{key}: the recorded relative error is not max_abs_error / amax"
    if amax and scale != 1.0 and abs(scale * E4M3_MAX - amax) > amax * 2.0 ** -22:
        return f"{key}: the recorded scale is not amax / 448"
    if not re.fullmatch(r"[0-9a-f]{64}", sha):
        return f"{key}: the recorded source_sha256 is not a sha256"
    return None
