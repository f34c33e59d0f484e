"""Flux's original (BFL) single-file layout, proven by Diffusers' own single-file loader.

The file `to_original_state_dict` writes must be what `FluxTransformer2DModel.from_single_file`
reads back bit for bit, detected as the right model, with every key consumed by the converter.

Diffusers' converter (`convert_flux_transformer_checkpoint_to_diffusers`) hard-codes FLUX.1's
width: it splits `single_blocks.N.linear1` at `inner_dim = 3072` with `mlp_ratio = 4.0`, whatever
the config says, so no narrower Flux can be read back. The loader runs at FLUX.1's width (24 heads
x 128) with everything else tiny (depth 1-2, tiny in/text widths): the smallest Flux it reads
(~0.5 G parameters per 1+1 blocks, the cost of these tests). The key sets are proven against the
real converter on the meta device, at every depth up to FLUX.1's 19 + 38 blocks, in no time; the
narrow tiny configs check detection and refusals.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import FluxTransformer2DModel
from diffusers.loaders.single_file_utils import (
    convert_flux_transformer_checkpoint_to_diffusers,
    infer_diffusers_model_type,
)
from safetensors.torch import save_file

from mergeflow.architectures import original_layout
from mergeflow.architectures.flux import ORIGINAL
from mergeflow.demo.tiny_transformers import build_transformer
from mergeflow.errors import SchemaMismatchError

CLASS = "FluxTransformer2DModel"
# FLUX.1's width (what the converter assumes), everything else tiny. in_channels stays clear of
# 384 and 128, which infer_diffusers_model_type reads as Fill and Depth.
FLUX1_WIDTH: dict[str, Any] = {"num_attention_heads": 24, "attention_head_dim": 128, "axes_dims_rope": (16, 56, 56),
                               "in_channels": 4, "joint_attention_dim": 8, "pooled_projection_dim": 8}
# FLUX.1 [dev]'s published transformer config (schnell: guidance_embeds False).
FLUX1_FULL: dict[str, Any] = {**FLUX1_WIDTH, "in_channels": 64, "joint_attention_dim": 4096,
                              "pooled_projection_dim": 768, "num_layers": 19, "num_single_layers": 38}


def _variant(guidance: bool, depth: int) -> dict[str, Any]:
    return {"guidance_embeds": guidance, "num_layers": depth, "num_single_layers": depth}


def _expected_type(guidance: bool) -> str:
    return "flux-dev" if guidance else "flux-schnell"


@pytest.mark.parametrize(("guidance", "depth", "dtype"), [
    (True, 1, torch.float32),
    (False, 2, torch.bfloat16),
], ids=["dev-1x1-fp32", "schnell-2x2-bf16"])
def test_from_single_file_reads_the_bfl_file_back_bit_for_bit(
        tmp_path: Path, guidance: bool, depth: int, dtype: torch.dtype) -> None:
    model = build_transformer(CLASS, seed=depth, dtype=dtype, config_overrides={**FLUX1_WIDTH, **_variant(guidance, depth)})
    state = model.state_dict()
    original = original_layout.to_original_state_dict(ORIGINAL, state, dict(model.config))
    config_dir = tmp_path / "transformer"
    model.save_config(config_dir)
    del model  # `state` holds the parameters; the module is not needed (memory: ~2 GB a copy)

    assert infer_diffusers_model_type(original) == _expected_type(guidance)
    path = tmp_path / "flux.safetensors"
    save_file(original, str(path))
    del original
    # torch_dtype as any bf16 user passes it: without it the loader casts into an fp32 model.
    loaded = FluxTransformer2DModel.from_single_file(str(path), config=str(config_dir), local_files_only=True,
                                                     torch_dtype=dtype)
    loaded_state = loaded.state_dict()
    assert set(loaded_state) == set(state)
    for key, tensor in state.items():  # a tensor the file lacked would stay on the meta device: unequal
        assert loaded_state[key].dtype == tensor.dtype, key
        assert torch.equal(loaded_state[key], tensor), key


@pytest.mark.parametrize(("guidance", "depth"), [(True, 1), (False, 1), (True, 2), (False, 2), (True, 3)])
def test_the_converter_consumes_every_key_and_gives_back_the_diffusers_schema(guidance: bool, depth: int) -> None:
    # Meta tensors: the real converter runs on shapes alone, so FLUX.1's width costs nothing here.
    with torch.device("meta"):
        model = FluxTransformer2DModel(**{**FLUX1_WIDTH, **_variant(guidance, depth)})
    _assert_converter_round_trip(model)


@pytest.mark.parametrize("guidance", [True, False], ids=["dev", "schnell"])
def test_the_map_fits_flux1_at_real_depth(guidance: bool) -> None:
    with torch.device("meta"):
        model = FluxTransformer2DModel(**{**FLUX1_FULL, "guidance_embeds": guidance})
    original = _assert_converter_round_trip(model)
    assert {k.split(".")[1] for k in original if k.startswith("double_blocks.")} == {str(i) for i in range(19)}
    assert {k.split(".")[1] for k in original if k.startswith("single_blocks.")} == {str(i) for i in range(38)}
    assert original["single_blocks.37.linear1.weight"].shape == (3 * 3072 + 4 * 3072, 3072)
    assert original["double_blocks.18.txt_attn.qkv.bias"].shape == (3 * 3072,)
    assert ORIGINAL.architecture(dict(model.config)) == ("flux-1-dev" if guidance else "flux-1-schnell")


def _assert_converter_round_trip(model: FluxTransformer2DModel) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    original = original_layout.to_original_state_dict(ORIGINAL, state, dict(model.config))
    guidance = bool(model.config.guidance_embeds)
    assert ("guidance_in.in_layer.weight" in original) is guidance
    assert infer_diffusers_model_type(original) == _expected_type(guidance)
    # The converter pops every key it reads: an empty dict after it means the file has no key it ignores.
    left = dict(original)
    converted = convert_flux_transformer_checkpoint_to_diffusers(left)
    assert left == {}
    assert {k: tuple(v.shape) for k, v in converted.items()} == {k: tuple(v.shape) for k, v in state.items()}
    return original


@pytest.mark.parametrize(("guidance", "depth"), [(True, 1), (False, 1), (True, 2), (False, 2)])
def test_narrow_tiny_variants_are_detected_as_their_model(guidance: bool, depth: int) -> None:
    model = build_transformer(CLASS, seed=0, config_overrides=_variant(guidance, depth))
    state = model.state_dict()
    original = original_layout.to_original_state_dict(ORIGINAL, state, dict(model.config))
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    assert original_layout.original_shapes(ORIGINAL, shapes, {}) == {k: tuple(v.shape) for k, v in original.items()}
    assert infer_diffusers_model_type(original) == _expected_type(guidance)
    # Fused and exchanged tensors hold their sources' bytes where the converter takes them from.
    fused = original["double_blocks.0.txt_attn.qkv.weight"].chunk(3)
    for part, stem in zip(fused, ("add_q_proj", "add_k_proj", "add_v_proj"), strict=True):
        assert torch.equal(part, state[f"transformer_blocks.0.attn.{stem}.weight"])
    width = state["single_transformer_blocks.0.attn.to_q.weight"].shape[0]
    mlp = original[f"single_blocks.{depth - 1}.linear1.bias"][3 * width:]
    assert torch.equal(mlp, state[f"single_transformer_blocks.{depth - 1}.proj_mlp.bias"])
    shift, scale = original["final_layer.adaLN_modulation.1.weight"].chunk(2)
    assert torch.equal(torch.cat([scale, shift]), state["norm_out.linear.weight"])


@pytest.mark.parametrize(("change", "named"), [
    ("drop", "transformer_blocks.1.attn.to_k.bias"),  # a row block of a fused qkv
    ("drop", "single_transformer_blocks.0.proj_mlp.weight"),  # a row block of linear1
    ("drop", "time_text_embed.guidance_embedder.linear_2.bias"),  # a half-present guidance embedder
    ("drop_block", "transformer_blocks.0.norm1.linear.weight"),  # a whole block missing below the last
    ("drop_singles", "single_transformer_blocks"),  # no single block: the converter cannot count them
    ("add", "transformer_blocks.0.attn.to_extra.weight"),
    ("add", "norm_out.extra.bias"),
])
def test_a_schema_that_does_not_fit_the_map_is_refused_naming_the_tensor(change: str, named: str) -> None:
    model = build_transformer(CLASS, seed=0, config_overrides=_variant(True, 2))
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert original_layout.checked_plan(ORIGINAL, shapes, {})  # the intact schema fits
    if change == "drop":
        del shapes[named]
    elif change == "drop_block":
        shapes = {k: s for k, s in shapes.items() if not k.startswith("transformer_blocks.0.")}
    elif change == "drop_singles":
        shapes = {k: s for k, s in shapes.items() if not k.startswith("single_transformer_blocks.")}
    else:
        shapes[named] = (2, 2)
    with pytest.raises(SchemaMismatchError, match=named.replace(".", r"\.")):
        original_layout.checked_plan(ORIGINAL, shapes, {})


def test_modelspec_fields_follow_the_config() -> None:
    dev = dict(build_transformer(CLASS, seed=0).config)
    schnell = dict(build_transformer(CLASS, seed=0, config_overrides={"guidance_embeds": False}).config)
    assert (ORIGINAL.architecture(dev), ORIGINAL.architecture(schnell)) == ("flux-1-dev", "flux-1-schnell")
    assert ORIGINAL.resolution(dev) == "1024x1024"
    assert ORIGINAL.loader_kwargs(dev) == {}
    assert original_layout.layout_for(CLASS) is ORIGINAL
    assert original_layout.layout_named("flux") is ORIGINAL
