"""LTX-2 (audio + video): Lightricks' original single-file layout of LTX2VideoTransformer3DModel.

The map is the exact inverse of Diffusers' `convert_ltx2_transformer_to_diffusers`
(single_file_utils.py, diffusers 0.42.1), which only renames keys (no fused or split tensor):

- every key carries Lightricks' `model.diffusion_model.` prefix. The converter strips it, Diffusers'
  detection needs it (`CHECKPOINT_KEY_NAMES["ltx2"]` lists
  `model.diffusion_model.av_ca_a2v_gate_adaln_single.emb.timestep_embedder.linear_1.weight`; without
  the prefix the file is not recognised as LTX-2), and ComfyUI strips it as the ldm/sgm prefix;
- the modules Diffusers renamed get their original names back: patchify projections, the AdaLN-single
  modulations (`time_embed` <- `adaln_single`, the four `av_ca_*_adaln_single`), the per-block a2v/v2a
  tables and the attentions' `q_norm`/`k_norm`; every other name is shared by both layouts.

What the Diffusers transformer lacks: Lightricks' checkpoint also holds the text connectors
(`video_embeddings_connector`, `audio_embeddings_connector`, which the converter drops: Diffusers keeps
them in the pipeline's `connectors` component) and the VAEs/vocoder; a transformer-only file has none.
ComfyUI's LTX-2 model holds the connectors too but skips them when its text encoder ran them (the text
encoder loader reads them, with `text_embedding_projection`, from Lightricks' own checkpoint).

Reading the file back with Diffusers needs `config=` (as every layout does here): diffusers 0.42.1's
`infer_diffusers_model_type` names an LTX-Video type for any LTX-2 transformer file, Lightricks' own
included, because its `ltx-video` branch (`model.diffusion_model.patchify_proj.weight`) comes before
the `ltx2` one.

The tensor set is that of LTX-2.0 (the released 19B): LTX-2.3's extra modules (`prompt_adaln`,
`to_gate_logits`, the prompt tables, keyframe embedding) have no rule in diffusers 0.42.1's converter
(Lightricks names `prompt_adaln_single` would not be renamed back), so the plan leaves them unplaced and
`checked_plan` refuses such a checkpoint by name rather than writing a file no loader reads.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from mergeflow.architectures.quantization import FP8Rule
from mergeflow.architectures.original_layout import (
    OriginalLayout,
    OriginalTensor,
    Shape,
)

PREFIX = "model.diffusion_model."

# Diffusers module -> Lightricks module, for the top-level modules the converter renames.
_TOP_RENAMES: dict[str, str] = {
    "proj_in": "patchify_proj",
    "audio_proj_in": "audio_patchify_proj",
    "time_embed": "adaln_single",
    "audio_time_embed": "audio_adaln_single",
    "av_cross_attn_video_scale_shift": "av_ca_video_scale_shift_adaln_single",
    "av_cross_attn_audio_scale_shift": "av_ca_audio_scale_shift_adaln_single",
    "av_cross_attn_video_a2v_gate": "av_ca_a2v_gate_adaln_single",
    "av_cross_attn_audio_v2a_gate": "av_ca_v2a_gate_adaln_single",
}
# Diffusers -> Lightricks names inside a transformer block.
_BLOCK_RENAMES: dict[str, str] = {
    "video_a2v_cross_attn_scale_shift_table": "scale_shift_table_a2v_ca_video",
    "audio_a2v_cross_attn_scale_shift_table": "scale_shift_table_a2v_ca_audio",
    "norm_q": "q_norm",
    "norm_k": "k_norm",
}

_ADALN = ("emb.timestep_embedder.linear_1", "emb.timestep_embedder.linear_2", "linear")
_LINEAR = ("weight", "bias")
_ATTENTIONS = ("attn1", "audio_attn1", "attn2", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn")


def _global_tensors() -> list[str]:
    """The Diffusers tensors outside the blocks (all always present in LTX-2.0)."""
    names = ["scale_shift_table", "audio_scale_shift_table"]
    for linear in ("proj_in", "audio_proj_in", "proj_out", "audio_proj_out"):
        names += [f"{linear}.{p}" for p in _LINEAR]
    for proj in ("caption_projection", "audio_caption_projection"):
        names += [f"{proj}.linear_{i}.{p}" for i in (1, 2) for p in _LINEAR]
    for adaln in ("time_embed", "audio_time_embed", "av_cross_attn_video_scale_shift",
                  "av_cross_attn_audio_scale_shift", "av_cross_attn_video_a2v_gate", "av_cross_attn_audio_v2a_gate"):
        names += [f"{adaln}.{layer}.{p}" for layer in _ADALN for p in _LINEAR]
    return names


def _block_weights() -> list[str]:
    """One block's tensors that every LTX-2 config has (relative to `transformer_blocks.{i}.`)."""
    names = ["scale_shift_table", "audio_scale_shift_table",
             "video_a2v_cross_attn_scale_shift_table", "audio_a2v_cross_attn_scale_shift_table"]
    for attn in _ATTENTIONS:
        names += [f"{attn}.{t}.weight" for t in ("norm_q", "norm_k", "to_q", "to_k", "to_v", "to_out.0")]
    for ff in ("ff", "audio_ff"):
        names += [f"{ff}.net.0.proj.weight", f"{ff}.net.2.weight"]
    return names


# One block's optional biases, by the config flag that switches the group on or off as a whole
# (attention_bias, attention_out_bias, ff_bias, audio_ff_bias): the names show which groups the
# checkpoint has, and a group is then required whole in every block, so a lost bias is caught.
_BLOCK_BIAS_GROUPS: dict[str, tuple[str, ...]] = {
    "attention_bias": tuple(f"{a}.{t}.bias" for a in _ATTENTIONS for t in ("to_q", "to_k", "to_v")),
    "attention_out_bias": tuple(f"{a}.to_out.0.bias" for a in _ATTENTIONS),
    "ff_bias": ("ff.net.0.proj.bias", "ff.net.2.bias"),
    "audio_ff_bias": ("audio_ff.net.0.proj.bias", "audio_ff.net.2.bias"),
}

_BLOCK_KEY = re.compile(r"transformer_blocks\.(\d+)\.(.+)")


def original_name(name: str) -> str:
    """Lightricks' key for one Diffusers tensor name (the inverse of the converter's renames)."""
    block = _BLOCK_KEY.fullmatch(name)
    if block is None:
        module, _, rest = name.partition(".")
        return PREFIX + ".".join(p for p in (_TOP_RENAMES.get(module, module), rest) if p)
    parts = [_BLOCK_RENAMES.get(p, p) for p in block.group(2).split(".")]
    return f"{PREFIX}transformer_blocks.{block.group(1)}.{'.'.join(parts)}"


def plan(shapes: Mapping[str, Shape], params: Mapping[str, Any]) -> list[OriginalTensor]:
    # The depth comes from the block indices in the names (48 for the released model); a block
    # missing in the middle shows up as tensors the checkpoint lacks.
    blocks = {m.group(1) for m in map(_BLOCK_KEY.fullmatch, shapes) if m}
    depth = 1 + max((int(b) for b in blocks), default=-1)
    relative = {m.group(2) for m in map(_BLOCK_KEY.fullmatch, shapes) if m}
    per_block = _block_weights()
    for group in _BLOCK_BIAS_GROUPS.values():
        if relative & set(group):
            per_block += group
    names = _global_tensors() + [f"transformer_blocks.{i}.{t}" for i in range(depth) for t in per_block]
    return [OriginalTensor(original_name(n), (n,)) for n in names]


ORIGINAL = OriginalLayout(
    name="ltx2",
    transformer_classes=("LTX2VideoTransformer3DModel",),
    plan=plan,
    # No ModelSpec registry entry exists for LTX-2; "ltx-2" is Lightricks' product name in the
    # lowercase-hyphen form the other layouts use ("qwen-image"), and what Diffusers' own
    # detection calls the family ("ltx2-dev" model type, Lightricks/LTX-2 repository).
    architecture=lambda config: "ltx-2",
    implementation="https://github.com/Lightricks/LTX-2",
    # No resolution: LTX-2 is trained at many resolutions and its config names none (base_height
    # and base_width are the RoPE grid's normalisation, not an output size).
    # --quantize fp8: the blocks' linear weights; modulation and norms stay bf16 (see quantization.py).
    fp8=FP8Rule(blocks=r"(model\.diffusion_model\.)?transformer_blocks\.\d+\.", keep=r"scale_shift|norm|adaln|gate"),
)
