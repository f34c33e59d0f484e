"""The extraction step of an export: every changed linear weight of a full checkpoint -> LoRA factors.

One tensor at a time: the trained tensor is reassembled from its pieces (and converted, where the
architecture converts), the base's tensor read from its safetensors file, dW = W_trained - W_base
taken in float32 and decomposed (mergeflow.lora.extract). The factors of each layer go to their own
small safetensors file in the export's work directory, so memory holds one layer's dW at most and
the adapter writer then streams and round-trip verifies them like any checkpoint tensor: to the
adapter outputs (PEFT, Diffusers, ComfyUI) an extraction looks like a LoRA checkpoint whose adapter
`default` has r = lora_alpha = the layer's rank on every changed linear.

Changed tensors that are not linear weights (norms, biases, embeddings, convs) cannot be a LoRA:
they are listed in the record with the norm of their change. With `--adapter-format comfyui` they
are also written as ComfyUI `.diff` / `.diff_b` entries where the architecture's loaders accept them
(mergeflow.lora.diffs): each one's float32 diff goes to a work file as it is met, and the file's
entries are composed from those once the factors are done.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mergeflow.architectures.conversions import convert_writes
from mergeflow.errors import (
    CheckpointError,
    InputChangedError,
    LoraError,
    SchemaMismatchError,
)
from mergeflow.export.reconstruct.rebuild import bits, plan_tensor_writes
from mergeflow.formats.safetensors_format import torch_dtype
from mergeflow.lora.config import AdapterSettings, peft_adapter_config
from mergeflow.lora.diffs import NOT_COMFYUI, plan_diffs
from mergeflow.lora.extract import ExtractSettings, LayerExtraction, extract_layer
from mergeflow.lora.fusion import read_source, transformed_tensor
from mergeflow.lora.keys import AdapterModuleKeys
from mergeflow.lora.plan import FULL_STATE, LoraPlan, ModuleLora
from mergeflow.outputs.registry import adapter_output
from mergeflow.records import CheckpointSource, MergePlan, TensorLayout, TensorWrite
from mergeflow.sources.base import PieceSource
from mergeflow.sources.registry import open_pieces

EXTRACTED_PREFIX = "extracted:"  # the factors' layout keys: never a checkpoint key (they hold no ':')
ADAPTER_NAME = "default"
WORK_DIR = "extract"
NOT_LINEAR = "not a linear weight: no LoRA can carry it"
NO_PLACE = "a linear weight the adapter format's naming has no place for"
WRITTEN = "not a linear weight: written as a ComfyUI .diff / .diff_b entry"


def _carried(plan: MergePlan, modules: list[str]) -> set[str]:
    """The linear modules the chosen adapter format can write (a ComfyUI naming: the blocks); the others are listed."""
    assert plan.extract is not None
    return adapter_output(plan.extract.adapter_format).carried_modules(plan.output.transformer_class, modules)


@dataclass(frozen=True)
class Extraction:
    """What the extraction step made: the adapter's plan, the factors' layouts and files, the record."""

    lora: LoraPlan
    layouts: dict[str, TensorLayout]  # the factors, keyed EXTRACTED_PREFIX + module + .lora_A / .lora_B
    files: dict[str, str]  # factor (and diff entry) layout key -> its work file
    record: dict[str, Any]  # lora_extraction.json


class ExtractedPieces:
    """The checkpoint's pieces plus the extracted factors (one piece each, read from their work file)."""

    def __init__(self, checkpoint: PieceSource, files: Mapping[str, str]) -> None:
        self.checkpoint = checkpoint
        self.files = dict(files)

    def local(self, rank: int, key: str) -> torch.Tensor:
        path = self.files.get(key)
        if path is None:
            return self.checkpoint.local(rank, key)
        from safetensors import safe_open

        try:
            with safe_open(path, framework="pt") as handle:
                return handle.get_tensor(key.rsplit(".", 1)[1])
        except (OSError, KeyError) as exc:
            raise InputChangedError(f"the extracted factors of {key} vanished from the work directory ({exc})") from None

    def local_in_place(self, rank: int, key: str) -> torch.Tensor:
        return self.local(rank, key) if key in self.files else self.checkpoint.local_in_place(rank, key)


_EMBEDDING_TABLES = frozenset({"embedding", "embeddings", "embed_tokens", "token_embedding", "position_embedding",
                               "wte", "wpe"})


def linear_weights(class_name: str, config_path: Path, names: list[str]) -> set[str]:
    """The `.weight` names among `names` that belong to an nn.Linear of the model (built on the meta device).

    A 2-D weight is not always a linear one (nn.Embedding): only PEFT's Linear LoRA keys are written.
    A class Diffusers lacks (remote code, which mergeflow never runs) falls back to the shape: every 2-D
    weight is taken as linear unless its module bears an embedding table's usual name (`x_embedder`, a
    patch projection, is a Linear; `embed_tokens` is not). A remote class with another nn.Embedding name
    would get a LoRA PEFT cannot load into it: such a class needs its own rule here.
    """
    import diffusers

    cls = getattr(diffusers, class_name, None)
    if cls is not None:
        from accelerate import init_empty_weights

        config = json.loads(config_path.read_text())
        with torch.random.fork_rng(devices=[]), init_empty_weights(include_buffers=False):
            model = cls.from_config(config)
        return {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    return {n for n in names if n.endswith(".weight") and n.removesuffix(".weight").split(".")[-1] not in _EMBEDDING_TABLES}


def _base_tensor(plan: MergePlan, name: str) -> torch.Tensor:
    assert plan.extract is not None
    file_name = plan.extract.base_weight_map.get(name)
    if file_name is None:
        raise SchemaMismatchError(f"the base model has no tensor {name}; the checkpoint was trained on a different model")
    from safetensors import safe_open

    path = Path(plan.base.component_dir) / file_name
    try:
        with safe_open(str(path), framework="pt") as handle:
            return handle.get_tensor(name)
    except (OSError, KeyError) as exc:
        raise InputChangedError(f"{name} cannot be read from base file {file_name} ({exc})") from None


def _trained_tensor(tw: TensorWrite, states: PieceSource) -> torch.Tensor:
    if tw.transform is not None:
        return transformed_tensor(tw, states)
    tensor = read_source(CheckpointSource(tw.layout), states)
    assert tensor is not None
    return tensor


def _factor_layout(key: str, tensor: torch.Tensor) -> TensorLayout:
    shape = tuple(tensor.shape)
    return TensorLayout(key, str(tensor.dtype).removeprefix("torch."), shape, None, ((0,),), (shape,))


def run_extraction(plan: MergePlan, layouts: dict[str, TensorLayout],
                   report: Callable[[int, int], None] | None = None) -> Extraction:
    """Every trained tensor against the base, one at a time; the changed linears' factors written to work files.

    `report(done, total)` follows the tensors compared (the task logs it: an SVD pass over a big model takes minutes).
    """
    from safetensors.torch import save_file

    spec = plan.extract
    if spec is None:
        raise LoraError("run_extraction called for an export without --extract-lora")
    settings = ExtractSettings.of(spec)
    writes = convert_writes(plan.conversion, plan_tensor_writes(plan, layouts))  # the base's names and shapes
    linear = linear_weights(plan.output.transformer_class, Path(plan.base.component_dir) / "config.json",
                            [w.name for w in writes])
    if not linear & {w.name for w in writes}:  # e.g. a base in a native layout whose names are not the class's
        raise SchemaMismatchError(f"no tensor of the checkpoint is a linear weight of {plan.output.transformer_class} "
                                  "by its Diffusers module name; extract against a base in the Diffusers layout")
    carried = _carried(plan, sorted(n.removesuffix(".weight") for n in linear))
    output = adapter_output(spec.adapter_format)
    work = Path(plan.output.work_dir) / WORK_DIR
    work.mkdir(parents=True, exist_ok=True)
    states = open_pieces(plan.checkpoint, trust_checkpoint=plan.options.trust_checkpoint)
    layers: list[LayerExtraction] = []
    other: list[dict[str, Any]] = []
    factor_layouts: dict[str, TensorLayout] = {}
    files: dict[str, str] = {}
    diffs: dict[str, tuple[str, str]] = {}  # changed non-linear tensor -> (its float32 diff's work file, out dtype)
    full_bytes = 0
    for done, tw in enumerate(writes, 1):
        if report is not None:
            report(done - 1, len(writes))
        trained = _trained_tensor(tw, states)
        base = _base_tensor(plan, tw.name)
        full_bytes += trained.numel() * torch_dtype(tw.out_dtype).itemsize
        if tuple(base.shape) != tuple(trained.shape):
            raise SchemaMismatchError(f"{tw.name} has shape {list(trained.shape)} in the checkpoint but "
                                      f"{list(base.shape)} in the base; extract against the base it was trained from")
        if base.dtype == trained.dtype and torch.equal(bits(base.contiguous()), bits(trained.contiguous())):
            continue  # unchanged: left out
        if not trained.is_floating_point():
            raise CheckpointError(f"{tw.name} ({trained.dtype}) differs from the base; an integer tensor cannot be extracted")
        delta = trained.to(torch.float32) - base.to(torch.float32)
        module = tw.name.removesuffix(".weight")
        if tw.name not in linear or delta.dim() != 2 or module not in carried:
            why = NOT_LINEAR if tw.name not in linear or delta.dim() != 2 else NO_PLACE
            other.append({"name": tw.name, "shape": list(delta.shape), "delta_norm": float(torch.linalg.norm(delta)),
                          "base_norm": float(torch.linalg.norm(base.to(torch.float32))), "reason": why,
                          "written_as": None})
            if why == NOT_LINEAR and output.carries_diffs():
                path = work / f"diff-{len(diffs):05d}.safetensors"
                save_file({"diff": delta.contiguous()}, str(path), metadata={"format": "pt"})
                diffs[tw.name] = (str(path), tw.out_dtype)
            continue
        # The factors take the weight's output dtype (--dtype, fp32-kept modules aside): what a trained LoRA would be.
        up, down, layer = extract_layer(module, delta, settings, torch_dtype(tw.out_dtype))
        del delta, trained, base
        path = work / f"{len(layers):05d}.safetensors"
        save_file({"lora_A": down, "lora_B": up}, str(path), metadata={"format": "pt"})
        for kind, tensor in (("lora_A", down), ("lora_B", up)):
            key = f"{EXTRACTED_PREFIX}{module}.{kind}"
            factor_layouts[key] = _factor_layout(key, tensor)
            files[key] = str(path)
        layers.append(layer)
    if not layers:
        raise LoraError("no linear weight of the checkpoint differs from the base: there is nothing to extract")
    entries: list[dict[str, Any]] = []
    diff_keys: dict[str, str] = {}
    if output.carries_diffs():
        entries = _write_diffs(plan, layers, other, linear, diffs, work, factor_layouts, files, diff_keys)
    else:
        for item in other:
            if item["reason"] == NOT_LINEAR:
                item["reason"] = NOT_COMFYUI.format(fmt=spec.adapter_format)
    lora = _lora_plan(plan, layers, diff_keys)
    adapter_bytes = sum(layout.numel * torch_dtype(layout.dtype).itemsize for key, layout in factor_layouts.items()
                        if key not in diff_keys.values())
    record = extraction_record(settings, layers, other, adapter_bytes, full_bytes, entries)
    return Extraction(lora, factor_layouts, files, record)


def _write_diffs(plan: MergePlan, layers: list[LayerExtraction], other: list[dict[str, Any]], linear: set[str],
                 diffs: Mapping[str, tuple[str, str]], work: Path, layouts: dict[str, TensorLayout],
                 files: dict[str, str], diff_keys: dict[str, str]) -> list[dict[str, Any]]:
    """The `.diff` / `.diff_b` entries, one tensor at a time: composed from the work files, stored, recorded."""
    import hashlib

    from safetensors import safe_open
    from safetensors.torch import save_file

    from mergeflow.architectures.original_layout import apply
    from mergeflow.architectures.original_lora import naming_for
    from mergeflow.architectures.schema import model_schema

    cls = plan.output.transformer_class
    config = json.loads((Path(plan.base.component_dir) / "config.json").read_text())
    shapes = dict(plan.output.expected_shapes)
    lora_modules = naming_for(cls).plan(sorted(layer.module for layer in layers))
    planned, left = plan_diffs(cls, model_schema(cls, config).fields, shapes, sorted(diffs), linear, lora_modules)
    by_name = {item["name"]: item for item in other}
    for name, why in left.items():
        by_name[name]["reason"] = why
    out: list[dict[str, Any]] = []
    for entry in planned:
        parts = []
        for source in entry.sources:
            if source in diffs:
                with safe_open(diffs[source][0], framework="pt") as handle:
                    parts.append(handle.get_tensor("diff"))
            else:  # an unchanged part of a fused tensor: a zero block
                parts.append(torch.zeros(shapes[source], dtype=torch.float32))
        exact = apply(entry.op, parts).contiguous()
        dtype = next(diffs[s][1] for s in entry.sources if s in diffs)
        stored = exact.to(torch_dtype(dtype)).contiguous()
        path = work / f"entry-{len(out):05d}.safetensors"
        suffix = entry.key.rsplit(".", 1)[1]
        save_file({suffix: stored}, str(path), metadata={"format": "pt"})
        layout_key = f"{EXTRACTED_PREFIX}{entry.key}"
        layouts[layout_key] = _factor_layout(layout_key, stored)
        files[layout_key] = str(path)
        diff_keys[entry.key] = layout_key
        for source in entry.sources:
            if source in by_name:
                by_name[source]["written_as"] = entry.key
                by_name[source]["reason"] = WRITTEN
        out.append({"key": entry.key, "patches": entry.patches, "sources": list(entry.sources), "op": entry.op,
                    "shape": list(stored.shape), "dtype": dtype, "delta_norm": float(torch.linalg.norm(exact)),
                    "max_abs_rounding": float((stored.to(torch.float32) - exact).abs().max()) if exact.numel() else 0.0,
                    "sha256": hashlib.sha256(bits(stored).numpy().tobytes()).hexdigest()})
    return sorted(out, key=lambda item: item["key"])


def _lora_plan(plan: MergePlan, layers: list[LayerExtraction], diff_keys: Mapping[str, str]) -> LoraPlan:
    """The adapter as a LoRA checkpoint's would be planned: r = lora_alpha per layer (scale 1), full module paths."""
    assert plan.extract is not None
    fmt = plan.extract.adapter_format
    r = max(layer.rank for layer in layers)
    # Per-layer ranks (--extract-energy) go to PEFT's rank_pattern / alpha_pattern. PEFT matches a key as
    # `(.*\.)?(KEY)$`, so a plain `proj_out` would also give its rank to `blocks.0.proj_out`: anchored, escaped.
    pattern = {"^" + re.escape(layer.module): layer.rank for layer in layers if layer.rank != r}
    settings = AdapterSettings(r=r, lora_alpha=float(r), rank_pattern=pattern,
                               alpha_pattern={k: float(v) for k, v in pattern.items()})
    keys = {layer.module: AdapterModuleKeys(layer.module, ADAPTER_NAME, f"{EXTRACTED_PREFIX}{layer.module}.lora_A",
                                            f"{EXTRACTED_PREFIX}{layer.module}.lora_B") for layer in layers}
    modules = tuple(ModuleLora(layer.module, "linear", layer.rank, 1.0, keys[layer.module].sources()) for layer in layers)
    # Full module paths, not PEFT's usual last names: an unchanged module of the same name is no target.
    config = peft_adapter_config(settings, sorted(keys), plan.extract.base_model_name_or_path)
    return LoraPlan(
        adapter_name=ADAPTER_NAME, excluded_adapters=(), layout=FULL_STATE, fuse=False, adapter_format=fmt,
        base_weights=None, r=r, lora_alpha=float(r), scaling=1.0, settings_origin="--extract-lora",
        modules=modules, adapter_keys=adapter_output(fmt).adapter_keys(ADAPTER_NAME, keys, {}), adapter_config=config,
        diff_keys=dict(sorted(diff_keys.items())),
    )


def extraction_record(settings: ExtractSettings, layers: list[LayerExtraction], other: list[dict[str, Any]],
                      adapter_bytes: int, full_bytes: int, diffs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """lora_extraction.json: the method, every layer (worst retained first), the diff entries, the overall figures."""
    ordered = sorted(layers, key=lambda layer: (layer.retained, layer.module))
    weight = sum(layer.delta_norm ** 2 for layer in layers)
    mean = sum(layer.retained * layer.delta_norm ** 2 for layer in layers) / weight if weight else 1.0
    diffs = diffs or []
    left_out = [item for item in other if item.get("written_as") is None]
    return {
        "method": {**settings.record(), "diffs": "trained - base in float32, stored in the tensor's output dtype"},
        "layers": [layer.to_json() for layer in ordered],
        "not_extracted": sorted(other, key=lambda item: (-item["delta_norm"], item["name"])),
        "diffs": diffs,
        "summary": {"layers": len(layers), "adapter_factor_bytes": adapter_bytes, "full_model_bytes": full_bytes,
                    "size_ratio": adapter_bytes / full_bytes if full_bytes else 0.0,
                    "diff_entries": len(diffs),
                    # the norm of every change the adapter leaves out (neither a LoRA nor a .diff entry)
                    "not_extracted_delta_norm": math.sqrt(sum(item["delta_norm"] ** 2 for item in left_out)),
                    "energy_weighted_retained": mean,
                    "min_retained": ordered[0].retained, "max_abs_error": max(layer.max_abs_error for layer in layers)},
    }


def record_bytes(record: Mapping[str, Any]) -> bytes:
    """The record's bytes: sorted keys, indented, floats as Python writes them (repr round-trips)."""
    return (json.dumps(record, indent=2, sort_keys=True) + "\n").encode("utf-8")
