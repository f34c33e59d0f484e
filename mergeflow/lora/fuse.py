"""Tensors the shard writer computes instead of copying: LoRA fusion and frozen weights from the base model.

A `TensorWrite.transform` names its sources; the writer calls `transformed_tensor` where it would
otherwise stream rank-local pieces, so every source byte is still read once while writing. Only the
fused tensor (and its adapter) is materialised: memory stays bounded by one tensor.

Transform records (JSON-friendly, part of the shard fingerprint):
  {"op": "lora_fuse", "param": "weight"|"bias", "module": str, "scaling": float, "rank": int,
   "base": SOURCE, "lora_A": SOURCE, "lora_B": SOURCE, "lora_magnitude_vector": SOURCE|None,
   "lora_B_bias": SOURCE|None}
  {"op": "base_copy", "base": SOURCE}
  SOURCE = {"from": "checkpoint", "layout": TensorLayout fields} | {"from": "base_model", "file": str, "key": str}
         | {"from": "computed", "name": str, "out_dtype": str, "layout": ..., "transform": {...}}
A "computed" SOURCE is another write's result (e.g. a fused LoRA weight), so an architecture's
conversion (a qkv fusion, say) can take already fused weights: LoRA is folded in before conversion.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from mergeflow.architectures.conversions import apply_transform, is_conversion_op
from mergeflow.errors import CheckpointError, InputChangedError
from mergeflow.export.layout import TensorLayout
from mergeflow.lora.math import fuse_bias, fuse_weight
from mergeflow.records import TensorWrite
from mergeflow.export.reconstruct import RankStates, bits, cast, check_finite, verified_chunks, verify_round_trip

LORA_FUSE = "lora_fuse"
BASE_COPY = "base_copy"


def checkpoint_source(layout: TensorLayout) -> dict[str, Any]:
    """A SOURCE record for a tensor of the rank files."""
    return {"from": "checkpoint", "layout": asdict(layout)}


def base_model_source(file: Path, key: str) -> dict[str, Any]:
    """A SOURCE record for a tensor of the base model's safetensors files."""
    return {"from": "base_model", "file": str(file), "key": key}


def layout_of(source: dict[str, Any]) -> TensorLayout:
    """The TensorLayout of a checkpoint SOURCE (lists from JSON become tuples again)."""
    data = dict(source["layout"])
    data["shape"] = tuple(data["shape"])
    data["chunk_ranks"] = tuple(tuple(r) for r in data["chunk_ranks"])
    data["chunk_shapes"] = tuple(tuple(s) for s in data["chunk_shapes"])
    return TensorLayout(**data)


def _assemble(layout: TensorLayout, chunks: list[torch.Tensor]) -> torch.Tensor:
    if layout.shard_dim is None:
        return chunks[0]
    return torch.cat(chunks, dim=layout.shard_dim)


def _read_base_model(source: dict[str, Any], expect: TensorLayout | None) -> torch.Tensor:
    from safetensors import safe_open

    path = Path(source["file"])
    try:
        with safe_open(str(path), framework="pt") as handle:
            tensor = handle.get_tensor(source["key"])
    except FileNotFoundError:
        raise InputChangedError(f"base weight file {path.name} disappeared during the export") from None
    except Exception as exc:  # safetensors raises its own error types for a key that vanished or a damaged file
        raise InputChangedError(f"{source['key']} cannot be read from base file {path.name} ({exc})") from None
    if expect is not None and (tuple(tensor.shape) != expect.shape or str(tensor.dtype).removeprefix("torch.") != expect.dtype):
        raise InputChangedError(f"{source['key']} in base file {path.name} changed shape or dtype during the export")
    check_finite(tensor, f"{source['key']} of the base model")
    return tensor


def read_source(source: dict[str, Any] | None, states: RankStates, *, verify: bool = False,
                expect: TensorLayout | None = None) -> torch.Tensor | None:
    """One source tensor, whole; with verify, re-slice it and compare every rank shard bit for bit."""
    if source is None:
        return None
    if source["from"] == "base_model":
        return _read_base_model(source, expect)
    if source["from"] == "computed":
        inner = TensorWrite(source["name"], source["name"], layout_of(source), source["out_dtype"], source["transform"])
        return transformed_tensor(inner, states, verify=verify)
    if source["from"] != "checkpoint":
        raise CheckpointError(f"unknown tensor source {source['from']!r}")
    layout = layout_of(source)
    chunks = verified_chunks(layout, states)
    tensor = _assemble(layout, chunks)
    if verify:
        verify_round_trip(layout, tensor, chunks, layout.dtype, layout.key)
    return tensor


def transformed_tensor(tw: TensorWrite, states: RankStates, *, verify: bool = False) -> torch.Tensor:
    """The output tensor of a transformed TensorWrite, in its output dtype, contiguous."""
    spec = tw.transform or {}
    op = spec.get("op")
    if is_conversion_op(op):  # architecture conversions (mergeflow.architectures.conversions): whole sources in, one tensor out
        inputs = [read_source(source, states, verify=verify) for source in spec["inputs"]]
        return cast(apply_transform(spec, inputs), tw.out_dtype, tw.name).contiguous()
    expect = tw.layout if spec.get("base", {}).get("from") == "base_model" else None
    base = read_source(spec.get("base"), states, verify=verify, expect=expect)
    if base is None:
        raise CheckpointError(f"{tw.name}: transform {op!r} names no base tensor")
    if op == BASE_COPY:
        result = base
    elif op == LORA_FUSE:
        result = _fuse(tw.name, spec, base, states, verify)
    else:
        raise CheckpointError(f"{tw.name}: unknown tensor transform {op!r}")
    return cast(result, tw.out_dtype, tw.name).contiguous()


def _fuse(name: str, spec: dict[str, Any], base: torch.Tensor, states: RankStates, verify: bool) -> torch.Tensor:
    def part(kind: str) -> torch.Tensor | None:
        return read_source(spec.get(kind), states, verify=verify)

    module = spec["module"]
    if spec["param"] == "bias":
        lora_b_bias = part("lora_B_bias")
        if lora_b_bias is None:
            raise CheckpointError(f"{name}: a LoRA bias fusion needs lora_B_bias")
        return fuse_bias(base, lora_b_bias, scaling=spec["scaling"], module=module)
    lora_a, lora_b = part("lora_A"), part("lora_B")
    if lora_a is None or lora_b is None:
        raise CheckpointError(f"{name}: a LoRA fusion needs lora_A and lora_B")
    # Rounded once to the frozen weight's dtype (SPEC section 4); the dtype policy is applied after.
    return fuse_weight(
        base, lora_a, lora_b, scaling=spec["scaling"], magnitude=part("lora_magnitude_vector"),
        rank=spec["rank"], module=module,
    )


def verify_transformed(tw: TensorWrite, written: torch.Tensor, states: RankStates) -> None:
    """Round trip of a computed tensor: every source re-verified bit for bit, then the written bytes recomputed."""
    if tuple(written.shape) != tw.layout.shape:
        raise CheckpointError(f"{tw.name}: written shape {list(written.shape)} differs from {list(tw.layout.shape)}")
    expected = transformed_tensor(tw, states, verify=True)
    if expected.dtype != written.dtype or not torch.equal(bits(expected), bits(written)):
        raise CheckpointError(f"{tw.name}: round trip failed, the written tensor differs from its recomputed value")
