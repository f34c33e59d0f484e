"""Wan 2.1 / Wan 2.2 (WanTransformer3DModel): the Wan-AI original single-file layout.

The exact inverse of Diffusers' `convert_wan_transformer_to_diffusers` (single_file_utils.py),
which only renames keys: no tensor is fused, split, transposed or reshaped for this class (its
split/reshape handlers serve Wan-Animate's face adapter and motion encoder, which are
WanAnimateTransformer3DModel's), so every tensor is a `rename`. Its one subtlety is the block
norms: Wan-AI's `norm3` is the cross-attention norm (the only block norm with weights), which
Diffusers calls `norm2`; the converter swaps the two names through a placeholder.

Keys are written without a prefix, as Wan-AI publishes them. ComfyUI's Wan checkpoints use the
same names, bare in the repackaged diffusion_models files; the converter strips an optional
`model.diffusion_model.` prefix and ComfyUI detects either, so neither reader needs one.

Wan 2.2 uses the same class and names (A14B: two such transformers, one file each; TI2V-5B:
48 latent channels). A tensor the converter has no name for (FLF2V's image position table,
Wan-AI's `img_emb.emb_pos`, which the converter leaves unrenamed) is left out of the plan, so
checked_plan refuses such a model by name: no file of it could be read back by Diffusers.
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
from mergeflow.errors import SchemaMismatchError

# Diffusers module -> Wan-AI module, for the modules outside the blocks (weight and bias alike).
_TOP_MODULES: dict[str, str] = {
    "patch_embedding": "patch_embedding",
    "condition_embedder.time_embedder.linear_1": "time_embedding.0",
    "condition_embedder.time_embedder.linear_2": "time_embedding.2",
    "condition_embedder.text_embedder.linear_1": "text_embedding.0",
    "condition_embedder.text_embedder.linear_2": "text_embedding.2",
    "condition_embedder.time_proj": "time_projection.1",
    # I2V (config image_dim): the CLIP image embedder, Wan-AI's nn.Sequential `img_emb.proj`.
    "condition_embedder.image_embedder.norm1": "img_emb.proj.0",
    "condition_embedder.image_embedder.ff.net.0.proj": "img_emb.proj.1",
    "condition_embedder.image_embedder.ff.net.2": "img_emb.proj.3",
    "condition_embedder.image_embedder.norm2": "img_emb.proj.4",
    "proj_out": "head.head",
}
# Bare parameters (no .weight/.bias): the output head's shift/scale, same order in both layouts.
_TOP_PARAMS: dict[str, str] = {"scale_shift_table": "head.modulation"}

_ATTENTION: dict[str, str] = {
    "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "o", "norm_q": "norm_q", "norm_k": "norm_k",
}
# The I2V image keys/values live in the cross-attention only (config added_kv_proj_dim).
_IMAGE_ATTENTION: dict[str, str] = {"add_k_proj": "k_img", "add_v_proj": "v_img", "norm_added_k": "norm_k_img"}

# Diffusers module -> Wan-AI module inside `blocks.N.`.
_BLOCK_MODULES: dict[str, str] = {
    **{f"attn1.{d}": f"self_attn.{o}" for d, o in _ATTENTION.items()},
    **{f"attn2.{d}": f"cross_attn.{o}" for d, o in {**_ATTENTION, **_IMAGE_ATTENTION}.items()},
    "norm2": "norm3",  # the converter's norm2 <-> norm3 swap, inverted
    "norm3": "norm2",  # (Diffusers' norm3 has no weights; kept so the swap reads whole)
    "ffn.net.0.proj": "ffn.0",
    "ffn.net.2": "ffn.2",
}
_BLOCK_PARAMS: dict[str, str] = {"scale_shift_table": "modulation"}

_BLOCK_KEY = re.compile(r"blocks\.(\d+)\.(.+)")


def _module_param(name: str, modules: Mapping[str, str], params: Mapping[str, str]) -> str | None:
    """The Wan-AI name of one Diffusers parameter path (relative to its block, or top level)."""
    if name in params:
        return params[name]
    module, dot, param = name.rpartition(".")
    if dot and param in ("weight", "bias") and module in modules:
        return f"{modules[module]}.{param}"
    return None


def original_name(key: str) -> str | None:
    """The Wan-AI key of one Diffusers key, or None where the converter has no name for it."""
    block = _BLOCK_KEY.fullmatch(key)
    if block:
        inner = _module_param(block.group(2), _BLOCK_MODULES, _BLOCK_PARAMS)
        return None if inner is None else f"blocks.{block.group(1)}.{inner}"
    return _module_param(key, _TOP_MODULES, _TOP_PARAMS)


def _required_top(keys: list[str]) -> list[str]:
    """The top-level tensors every Wan transformer has (the image embedder's whole when it has one)."""
    image = any(k.startswith("condition_embedder.image_embedder.") for k in keys)
    modules = [m for m in _TOP_MODULES if image or not m.startswith("condition_embedder.image_embedder.")]
    return [*_TOP_PARAMS, *(f"{m}.{p}" for m in modules for p in ("weight", "bias"))]


def _check_complete(keys: list[str]) -> None:
    """The fixed top-level tensors are there and every block holds the same tensors, blocks
    numbered 0..N-1: a missing tensor (which a name-driven plan would otherwise just leave out
    of the file) is refused by name."""
    blocks: dict[int, set[str]] = {}
    for key in keys:
        match = _BLOCK_KEY.fullmatch(key)
        if match:
            blocks.setdefault(int(match.group(1)), set()).add(match.group(2))
    if not blocks:
        raise SchemaMismatchError("the wan layout found no transformer blocks (blocks.N.*) in the checkpoint")
    if sorted(blocks) != list(range(len(blocks))):
        missing = sorted(set(range(max(blocks) + 1)) - set(blocks))
        raise SchemaMismatchError(f"the checkpoint's Wan blocks are not numbered 0..{max(blocks)}: blocks.{missing[0]}.* is missing")
    missing_top = sorted(set(_required_top(keys)) - set(keys))
    if missing_top:
        raise SchemaMismatchError(f"{missing_top[0]} is missing: every Wan transformer has it")
    every: set[str] = set().union(*blocks.values())
    for name in sorted(every):
        have = [i for i in sorted(blocks) if name in blocks[i]]
        if len(have) != len(blocks):
            lack = next(i for i in sorted(blocks) if name not in blocks[i])
            raise SchemaMismatchError(f"blocks.{lack}.{name} is missing while blocks.{have[0]}.{name} is there: "
                                      f"Wan blocks all hold the same tensors")


def plan(shapes: Mapping[str, Shape], params: Mapping[str, Any]) -> list[OriginalTensor]:
    # Driven by the names alone (any depth); a key with no Wan-AI name is left out, and
    # checked_plan then refuses the checkpoint naming it.
    keys = sorted(shapes)
    _check_complete(keys)
    out: list[OriginalTensor] = []
    for key in keys:
        name = original_name(key)
        if name is not None:
            out.append(OriginalTensor(name, (key,)))
    return out


def _width(config: Mapping[str, Any]) -> int:
    return int(config["num_attention_heads"]) * int(config["attention_head_dim"])


# Released widths -> ModelSpec size suffix (1.3B: 1536, Wan 2.2 TI2V-5B: 3072, 14B: 5120).
_SIZES: dict[int, str] = {1536: "1_3b", 3072: "5b", 5120: "14b"}


def architecture(config: Mapping[str, Any]) -> str:
    """SwarmUI's ModelSpec ids, the ones single-file tools read (e.g. wan-2_1-text2video-14b).

    From the config: 48 input channels is Wan 2.2's VAE latent (TI2V-5B); image_dim set is
    Wan 2.1 I2V (the CLIP image branch); 36 input channels without it is Wan 2.2 I2V-A14B (the
    image latent concatenated, no CLIP); else text-to-video (Wan 2.2 T2V-A14B has exactly Wan
    2.1 T2V-14B's architecture, and SwarmUI classes it so). The size comes from the width; a
    width no release has (a test model) gets no size suffix rather than a wrong one.
    """
    size = _SIZES.get(_width(config))
    suffix = f"-{size}" if size else ""
    in_channels = int(config.get("in_channels", 16))
    if in_channels == 48:
        return f"wan-2_2-ti2v{suffix}"
    if config.get("image_dim"):
        return f"wan-2_1-image2video{suffix}"
    if in_channels == 36:
        return f"wan-2_2-image2video{suffix}"
    return f"wan-2_1-text2video{suffix}"


# Native resolutions (width x height) where the weights fix one; Wan 2.1 I2V-14B ships the
# same architecture at 480P and 720P, so there it is unknowable from the config.
_RESOLUTIONS: dict[str, str] = {
    "wan-2_1-text2video-1_3b": "832x480",
    "wan-2_1-text2video-14b": "1280x720",
    "wan-2_2-ti2v-5b": "1280x704",
    "wan-2_2-image2video-14b": "1280x720",
}


ORIGINAL = OriginalLayout(
    name="wan",
    transformer_classes=("WanTransformer3DModel",),
    plan=plan,
    architecture=architecture,
    # Wan 2.1's repository defines every key set above (Wan 2.2 reuses its WanModel, less img_emb).
    implementation="https://github.com/Wan-Video/Wan2.1",
    resolution=lambda config: _RESOLUTIONS.get(architecture(config)),
    # No loader_kwargs: `from_single_file(file, config=<transformer config>)` reads it. (Without
    # torch_dtype it loads float32, exactly; torch_dtype=bfloat16 would round the float32-kept
    # time embedder, modulations and norms, since Diffusers keeps them float32 only for float16.)
    # --quantize fp8: the blocks' linear weights; modulation and norms stay bf16 (see quantization.py).
    fp8=FP8Rule(blocks=r"blocks\.\d+\.", keep=r"modulation|norm"),
)
