"""SD3 / SD3.5's original single-file layout, proven by Diffusers' own single-file loader.

Tiny models go through a real file and `SD3Transformer2DModel.from_single_file` bit for bit;
Diffusers tells the SD3 variants apart by real widths (9216-row modulation, 38 blocks, pos-embed
size), so detection is checked on the full-size models built on the meta device (shapes only).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from builders import assert_bit_exact
from diffusers import SD3Transformer2DModel
from diffusers.loaders.single_file_utils import (
    convert_sd3_transformer_checkpoint_to_diffusers,
    infer_diffusers_model_type,
)
from safetensors.torch import load_file, save_file

from mergeflow.architectures.original_layout import (
    checked_plan,
    layout_for,
    to_original_state_dict,
)
from mergeflow.architectures.sd3 import ORIGINAL, PREFIX
from mergeflow.demo.tiny_transformers import build_transformer
from mergeflow.errors import SchemaMismatchError

CLASS = "SD3Transformer2DModel"
SD3_MEDIUM_STYLE: dict[str, Any] = {"dual_attention_layers": (), "qk_norm": None}


def _consumed(original: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Diffusers' converter on a copy of the file's dict, which it must leave empty (it pops what it uses)."""
    left = dict(original)
    converted = convert_sd3_transformer_checkpoint_to_diffusers(left)
    assert not left, f"keys the SD3 converter never reads: {sorted(left)[:5]}"
    return converted


@pytest.mark.parametrize(("overrides", "dtype"), [
    ({}, torch.float32),                 # SD3.5 style: dual attention in block 0, RMS qk-norm
    (SD3_MEDIUM_STYLE, torch.float32),   # SD3 medium style: neither
    ({}, torch.bfloat16),
], ids=["sd35-fp32", "sd3-fp32", "sd35-bf16"])
def test_from_single_file_reads_the_file_back_bit_exact(tmp_path: Path, overrides: dict[str, Any],
                                                         dtype: torch.dtype) -> None:
    model = build_transformer(CLASS, seed=3, config_overrides=overrides, dtype=dtype)
    state = model.state_dict()
    original = to_original_state_dict(ORIGINAL, state, dict(model.config))
    assert all(k.startswith(PREFIX) for k in original)
    assert len(original) < len(state)  # q/k/v really fused
    assert_bit_exact(state, _consumed(original))

    file = tmp_path / "sd3.safetensors"
    save_file(original, str(file))
    model.save_config(str(tmp_path))
    # Without torch_dtype from_single_file loads into the class's fp32 parameters (a bf16 file upcast).
    loaded = SD3Transformer2DModel.from_single_file(str(file), config=str(tmp_path), local_files_only=True,
                                                    torch_dtype=dtype, **ORIGINAL.loader_kwargs(dict(model.config)))
    assert_bit_exact(state, loaded.state_dict())
    assert set(load_file(str(file))) == set(original)


# The published configs (the -diffusers repos' transformer/config.json); their parameter counts are
# SD3 medium 2.08B, SD3.5 medium 2.47B, SD3.5 large 8.15B.
_MEDIUM: dict[str, Any] = {"sample_size": 128, "patch_size": 2, "in_channels": 16, "num_layers": 24,
                           "attention_head_dim": 64, "num_attention_heads": 24, "joint_attention_dim": 4096,
                           "caption_projection_dim": 1536, "pooled_projection_dim": 2048, "out_channels": 16,
                           "pos_embed_max_size": 192}
FULL_SIZE: dict[str, tuple[dict[str, Any], str]] = {
    "sd3": (_MEDIUM, "stable-diffusion-v3-medium"),
    "sd35_medium": ({**_MEDIUM, "pos_embed_max_size": 384, "qk_norm": "rms_norm",
                     "dual_attention_layers": tuple(range(13))}, "stable-diffusion-v3.5-medium"),
    "sd35_large": ({**_MEDIUM, "num_layers": 38, "num_attention_heads": 38, "caption_projection_dim": 2432,
                    "qk_norm": "rms_norm"}, "stable-diffusion-v3.5-large"),
}


@pytest.mark.parametrize("model_type", sorted(FULL_SIZE))
def test_full_size_file_is_detected_and_converted_back(model_type: str) -> None:
    config, architecture = FULL_SIZE[model_type]
    with torch.device("meta"):
        model = SD3Transformer2DModel(**config)
    state = model.state_dict()
    original = to_original_state_dict(ORIGINAL, state, dict(model.config))
    # Detection picks the Hub config from_single_file loads when none is given: it must be this variant.
    assert infer_diffusers_model_type(original) == model_type
    converted = _consumed(original)
    assert {k: v.shape for k, v in converted.items()} == {k: v.shape for k, v in state.items()}
    assert ORIGINAL.architecture(dict(model.config)) == architecture
    assert layout_for(CLASS) is ORIGINAL


def _shapes(overrides: dict[str, Any] | None = None) -> dict[str, tuple[int, ...]]:
    model = build_transformer(CLASS, seed=0, config_overrides=overrides or {})
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def test_a_schema_missing_a_tensor_is_refused_by_name() -> None:
    shapes = _shapes()
    del shapes["transformer_blocks.0.attn2.to_k.bias"]  # the map still sees block 0's attn2
    with pytest.raises(SchemaMismatchError, match=r"transformer_blocks\.0\.attn2\.to_k\.bias"):
        checked_plan(ORIGINAL, shapes, {})


def test_a_schema_with_an_extra_tensor_is_refused_by_name() -> None:
    # The last block's context stream is pre-only: an output projection there has no original key.
    shapes = _shapes(SD3_MEDIUM_STYLE)
    shapes["transformer_blocks.1.attn.to_add_out.weight"] = (20, 20)
    with pytest.raises(SchemaMismatchError, match=r"transformer_blocks\.1\.attn\.to_add_out\.weight"):
        checked_plan(ORIGINAL, shapes, {})


def test_unequal_qkv_parts_are_refused() -> None:
    # The loader splits qkv into three equal row blocks: unequal parts would land in the wrong projection.
    shapes = _shapes()
    shapes["transformer_blocks.1.attn.to_v.weight"] = (30, 20)
    with pytest.raises(SchemaMismatchError, match=r"transformer_blocks\.1\.attn\.to_v\.weight"):
        checked_plan(ORIGINAL, shapes, {})
