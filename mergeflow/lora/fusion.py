"""Tensors the shard writer computes instead of copying: LoRA fusion, base copies and conversions.

A `TensorWrite.transform` (a `LoraFuse`, `BaseCopy` or `ArchitectureOp` from mergeflow.records)
names its sources; the writer calls `transformed_tensor` where it would otherwise stream rank-local
pieces, so every source byte is still read once while writing. Only the computed tensor (and its
adapter) is materialised: memory stays bounded by one tensor. A `ComputedSource` is another write's
result (e.g. a fused LoRA weight), so an architecture's conversion (a qkv fusion, say) can take
already fused weights: LoRA is folded in before conversion.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mergeflow.architectures.conversions import apply_transform
from mergeflow.architectures.quantization import OPS as QUANTIZED_OPS
from mergeflow.errors import CheckpointError, InputChangedError
from mergeflow.export.reconstruct.rebuild import (
    PieceSource,
    bits,
    cast,
    check_finite,
    verified_chunks,
    verify_round_trip,
)
from mergeflow.lora.adapter_ops import ADAPTER_OPS, apply_adapter_op
from mergeflow.lora.math import fuse_bias, fuse_weight
from mergeflow.records import (
    ArchitectureOp,
    BaseModelSource,
    ComputedSource,
    LoraFuse,
    TensorLayout,
    TensorSource,
    TensorWrite,
)


def _assemble(layout: TensorLayout, chunks: list[torch.Tensor]) -> torch.Tensor:
    if layout.shard_dim is None:
        return chunks[0]
    return torch.cat(chunks, dim=layout.shard_dim)


def _read_base_model(source: BaseModelSource, expect: TensorLayout | None) -> torch.Tensor:
    from safetensors import safe_open

    path = Path(source.file)
    try:
        with safe_open(str(path), framework="pt") as handle:
            tensor = handle.get_tensor(source.key)
    except FileNotFoundError:
        raise InputChangedError(f"base weight file {path.name} disappeared during the export") from None
    except Exception as exc:  # safetensors raises its own error types for a key that vanished or a damaged file
        raise InputChangedError(f"{source.key} cannot be read from base file {path.name} ({exc})") from None
    if expect is not None and (tuple(tensor.shape) != expect.shape or str(tensor.dtype).removeprefix("torch.") != expect.dtype):
        raise InputChangedError(f"{source.key} in base file {path.name} changed shape or dtype during the export")
    check_finite(tensor, f"{source.key} of the base model")
    return tensor


def read_source(source: TensorSource | None, states: PieceSource, *, verify: bool = False,
                expect: TensorLayout | None = None, check_values: bool = True) -> torch.Tensor | None:
    """One source tensor, whole; with verify, re-slice it and compare every rank shard bit for bit.

    check_values=False leaves the finiteness of rank pieces to a caller that proves it on its own pass."""
    if source is None:
        return None
    if isinstance(source, BaseModelSource):
        return _read_base_model(source, expect)
    if isinstance(source, ComputedSource):
        return transformed_tensor(source.write, states, verify=verify)
    layout = source.layout
    chunks = verified_chunks(layout, states, check_values=check_values)
    tensor = _assemble(layout, chunks)
    if verify:
        verify_round_trip(layout, tensor, chunks, layout.dtype, layout.key)
    return tensor


def transformed_tensor(tw: TensorWrite, states: PieceSource, *, verify: bool = False) -> torch.Tensor:
    """The output tensor of a transformed TensorWrite, in its output dtype, contiguous."""
    spec = tw.transform
    if isinstance(spec, ArchitectureOp):  # architecture conversions: whole sources in, one tensor out
        inputs = [read_source(source, states, verify=verify) for source in spec.inputs]
        # An exported adapter's own ops (a fused module's LoRA) or an architecture's conversion.
        made = apply_adapter_op(spec, inputs) if spec.op in ADAPTER_OPS else apply_transform(spec, inputs)
        return cast(made, tw.out_dtype, tw.name).contiguous()  # type: ignore[arg-type]
    if spec is None:
        raise CheckpointError(f"{tw.name}: no tensor transform to compute")
    expect = tw.layout if isinstance(spec.base, BaseModelSource) else None
    base = read_source(spec.base, states, verify=verify, expect=expect)
    if base is None:
        raise CheckpointError(f"{tw.name}: transform {spec.op!r} names no base tensor")
    result = _fuse(tw.name, spec, base, states, verify) if isinstance(spec, LoraFuse) else base
    return cast(result, tw.out_dtype, tw.name).contiguous()


def _fuse(name: str, spec: LoraFuse, base: torch.Tensor, states: PieceSource, verify: bool) -> torch.Tensor:
    def part(source: TensorSource | None) -> torch.Tensor | None:
        return read_source(source, states, verify=verify)

    if spec.param == "bias":
        lora_b_bias = part(spec.lora_B_bias)
        if lora_b_bias is None:
            raise CheckpointError(f"{name}: a LoRA bias fusion needs lora_B_bias")
        return fuse_bias(base, lora_b_bias, scaling=spec.scaling, module=spec.module)
    lora_a, lora_b = part(spec.lora_A), part(spec.lora_B)
    if lora_a is None or lora_b is None:
        raise CheckpointError(f"{name}: a LoRA fusion needs lora_A and lora_B")
    # Rounded once to the frozen weight's dtype (SPEC section 4); the dtype policy is applied after.
    return fuse_weight(
        base, lora_a, lora_b, scaling=spec.scaling, magnitude=part(spec.lora_magnitude_vector),
        rank=spec.rank, module=spec.module,
    )


def verify_transformed(tw: TensorWrite, written: torch.Tensor, states: PieceSource) -> None:
    """Round trip of a computed tensor: every source re-verified bit for bit, then the written bytes recomputed."""
    if tuple(written.shape) != tw.layout.shape:
        raise CheckpointError(f"{tw.name}: written shape {list(written.shape)} differs from {list(tw.layout.shape)}")
    if isinstance(tw.transform, ArchitectureOp) and tw.transform.op in QUANTIZED_OPS:
        from mergeflow.export.write.quantized import verify_quantized

        verify_quantized(tw, tw.transform, written, states)  # recomputed bit for bit, and within the fp8 bound
        return
    expected = transformed_tensor(tw, states, verify=True)
    if expected.dtype != written.dtype or not torch.equal(bits(expected), bits(written)):
        raise CheckpointError(f"{tw.name}: round trip failed, the written tensor differs from its recomputed value")
