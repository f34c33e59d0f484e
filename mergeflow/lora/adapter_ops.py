"""Adapter tensors that are not a plain copy of one checkpoint tensor (e.g. ComfyUI's fused LoRAs).

An exported adapter tensor is normally one checkpoint tensor, renamed. Some layouts fuse modules
(Flux's `qkv`): their LoRA is the exact block-structured LoRA of the fused module, so its down
is the row-concatenation of the parts' downs and its up the block diagonal of their ups. Such a
tensor is planned as an `ArchitectureOp` (mergeflow.records) with one of these ops; the shard
writer computes it from its sources and its round trip re-verifies every source bit for bit and
recomputes the written bytes (mergeflow.lora.fusion), as for any other computed tensor.

- `lora_down`: the downs [r_i, in] stacked along rows -> [sum r_i, in].
- `lora_up`: the ups [out_i, r_i] placed on the block diagonal -> [sum out_i, sum r_i]. params:
  `rows` (every part's out rows, comma-separated), `present` (1/0 per part: a part without a LoRA
  is a zero block of its rows and no columns), `scale` (a factor folded in, for loaders that read
  no alpha; 1.0 keeps the bytes), `swap_halves` (1: the row halves exchanged, Flux's final norm).
- `lora_alpha`: no source; the scalar `value` (a float32 0-d tensor).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mergeflow.errors import SchemaMismatchError

if TYPE_CHECKING:
    import torch

    from mergeflow.records import ArchitectureOp

ADAPTER_OPS: tuple[str, ...] = ("lora_down", "lora_up", "lora_alpha")


def _ints(text: object) -> list[int]:
    return [int(v) for v in str(text).split(",")] if str(text) else []


def apply_adapter_op(spec: ArchitectureOp, inputs: list[torch.Tensor]) -> torch.Tensor:
    """The adapter tensor one of ADAPTER_OPS makes from its whole source tensors."""
    import torch

    params = spec.params
    if spec.op == "lora_down":
        return torch.cat(inputs, dim=0)
    if spec.op == "lora_alpha":
        return torch.tensor(float(params["value"]), dtype=torch.float32)  # type: ignore[arg-type]
    if spec.op != "lora_up":
        raise SchemaMismatchError(f"unknown adapter op {spec.op!r}")
    rows, present = _ints(params["rows"]), _ints(params["present"])
    if len(rows) != len(present) or sum(present) != len(inputs):
        raise SchemaMismatchError(f"lora_up: {len(inputs)} ups do not fit rows {rows} / present {present}")
    ups = iter(inputs)
    dtype = inputs[0].dtype
    blocks = [next(ups) if p else torch.zeros((n, 0), dtype=dtype) for n, p in zip(rows, present, strict=True)]
    if any(b.shape[0] != n for b, n in zip(blocks, rows, strict=True)):
        raise SchemaMismatchError(f"lora_up: the ups' rows {[b.shape[0] for b in blocks]} differ from {rows}")
    up = torch.block_diag(*blocks) if len(blocks) > 1 else blocks[0]
    scale = float(params.get("scale") or 1.0)  # type: ignore[arg-type]
    if scale != 1.0:
        up = up * scale
    if params.get("swap_halves"):
        first, second = up.chunk(2, dim=0)
        up = torch.cat([second, first], dim=0)
    return up
