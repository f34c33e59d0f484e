"""LoRA files in the original (non-Diffusers) naming ComfyUI and Diffusers' converters read.

`--adapter-format comfyui` writes the selected adapter as one safetensors file named the way
each architecture's community loaders name it: kohya's `lora_unet_*` for Flux, `diffusion_model.`
+ the model authors' module names for Wan, Qwen-Image and LTX-2, Diffusers' own names for SD3.
Each architecture's map lives beside it (`mergeflow/architectures/<arch>_lora.py`, a
`LoraNaming`); this module holds what they share and the registry keyed by transformer class.

A naming's `plan` turns the adapted Diffusers modules into the file's modules. A file module is
either one Diffusers module renamed, or a fused module of the original layout (Flux's `qkv`):
its LoRA is then the exact block-structured LoRA of the fused weight (the writer's ops are in
mergeflow.lora.adapter_ops). `alpha` says whether the loaders read a per-module `.alpha` scalar;
where they do not, the module's scale is folded into its up and no alpha is written.

Module imports stay light (no torch): the pre-flight and `test` import the outputs registry.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mergeflow.architectures.class_plugins import plugin_for
from mergeflow.errors import LoraError


@dataclass(frozen=True)
class LoraModule:
    """One module of the file: its key stem, the Diffusers modules it holds (row order), how."""

    stem: str  # every key of the module is `<stem>.<down|up|alpha suffix>`
    parts: tuple[str, ...]  # Diffusers module names; more than one: a fused module
    alpha: bool = True  # the loaders read `<stem>.alpha`; False: the scale is folded into the up
    swap_halves: bool = False  # the up's row halves exchanged (a shift/scale order that differs)


@dataclass(frozen=True)
class LoraNaming:
    """One architecture's LoRA naming for ComfyUI (and Diffusers' `load_lora_weights`)."""

    name: str  # recorded in the file's header metadata: never renamed
    transformer_classes: tuple[str, ...]
    key_prefix: str  # every key of the file starts with it
    down: str  # key suffix of the down (A) matrix
    up: str  # key suffix of the up (B) matrix
    # The adapted Diffusers modules -> the file's modules; a module it cannot name raises LoraError.
    plan: Callable[[Sequence[str]], list[LoraModule]]
    # `.diff` / `.diff_b` entries (an extraction's changed norms, biases...): None where they are written,
    # else why not (the loader of this naming that would refuse a file holding them).
    diff_refusal: str | None = None


ALPHA_SUFFIX = "alpha"
DIFF_SUFFIX = "diff"  # ComfyUI's load_lora: `<x>.diff` is added to the weight key_map[x] names
DIFF_BIAS_SUFFIX = "diff_b"  # ... and `<x>.diff_b` to that weight's `.bias`
# ComfyUI's generic key map (comfy/lora.py model_lora_keys_unet): every model tensor `diffusion_model.<key>`
# is reachable as `diffusion_model.<key minus .weight>` (a weight) or `diffusion_model.<key>` (anything else).
COMFY_MODEL_PREFIX = "diffusion_model."

# Transformer class -> the module (under mergeflow.architectures) whose LORA_NAMING is its naming.
_NAMING_MODULES: dict[str, str] = {
    "FluxTransformer2DModel": "flux_lora",
    "WanTransformer3DModel": "wan_lora",
    "QwenImageTransformer2DModel": "qwen_image_lora",
    "LTX2VideoTransformer3DModel": "ltx2_lora",
    "SD3Transformer2DModel": "sd3_lora",
    "MiniMaxH3Transformer3DModel": "minimax_h3_lora",
}
# Classes with no ComfyUI LoRA naming that Diffusers' loaders read: the refusal says why.
NO_COMFYUI_LORA: dict[str, str] = {
    "BooguImageTransformer2DModel": "Boogu-Image has no ComfyUI LoRA loader; export --adapter-format peft",
}


def naming_for(transformer_class: str) -> LoraNaming:
    """The LoRA naming of a transformer class, or a refusal naming the classes that have one."""
    naming: LoraNaming = plugin_for(transformer_class, _NAMING_MODULES, NO_COMFYUI_LORA, "LORA_NAMING", LoraError,
                                    "--adapter-format comfyui has no LoRA naming")
    return naming


def naming_named(name: str) -> LoraNaming | None:
    """The naming a file's header recorded, None when no registered naming has that name."""
    for cls in _NAMING_MODULES:
        naming = naming_for(cls)
        if naming.name == name:
            return naming
    return None


def checked_plan(naming: LoraNaming, adapted: Sequence[str]) -> list[LoraModule]:
    """The naming's plan, proven to hold every adapted module exactly once under distinct stems."""
    plan = naming.plan(adapted)
    stems: set[str] = set()
    used: dict[str, str] = {}
    for module in plan:
        if module.stem in stems or not module.stem.startswith(naming.key_prefix):
            raise LoraError(f"the {naming.name} LoRA naming gives {module.stem} twice or outside {naming.key_prefix!r}")
        stems.add(module.stem)
        for part in module.parts:
            if part in used:
                raise LoraError(f"{part} would be written twice ({used[part]} and {module.stem})")
            used[part] = module.stem
    left = sorted(set(adapted) - set(used))
    if left:
        raise LoraError(f"the {naming.name} LoRA naming has no place for {', '.join(left[:3])}")
    return plan


def unnamed(naming: str, module: str, why: str = "") -> LoraError:
    """The refusal for an adapted module a naming cannot write."""
    reason = f" ({why})" if why else ""
    return LoraError(f"the adapter trains {module}, which the {naming} ComfyUI LoRA naming cannot carry{reason}; "
                     "retrain without it or export --adapter-format peft or diffusers")
