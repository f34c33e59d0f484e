"""`--extract-lora RANK` / `--extract-energy F`: the flags' checks and the plan's record (no torch here).

The pre-flight and the config's validation import this before torch loads; the SVD itself is
mergeflow.lora.extract, the flow's step mergeflow.lora.extraction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mergeflow.errors import UsageError

EXTRACTION_NAME = "lora_extraction.json"  # the per-layer record beside the adapter's weights


def check_settings(rank: object, energy: object) -> None:
    """The flag values alone: a rank >= 1 and an energy fraction in (0, 1]."""
    if rank is None:
        if energy is not None:
            raise UsageError("--extract-energy needs --extract-lora RANK (the cap of every layer's rank)")
        return
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise UsageError(f"--extract-lora must be a rank >= 1, not {rank!r}")
    if energy is not None and (isinstance(energy, bool) or not isinstance(energy, (int, float))
                               or not math.isfinite(energy) or not 0.0 < energy <= 1.0):
        raise UsageError(f"--extract-energy must be a fraction in (0, 1], not {energy!r}")


@dataclass(frozen=True)
class ExtractSpec:
    """What inspection fixed for an extraction (`MergePlan.extract`): the flags and where the base's weights are."""

    rank: int
    energy: float | None
    adapter_format: str
    base_model_name_or_path: str  # the adapter config's base: a Hub id or the base directory's name
    base_weight_map: dict[str, str] = field(default_factory=dict)  # tensor -> its file in the base component


def extraction_rows(record: dict[str, object]) -> list[dict[str, object]]:
    """The UI table of an extraction: one row per layer, worst retained first (the record's order)."""
    layers = record.get("layers")
    rows: list[dict[str, object]] = []
    for layer in layers if isinstance(layers, list) else []:
        rows.append({"layer": layer["module"], "shape": "x".join(map(str, layer["shape"])), "rank": layer["rank"],
                     "retained": f"{layer['retained']:.6f}", "max_abs_error": f"{layer['max_abs_error']:.3e}",
                     "method": layer["method"]})
    return rows


def extraction_diff_rows(record: dict[str, object]) -> list[dict[str, object]]:
    """The UI table of the changed tensors no LoRA carries: the norm of each change, the `.diff` entry it went to
    (or why none), largest change first (the record's order)."""
    items = record.get("not_extracted")
    rows: list[dict[str, object]] = []
    for item in items if isinstance(items, list) else []:
        rows.append({"tensor": item["name"], "shape": "x".join(map(str, item["shape"])),
                     "delta_norm": f"{item['delta_norm']:.3e}", "written_as": item.get("written_as") or "",
                     "reason": item["reason"]})
    return rows


def extraction_words(record: dict[str, object]) -> str:
    """One line for the table's description: the overall figures."""
    summary = record.get("summary")
    if not isinstance(summary, dict):
        return "LoRA extraction"
    return (f"LoRA extraction: {summary['layers']} layers, energy-weighted retained {summary['energy_weighted_retained']:.6f} "
            f"(worst {summary['min_retained']:.6f}), adapter {summary['adapter_file_bytes']} bytes = "
            f"{summary['size_ratio']:.4%} of the full model's {summary['full_model_bytes']}; "
            f"{summary.get('diff_entries', 0)} .diff entries; worst layers first")
