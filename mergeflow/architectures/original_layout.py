"""The original single-file layouts: Diffusers tensor names -> the model authors' own keys.

`--output_format single_file` writes the trained transformer as one safetensors file in the
layout its authors published (BFL's Flux, Stability's MMDiT, Wan-AI's, Lightricks'...), which is
what ComfyUI and Diffusers' `from_single_file` read. Each architecture's key map lives beside the
architecture (`mergeflow/architectures/<name>.py`, an `OriginalLayout`); this module holds what
they share: the few tensor ops an original layout needs, the checks that a map covers the
Diffusers schema exactly, and the conversion adapter the writer runs.

An original layout is the exact inverse of Diffusers' `convert_*_to_diffusers`: every Diffusers
tensor lands in exactly one original tensor, whole (`rename`) or as a row block of a fused one
(`cat`), or with its two row halves exchanged (`swap_halves`: the final norm's shift/scale). The
ops only move bytes, so the file is bit-exact to the Diffusers export by construction, and each
row block of a fused tensor is re-verified against its source tensor when written.

Module imports stay light (no torch): the pre-flight and `test` import the registry.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from mergeflow.architectures.adapters import AdapterParams, ArchitectureAdapter
from mergeflow.architectures.class_plugins import plugin_for
from mergeflow.architectures.quantization import (
    FP8,
    FP8_DTYPE,
    OP_SCALE,
    OP_WEIGHT,
    QUANTIZE_PARAM,
    FP8Rule,
    quantized_keys,
    scale_key,
)
from mergeflow.errors import SchemaMismatchError

if TYPE_CHECKING:
    import torch

    from mergeflow.records import (
        ArchitectureOp,
        TensorLayout,
        TensorSource,
        TensorWrite,
    )

Shape = tuple[int, ...]
Op = Literal["rename", "cat", "swap_halves"]
OPS: tuple[str, ...] = ("rename", "cat", "swap_halves")


@dataclass(frozen=True)
class OriginalTensor:
    """One tensor of the original file: its key, the Diffusers tensors it is made of, and how."""

    name: str
    sources: tuple[str, ...]  # Diffusers keys, in the order the op takes them (row order for `cat`)
    op: Op = "rename"


@dataclass(frozen=True)
class OriginalLayout:
    """One architecture's original single-file layout.

    `params(config)` picks, from the transformer's full config (defaults filled in), the few
    values the map needs beyond the tensor shapes (recorded in the manifest; most maps need none).
    `plan(shapes, params)` maps the Diffusers schema (tensor -> shape) to the original file's
    tensors. `architecture(config)` is the ModelSpec `modelspec.architecture` value, and
    `resolution(config)` its native resolution where it has one (else None).
    """

    name: str  # recorded in the manifest: never renamed
    transformer_classes: tuple[str, ...]
    plan: Callable[[Mapping[str, Shape], Mapping[str, Any]], list[OriginalTensor]]
    architecture: Callable[[Mapping[str, Any]], str]
    implementation: str  # ModelSpec `modelspec.implementation`: where the reference code lives
    params: Callable[[Mapping[str, Any]], AdapterParams] = lambda config: {}
    resolution: Callable[[Mapping[str, Any]], str | None] = lambda config: None
    # Extra keyword arguments `from_single_file` needs to read this layout back (e.g. H3's qkv layout).
    loader_kwargs: Callable[[Mapping[str, Any]], dict[str, Any]] = lambda config: {}
    # Which tensors `--quantize fp8` stores as float8 (None: the layout offers no fp8 file).
    fp8: FP8Rule | None = None


# Transformer class -> the module (under mergeflow.architectures) whose ORIGINAL is its layout;
# imported on use.
_LAYOUT_MODULES: dict[str, str] = {
    "FluxTransformer2DModel": "flux",
    "SD3Transformer2DModel": "sd3",
    "WanTransformer3DModel": "wan",
    "LTX2VideoTransformer3DModel": "ltx2",
    "QwenImageTransformer2DModel": "qwen_image",
    "MiniMaxH3Transformer3DModel": "minimax_h3_single_file",
}
# A layout's recorded name is its module's, except where the module shares its architecture's name with another.
_RENAMED: dict[str, str] = {"minimax_h3": "minimax_h3_single_file"}
# Classes with no single-file loader anywhere: the refusal says why.
NO_SINGLE_FILE: dict[str, str] = {
    "BooguImageTransformer2DModel": "Boogu-Image has no single-file loader (neither Diffusers' from_single_file nor "
                                    "ComfyUI reads one); export --output_format pipeline or transformer",
}


def layout_for(transformer_class: str) -> OriginalLayout:
    """The original layout of a transformer class, or a refusal naming the classes that have one."""
    layout: OriginalLayout = plugin_for(transformer_class, _LAYOUT_MODULES, NO_SINGLE_FILE, "ORIGINAL",
                                        SchemaMismatchError, "--output_format single_file has no original layout")
    return layout


def layout_named(name: str) -> OriginalLayout:
    """The layout a plan or manifest recorded by name (its module's name unless _RENAMED says otherwise)."""
    module = _RENAMED.get(name, name)
    if module not in _LAYOUT_MODULES.values():
        raise SchemaMismatchError(f"unknown original layout {name!r}")
    layout: OriginalLayout = importlib.import_module(f"mergeflow.architectures.{module}").ORIGINAL
    if layout.name != name:
        raise SchemaMismatchError(f"mergeflow.architectures.{module} names its layout {layout.name!r}")
    return layout


def output_shape(tensor: OriginalTensor, shapes: Mapping[str, Shape]) -> Shape:
    """The shape of one original tensor from its sources' shapes (checked: they must fit the op)."""
    parts = [tuple(shapes[s]) for s in tensor.sources]
    if tensor.op == "cat":
        if len({p[1:] for p in parts}) != 1:
            raise SchemaMismatchError(f"{tensor.name}: {', '.join(tensor.sources)} differ past dim 0 and cannot be fused")
        return (sum(p[0] for p in parts), *parts[0][1:])
    if len(parts) != 1:
        raise SchemaMismatchError(f"{tensor.name}: a {tensor.op} takes one tensor, not {len(parts)}")
    if tensor.op == "swap_halves" and (not parts[0] or parts[0][0] % 2):
        raise SchemaMismatchError(f"{tensor.sources[0]} has no even row count: its halves cannot be exchanged")
    return parts[0]


def checked_plan(layout: OriginalLayout, shapes: Mapping[str, Shape], params: Mapping[str, Any]) -> list[OriginalTensor]:
    """The layout's plan, proven to use every Diffusers tensor exactly once and to name each key once."""
    plan = layout.plan(shapes, params)
    used: dict[str, str] = {}
    names: set[str] = set()
    for tensor in plan:
        if tensor.name in names:
            raise SchemaMismatchError(f"the {layout.name} layout names {tensor.name} twice")
        names.add(tensor.name)
        if tensor.op not in OPS:
            raise SchemaMismatchError(f"{tensor.name}: unknown op {tensor.op!r}")
        for source in tensor.sources:
            if source not in shapes:
                raise SchemaMismatchError(f"the {layout.name} layout needs {source}, which the checkpoint lacks")
            if source in used:
                raise SchemaMismatchError(f"{source} would be written twice ({used[source]} and {tensor.name})")
            used[source] = tensor.name
        output_shape(tensor, shapes)
    left = sorted(set(shapes) - set(used))
    if left:
        raise SchemaMismatchError(f"the {layout.name} original layout has no place for {len(left)} tensor(s) of the "
                                  f"checkpoint, e.g. {', '.join(left[:3])}: its config does not match the architecture's map")
    return plan


def original_shapes(layout: OriginalLayout, shapes: Mapping[str, Shape], params: Mapping[str, Any]) -> dict[str, Shape]:
    """The original file's exact tensor set (name -> shape), with an fp8 file's scale tensors."""
    out = {t.name: output_shape(t, shapes) for t in checked_plan(layout, shapes, params)}
    for key in fp8_keys(layout, out, params):
        out[scale_key(key)] = ()
    return out


def fp8_rule(layout: OriginalLayout) -> FP8Rule:
    if layout.fp8 is None:
        raise SchemaMismatchError(f"the {layout.name} layout declares no fp8 quantization rule")
    return layout.fp8


def fp8_keys(layout: OriginalLayout, original: Mapping[str, Shape], params: Mapping[str, Any]) -> list[str]:
    """The file keys stored as float8 (none unless the conversion's params say `quantize: fp8`)."""
    if params.get(QUANTIZE_PARAM) != FP8:
        return []
    return quantized_keys(fp8_rule(layout), {k: v for k, v in original.items()})


def key_map(layout: OriginalLayout, shapes: Mapping[str, Shape], params: Mapping[str, Any]) -> dict[str, list[list[Any]]]:
    """For the manifest: file key -> [[Diffusers key, first row, end row, swapped halves], ...].

    Rows are dim 0 of the file's tensor; `swapped` says the source's halves are exchanged there.
    """
    out: dict[str, list[list[Any]]] = {}
    for tensor in checked_plan(layout, shapes, params):
        row = 0
        entries: list[list[Any]] = []
        for source in tensor.sources:
            rows = tuple(shapes[source])[0] if shapes[source] else 1
            entries.append([source, row, row + rows, tensor.op == "swap_halves"])
            row += rows
        out[tensor.name] = entries
    return dict(sorted(out.items()))


def apply(op: str, inputs: list[torch.Tensor]) -> torch.Tensor:
    """The original tensor from its whole source tensors: bytes moved, never changed."""
    import torch

    if op == "cat":
        return torch.cat(inputs, dim=0)
    if op == "swap_halves":
        first, second = inputs[0].chunk(2, dim=0)
        return torch.cat([second, first], dim=0)
    if op == "rename":
        return inputs[0]
    raise SchemaMismatchError(f"unknown original-layout op {op!r}")


def to_original_state_dict(layout: OriginalLayout, state: Mapping[str, torch.Tensor],
                           config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """An in-memory Diffusers state dict in the original layout (tests and tools; exports stream instead)."""
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    return {t.name: apply(t.op, [state[s] for s in t.sources]).contiguous()
            for t in checked_plan(layout, shapes, layout.params(config))}


# --- the writer's side: a conversion adapter ---------------------------------------------------

LAYOUT_PARAM = "original_layout"  # the conversion parameter naming the layout


def _virtual(name: str, dtype: str, shape: Shape) -> TensorLayout:
    from mergeflow.records import TensorLayout

    # A transformed write's `layout` describes its output; its inputs travel in the transform spec.
    return TensorLayout(name, dtype, shape, None, (), ())


def _source(write: TensorWrite) -> TensorSource:
    # A tensor of the checkpoint, or a computed write's result (a fused LoRA weight): LoRA is
    # fused before the layout changes, as for MiniMax H3's native conversion.
    from mergeflow.records import CheckpointSource, ComputedSource

    return CheckpointSource(write.layout) if write.transform is None else ComputedSource(write)


def plan_original_writes(writes: list[TensorWrite], layout: OriginalLayout, params: Mapping[str, Any]) -> list[TensorWrite]:
    """The original file's writes from the checkpoint's (Diffusers-named) ones."""
    from mergeflow.records import ArchitectureOp, TensorWrite

    by_name = {w.name: w for w in writes}
    shapes = {w.name: tuple(w.layout.shape) for w in writes}
    planned = checked_plan(layout, shapes, params)
    quantized = set(fp8_keys(layout, {t.name: output_shape(t, shapes) for t in planned}, params))
    out: list[TensorWrite] = []
    for tensor in planned:
        parts = [by_name[s] for s in tensor.sources]
        if quantized:  # an fp8 file: every tensor not stored as float8 is bf16 (what ComfyUI's loader expects)
            parts = [_in_dtype(p, "bfloat16") for p in parts]
        first = parts[0]
        if tensor.op == "rename":
            made = TensorWrite(tensor.name, first.source_key, first.layout, first.out_dtype, first.transform)
        else:
            if len({p.out_dtype for p in parts}) != 1:
                raise SchemaMismatchError(f"{', '.join(tensor.sources)} would be written in different dtypes; "
                                          f"they cannot be fused into {tensor.name}")
            spec = ArchitectureOp(tensor.op, tuple(_source(p) for p in parts), {})
            shape = output_shape(tensor, shapes)
            made = TensorWrite(tensor.name, first.source_key, _virtual(tensor.name, first.out_dtype, shape),
                               first.out_dtype, spec)
        out.extend(_fp8_writes(made) if tensor.name in quantized else [made])
    return out


def _in_dtype(write: TensorWrite, dtype: str) -> TensorWrite:
    from dataclasses import replace

    if write.layout.dtype not in ("float32", "float16", "bfloat16", "float64"):
        return write
    if write.transform is not None and write.layout.shard_dim is None and not write.layout.chunk_ranks:
        # A computed write's layout describes its output: it follows the output dtype.
        return replace(write, out_dtype=dtype, layout=replace(write.layout, dtype=dtype))
    return replace(write, out_dtype=dtype)


def _fp8_writes(write: TensorWrite) -> list[TensorWrite]:
    """A quantized tensor's two writes: the float8 weight and its float32 scale, both computed from the
    bf16 original-layout tensor (`write`), which is never stored itself."""
    from mergeflow.records import ArchitectureOp, TensorWrite

    source = (_source(write),)
    params: dict[str, int | float | str | None] = {"source_dtype": write.out_dtype}
    weight = TensorWrite(write.name, write.source_key, _virtual(write.name, FP8_DTYPE, write.layout.shape), FP8_DTYPE,
                         ArchitectureOp(OP_WEIGHT, source, params))
    key = scale_key(write.name)
    scale = TensorWrite(key, write.source_key, _virtual(key, "float32", ()), "float32",
                        ArchitectureOp(OP_SCALE, source, params))
    return [weight, scale]


class OriginalLayoutConversion(ArchitectureAdapter):
    """The conversion `--output_format single_file` plans: Diffusers names -> an original layout.

    Selected by the output, never by a base (it has no native classes); its parameters name the
    layout (`original_layout`) beside the layout's own `params(config)`.
    """

    name: ClassVar[str] = "original_layout"
    instantiates_model: ClassVar[bool] = True
    ops: ClassVar[tuple[str, ...]] = ("cat", "swap_halves", OP_WEIGHT, OP_SCALE)

    def convert_writes(self, writes: list[TensorWrite], params: Mapping[str, Any]) -> list[TensorWrite]:
        return plan_original_writes(writes, layout_named(str(params[LAYOUT_PARAM])), params)

    def apply_op(self, spec: ArchitectureOp, inputs: list[torch.Tensor]) -> torch.Tensor:
        if spec.op in (OP_WEIGHT, OP_SCALE):
            from mergeflow.architectures.quantization import quantize, scale_of
            from mergeflow.export.reconstruct.rebuild import cast

            source = cast(inputs[0], str(spec.params["source_dtype"]), "a tensor to quantize")
            scale = scale_of(source)
            return scale if spec.op == OP_SCALE else quantize(source, scale)
        return apply(spec.op, inputs)

    def concatenates(self, spec: ArchitectureOp) -> bool:
        # Row blocks along dim 0 of row-major tensors: the fused tensor's bytes are its sources' bytes in order.
        return spec.op == "cat"


ORIGINAL_LAYOUT = OriginalLayoutConversion()
