"""LTX-2's ComfyUI LoRA naming: `diffusion_model.` + Lightricks' module names, lora_A / lora_B.

What ComfyUI reads for LTX-2 and Diffusers' `_convert_non_diffusers_ltx2_lora_to_diffusers`
(LTX2LoraLoaderMixin, picked by `diffusion_model.` keys) converts: Lightricks' names are
Diffusers' except for a few renamed modules (`patchify_proj`, `adaln_single`, the audio/video
cross-attention modulations, `prompt_adaln_single`). That converter reads no `.alpha` (a
remaining one is refused as a non-LoRA key), so each module's scale is folded into its up and no
alpha is written; ComfyUI then takes scale 1 as well.
"""

from __future__ import annotations

from collections.abc import Sequence

from mergeflow.architectures.original_lora import LoraModule, LoraNaming, unnamed

PREFIX = "diffusion_model."

# Diffusers module-name component -> Lightricks' (the inverse of Diffusers' rename table).
_COMPONENTS = {
    "proj_in": "patchify_proj",
    "audio_proj_in": "audio_patchify_proj",
    "av_cross_attn_video_scale_shift": "av_ca_video_scale_shift_adaln_single",
    "av_cross_attn_video_a2v_gate": "av_ca_a2v_gate_adaln_single",
    "av_cross_attn_audio_scale_shift": "av_ca_audio_scale_shift_adaln_single",
    "av_cross_attn_audio_v2a_gate": "av_ca_v2a_gate_adaln_single",
    "prompt_adaln": "prompt_adaln_single",
    "audio_prompt_adaln": "audio_prompt_adaln_single",
}
_TOP = {"time_embed": "adaln_single", "audio_time_embed": "audio_adaln_single"}  # first component only
# Diffusers' own forward renames (substring replaces, in order), to prove each name round-trips.
_FORWARD = [
    ("patchify_proj", "proj_in"), ("audio_patchify_proj", "audio_proj_in"),
    ("av_ca_video_scale_shift_adaln_single", "av_cross_attn_video_scale_shift"),
    ("av_ca_a2v_gate_adaln_single", "av_cross_attn_video_a2v_gate"),
    ("av_ca_audio_scale_shift_adaln_single", "av_cross_attn_audio_scale_shift"),
    ("av_ca_v2a_gate_adaln_single", "av_cross_attn_audio_v2a_gate"),
    ("scale_shift_table_a2v_ca_video", "video_a2v_cross_attn_scale_shift_table"),
    ("scale_shift_table_a2v_ca_audio", "audio_a2v_cross_attn_scale_shift_table"),
    ("q_norm", "norm_q"), ("k_norm", "norm_k"),
    ("audio_prompt_adaln_single", "audio_prompt_adaln"), ("prompt_adaln_single", "prompt_adaln"),
]


def lightricks_name(module: str) -> str:
    parts = module.split(".")
    parts = [_TOP.get(parts[0], parts[0])] + parts[1:]
    return ".".join(_COMPONENTS.get(p, p) for p in parts)


def diffusers_name(original: str) -> str:
    """Diffusers' converter applied to one module name."""
    name = original
    for old, new in _FORWARD:
        name = name.replace(old, new)
    if name.startswith("adaln_single."):
        return name.replace("adaln_single.", "time_embed.", 1)
    if name.startswith("audio_adaln_single."):
        return name.replace("audio_adaln_single.", "audio_time_embed.", 1)
    return name


def plan(adapted: Sequence[str]) -> list[LoraModule]:
    out = []
    for module in adapted:
        original = lightricks_name(module)
        if diffusers_name(original + ".") != module + ".":
            raise unnamed("LTX-2", module, f"Diffusers would read {original} back as {diffusers_name(original)}")
        out.append(LoraModule(f"{PREFIX}{original}", (module,), alpha=False))
    return out


LORA_NAMING = LoraNaming(
    name="ltx2-diffusion-model",
    transformer_classes=("LTX2VideoTransformer3DModel",),
    key_prefix=PREFIX,
    down="lora_A.weight",
    up="lora_B.weight",
    plan=plan,
    diff_refusal=("LTX2LoraLoaderMixin.lora_state_dict refuses a file with a key lacking 'lora' "
                  "(`Invalid LoRA checkpoint`): a .diff entry would stop load_lora_weights reading the file"),
)
