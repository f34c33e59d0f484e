"""`--adapter-format comfyui`: one LoRA file in the naming ComfyUI and Diffusers' converters read.

`lora_comfyui.safetensors` (for ComfyUI's `models/loras/`), keyed as the trained architecture's
community LoRAs are: the per-architecture maps are `mergeflow.architectures.<arch>_lora`, looked
up by transformer class (mergeflow.architectures.original_lora). A renamed module's down and up are
the checkpoint's tensors, byte for byte; a fused module's (Flux's `qkv`) are computed by the
writer's adapter ops and re-verified against every source tensor. Where the loaders read a
per-module alpha it is written as `alpha = scale * rank`, so alpha / rank is PEFT's scale.

An extraction (--extract-lora) adds its `.diff` / `.diff_b` entries (mergeflow.lora.diffs) as they
were composed; `test` checks them against the extraction record (mergeflow.lora.extraction_check).

Refused before any write: DoRA (ComfyUI's `dora_scale` is dropped by Diffusers), lora_B biases,
modules_to_save, fused parts trained with different scales, and modules a naming cannot carry.
The header records the naming (`mergeflow_lora_naming`), which `test` checks the keys against.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from mergeflow.architectures.original_lora import (
    ALPHA_SUFFIX,
    COMFY_MODEL_PREFIX,
    LoraModule,
    LoraNaming,
    checked_plan,
    naming_for,
    naming_named,
)
from mergeflow.errors import ArtifactInvalidError, LoraError
from mergeflow.lora.diffs import is_diff_key
from mergeflow.lora.extract_spec import EXTRACTION_NAME
from mergeflow.outputs.lora_adapter import AdapterOutput

if TYPE_CHECKING:
    from pathlib import Path

    from mergeflow.formats.manifest import ManifestDocument
    from mergeflow.lora.keys import AdapterModuleKeys
    from mergeflow.lora.plan import LoraPlan, ModuleLora
    from mergeflow.records import MergePlan, TensorLayout, TensorWrite

COMFYUI_LORA_WEIGHTS_NAME = "lora_comfyui.safetensors"
NAMING_METADATA_KEY = "mergeflow_lora_naming"


class ComfyuiLora(AdapterOutput):
    name: ClassVar[str] = "comfyui_lora"
    option_value: ClassVar[str] = "comfyui"
    weights_name: ClassVar[str] = COMFYUI_LORA_WEIGHTS_NAME
    key_prefix: ClassVar[str] = ""  # per architecture: checked against the recorded naming

    def adapter_keys(self, adapter_name: str, modules: Mapping[str, AdapterModuleKeys],
                     saved: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
        if saved:
            raise LoraError(f"adapter {adapter_name!r} has modules_to_save ({', '.join(sorted(saved))}), which a "
                            "ComfyUI LoRA cannot carry; export it in PEFT format")
        for module, keys in sorted(modules.items()):
            if keys.lora_magnitude_vector is not None:
                raise LoraError(f"adapter {adapter_name!r} is DoRA ({module}), which Diffusers cannot load from a "
                                "ComfyUI LoRA (it drops dora_scale); export it in PEFT format")
            if keys.lora_B_bias is not None:
                raise LoraError(f"adapter {adapter_name!r} trains lora_B biases ({module}), which a ComfyUI LoRA "
                                "cannot carry; export it in PEFT format")
        return {}  # the writes are planned from the architecture's naming (adapter_writes)

    def header_metadata(self, adapter_config: Mapping[str, Any]) -> dict[str, str]:
        return {"format": "pt"}  # the naming is added per export (shard_metadata)

    def adapter_writes(self, plan: MergePlan, lora: LoraPlan, layouts: Mapping[str, TensorLayout]) -> list[TensorWrite]:
        from mergeflow.records import TensorWrite

        naming = naming_for(plan.output.transformer_class)
        by_module = {m.module: m for m in lora.modules}
        writes: list[TensorWrite] = []
        for module in checked_plan(naming, sorted(by_module)):
            writes.extend(_module_writes(plan, naming, module, by_module, layouts))
        if lora.diff_keys and naming.diff_refusal is not None:
            raise LoraError(f"the {naming.name} naming takes no .diff entries: {naming.diff_refusal}")
        taken = {w.name for w in writes}
        for key, source in sorted(lora.diff_keys.items()):
            if key in taken or not is_diff_key(key):
                raise LoraError(f"the diff entry {key} would clash with a LoRA key or is not a .diff key")
            # An extraction's diff, composed and stored in its dtype already: written as it is.
            writes.append(TensorWrite(key, layouts[source].key, layouts[source], layouts[source].dtype))
        return sorted(writes, key=lambda w: w.name)

    def carries_diffs(self) -> bool:
        return True  # ComfyUI's load_lora reads `<x>.diff` / `<x>.diff_b` (where the naming accepts them)

    def carried_modules(self, transformer_class: str, modules: list[str]) -> set[str]:
        # A full fine-tune also trains modules the naming has no key for (Flux's embedders): an extraction
        # lists those rather than refusing the whole adapter.
        naming = naming_for(transformer_class)
        carried = set()
        for module in modules:
            try:
                naming.plan([module])
            except LoraError:
                continue
            carried.add(module)
        return carried

    def shard_metadata(self, plan: MergePlan, lora: LoraPlan) -> dict[str, str]:
        return {**self.header_metadata({}), NAMING_METADATA_KEY: naming_for(plan.output.transformer_class).name}

    def check_metadata(self, file_name: str, metadata: dict[str, str]) -> None:
        super().check_metadata(file_name, metadata)
        if naming_named(str(metadata.get(NAMING_METADATA_KEY))) is None:
            raise ArtifactInvalidError(f"{file_name}: header names no known LoRA naming ({NAMING_METADATA_KEY})")

    def check_weights(self, root: Path, manifest: ManifestDocument) -> int:
        from mergeflow.formats.safetensors_format import read_header

        count = super().check_weights(root, manifest)
        entries, metadata, _ = read_header(root / self.weights_name)
        naming = naming_named(str(metadata.get(NAMING_METADATA_KEY)))
        if naming is None:  # check_metadata (in super's check) refuses this first
            raise ArtifactInvalidError(f"{self.weights_name}: header names no known LoRA naming")
        suffixes = (naming.down, naming.up, ALPHA_SUFFIX)
        # `.diff` entries only in an extraction (whose record lists each one: check_extraction compares them),
        # under the naming's prefix or ComfyUI's generic `diffusion_model.`, and never for a naming that refuses them.
        extracted = EXTRACTION_NAME in manifest["files"] and naming.diff_refusal is None
        for key in entries:
            if extracted and is_diff_key(key) and key.startswith((naming.key_prefix, COMFY_MODEL_PREFIX)):
                continue
            if not key.startswith(naming.key_prefix) or not key.endswith(tuple(f".{s}" for s in suffixes)):
                raise ArtifactInvalidError(f"{key} in {self.weights_name} is not a {naming.name} LoRA key")
        return count


def _virtual(name: str, dtype: str, shape: tuple[int, ...]) -> TensorLayout:
    from mergeflow.records import TensorLayout

    # A computed write's `layout` describes its output; its inputs travel in the op's sources.
    return TensorLayout(name, dtype, shape, None, (), ())


def _module_writes(plan: MergePlan, naming: LoraNaming, module: LoraModule, by_module: Mapping[str, ModuleLora],
                   layouts: Mapping[str, TensorLayout]) -> list[TensorWrite]:
    """The down, up and (where read) alpha of one file module."""
    from mergeflow.export.reconstruct.rebuild import output_dtype
    from mergeflow.records import ArchitectureOp, CheckpointSource, TensorWrite

    policy, keep = plan.options.dtype, plan.output.keep_fp32
    parts = [by_module.get(p) for p in module.parts]
    present = [p for p in parts if p is not None]
    scales = sorted({p.scaling for p in present})
    if len(scales) > 1:
        raise LoraError(f"{module.stem} fuses {', '.join(module.parts)}, whose LoRAs have different scales "
                        f"({', '.join(map(str, scales))}); one alpha cannot carry them")
    if len(module.parts) > 1 and any(p.layer != "linear" for p in present):
        raise LoraError(f"{module.stem} fuses non-linear layers, which a block-structured LoRA cannot")
    scale, rank = scales[0], sum(p.rank for p in present)
    down_key, up_key = f"{module.stem}.{naming.down}", f"{module.stem}.{naming.up}"
    downs = [layouts[p.sources["lora_A"]] for p in present]
    ups = [layouts[p.sources["lora_B"]] for p in present]
    dtype = output_dtype(down_key, downs[0].dtype, policy, keep)
    if len({d.dtype for d in downs + ups}) != 1:
        raise LoraError(f"{module.stem}: its parts' LoRA tensors differ in dtype and cannot be fused")
    writes = []
    fused = len(module.parts) > 1
    if fused:
        shape = (rank, *downs[0].shape[1:])
        spec = ArchitectureOp("lora_down", tuple(CheckpointSource(d) for d in downs), {})
        writes.append(TensorWrite(down_key, downs[0].key, _virtual(down_key, dtype, shape), dtype, spec))
    else:
        writes.append(TensorWrite(down_key, downs[0].key, downs[0], dtype))
    fold = 1.0 if module.alpha else scale
    if fused or fold != 1.0 or module.swap_halves:
        # Rows of every part from the model's schema: a part without a LoRA is a zero block.
        rows = [plan.output.expected_shapes[f"{p}.weight"][0] for p in module.parts]
        params: dict[str, int | float | str | None] = {
            "rows": ",".join(map(str, rows)), "present": ",".join("1" if p else "0" for p in parts),
            "scale": fold, "swap_halves": int(module.swap_halves)}
        spec = ArchitectureOp("lora_up", tuple(CheckpointSource(u) for u in ups), params)
        shape = (sum(rows), rank, *ups[0].shape[2:])
        writes.append(TensorWrite(up_key, ups[0].key, _virtual(up_key, dtype, shape), dtype, spec))
    else:
        writes.append(TensorWrite(up_key, ups[0].key, ups[0], dtype))
    if module.alpha:
        alpha_key = f"{module.stem}.{ALPHA_SUFFIX}"
        # alpha / rank is the scale the loaders apply: PEFT's alpha / r (or / sqrt(r) with rsLoRA) of each part.
        spec = ArchitectureOp("lora_alpha", (), {"value": scale * rank})
        writes.append(TensorWrite(alpha_key, downs[0].key, _virtual(alpha_key, "float32", ()), "float32", spec))
    return writes
