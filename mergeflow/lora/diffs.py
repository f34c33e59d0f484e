"""An extraction's changed tensors that no LoRA can carry, as ComfyUI `.diff` / `.diff_b` entries.

ComfyUI's comfy/lora.py `load_lora` adds `<x>.diff` to the model weight its key map names `x`, and
`<x>.diff_b` to that weight's `.bias`; its `model_lora_keys_unet` maps, for every tensor
`diffusion_model.<key>` of the model (the original layout's names), `diffusion_model.<key minus .weight>`
to a weight and `diffusion_model.<key>` to any other tensor (a norm's `.scale`, Wan's `modulation`),
besides each architecture's LoRA names (kohya's `lora_unet_<key with underscores>`).

So an entry is planned per tensor of the original single-file layout (mergeflow.architectures.<arch>,
the same map `--output_format single_file` writes) that holds a changed tensor:
- the bias of a LoRA'd linear: `<the module's LoRA stem>.diff_b` (a fused module's: its parts' bias
  diffs stacked in the layout's order, zero rows for an unchanged part; halves exchanged where the
  layout exchanges them);
- any other weight: `diffusion_model.<key minus .weight>.diff`, a bias of it: `....diff_b`;
- anything else: `diffusion_model.<key>.diff`.
The value is trained - base in float32, stored in the trained tensor's output dtype (what the
factors of a linear take). A bias of a linear the adapter has no LoRA for, and every changed tensor
of a naming whose Diffusers loader would refuse the file (LoraNaming.diff_refusal), are left out
and listed with the reason.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mergeflow.architectures.original_lora import (
    COMFY_MODEL_PREFIX,
    DIFF_BIAS_SUFFIX,
    DIFF_SUFFIX,
    LoraModule,
    naming_for,
)

NO_LORA_BIAS = "the bias of a linear the adapter has no LoRA for: no LoRA module to carry its .diff_b"
NOT_COMFYUI = "the {fmt} adapter format has no .diff entries (--adapter-format comfyui writes them)"


@dataclass(frozen=True)
class DiffEntry:
    """One `.diff` / `.diff_b` tensor of the file: its key, the original tensor it patches, how it is made."""

    key: str
    patches: str  # the original layout's key (ComfyUI's model tensor `diffusion_model.<patches>`)
    sources: tuple[str, ...]  # Diffusers tensors, in the layout op's order
    op: str  # rename / cat / swap_halves (mergeflow.architectures.original_layout.apply)


def _lora_stems(modules: Sequence[LoraModule]) -> dict[str, LoraModule]:
    """Diffusers module -> the file module whose LoRA holds it."""
    return {part: module for module in modules for part in module.parts}


def plan_diffs(transformer_class: str, fields: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]],
               changed: Collection[str], linear: Collection[str],
               lora_modules: Sequence[LoraModule]) -> tuple[list[DiffEntry], dict[str, str]]:
    """The entries for the changed non-linear-weight tensors, and why each one left out is left out."""
    from mergeflow.architectures.original_layout import checked_plan, layout_for

    naming = naming_for(transformer_class)
    if naming.diff_refusal is not None:
        return [], {name: naming.diff_refusal for name in changed}
    layout = layout_for(transformer_class)
    original = checked_plan(layout, shapes, layout.params(fields))
    names = {t.name for t in original}
    weight_of = {s: t.name for t in original for s in t.sources if s in linear}  # linear weight -> original key
    stems = _lora_stems(lora_modules)
    entries: list[DiffEntry] = []
    left: dict[str, str] = {}
    changed_set = set(changed)
    for tensor in original:
        if not changed_set & set(tensor.sources):
            continue
        modules = {s.removesuffix(".bias") for s in tensor.sources if s.endswith(".bias")}
        if tensor.name.endswith(".bias") and all(f"{m}.weight" in linear for m in modules) and modules:
            owners = {stems[m].stem if m in stems else None for m in modules}
            stem = owners.pop() if len(owners) == 1 else None
            lora = stems.get(next(iter(modules)))
            # The LoRA stem must name the same original weight as this bias (a fused module: the same fused one).
            weight = weight_of.get(f"{lora.parts[0]}.weight") if lora is not None else None
            if stem is None or weight != tensor.name.removesuffix(".bias") + ".weight":
                left.update({s: NO_LORA_BIAS for s in tensor.sources if s in changed_set})
                continue
            entries.append(DiffEntry(f"{stem}.{DIFF_BIAS_SUFFIX}", tensor.name, tensor.sources, tensor.op))
            continue
        if tensor.name.endswith(".weight"):
            key = f"{COMFY_MODEL_PREFIX}{tensor.name.removesuffix('.weight')}.{DIFF_SUFFIX}"
        elif tensor.name.endswith(".bias") and tensor.name.removesuffix(".bias") + ".weight" in names:
            key = f"{COMFY_MODEL_PREFIX}{tensor.name.removesuffix('.bias')}.{DIFF_BIAS_SUFFIX}"
        else:
            key = f"{COMFY_MODEL_PREFIX}{tensor.name}.{DIFF_SUFFIX}"
        entries.append(DiffEntry(key, tensor.name, tensor.sources, tensor.op))
    return entries, left


def is_diff_key(key: str) -> bool:
    return key.endswith((f".{DIFF_SUFFIX}", f".{DIFF_BIAS_SUFFIX}"))
