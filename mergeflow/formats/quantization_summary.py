"""What a manifest's `quantization` record says to a reader: how the weights were quantized, how many, and the
worst dequantization error with the bound every value is held to.

One reading for every place that tells a person about it (the run's UI summary, the Hub model card), so they
cannot disagree. FP8 and GGUF records share the shape; a GGUF record also lists the tensors it keeps exact
(F32, BF16), which carry no error figures.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# What `test` holds every stored value to, from the file alone: FP8 (the record's format), GGUF's methods.
FP8_BOUND = "each weight within half an e4m3 ulp times its scale"
GGUF_BOUNDS = {
    "q8_0": "each 32-value block within its float16 scale's bound",
    "bf16": "each tensor the bf16 cast of its source (F32 ones the source), bit for bit",
}


@dataclass(frozen=True)
class WorstError:
    tensor: str
    max_abs_error: float
    max_rel_error: float


@dataclass(frozen=True)
class QuantizationSummary:
    method: str
    quantized: int  # tensors stored in the method's encoding
    kept: int  # tensors left as they were (excluded by the architecture's rule, or kept F32)
    worst: WorstError | None  # by relative error; None when nothing was quantized
    bound: str  # what `test` holds every dequantized value to, from the file alone

    def how(self) -> str:
        return f"{self.method}: {self.quantized} tensors quantized, {self.kept} kept unquantized"

    def worst_text(self) -> str | None:
        if self.worst is None:
            return None
        return f"{self.worst.max_abs_error:.3g} abs, {self.worst.max_rel_error:.3g} relative (`{self.worst.tensor}`)"


def quantization_summary(record: Mapping[str, Any] | None) -> QuantizationSummary | None:
    """The summary of a manifest's `quantization` record (None for an unquantized artifact)."""
    if not record:
        return None
    tensors: Mapping[str, Mapping[str, Any]] = record.get("tensors") or {}
    unquantized = set(record.get("excluded") or []) | set(record.get("kept_f32") or [])
    measured = {k: v for k, v in tensors.items() if "max_rel_error" in v and "max_abs_error" in v}
    worst = None
    if measured:
        name = max(measured, key=lambda k: float(measured[k]["max_rel_error"]))
        worst = WorstError(name, float(measured[name]["max_abs_error"]), float(measured[name]["max_rel_error"]))
    method = str(record.get("method"))
    bound = FP8_BOUND if record.get("format") == "float8_e4m3fn" else GGUF_BOUNDS.get(method, "")
    return QuantizationSummary(method, sum(k not in unquantized for k in tensors), len(unquantized), worst,
                               bound or "as the manifest's quantization record says")
