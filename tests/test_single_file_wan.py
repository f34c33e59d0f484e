"""Wan 2.1 / 2.2's original single-file layout, proven by Diffusers' own reader.

Each tiny WanTransformer3DModel is written in the Wan-AI layout by the product map, then read
back with `WanTransformer3DModel.from_single_file` (Diffusers' converter, no mocks): the model
it builds must hold the original's tensors bit for bit, every key of the file must be consumed,
and Diffusers must detect the file as a Wan transformer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import WanTransformer3DModel
from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES
from diffusers.loaders.single_file_utils import infer_diffusers_model_type
from safetensors import safe_open
from safetensors.torch import save_file

from mergeflow.architectures import original_layout
from mergeflow.architectures.original_layout import (
    checked_plan,
    layout_for,
    original_shapes,
)
from mergeflow.architectures.wan import ORIGINAL
from mergeflow.demo.tiny_transformers import TINY_TRANSFORMER_CONFIGS, build_transformer
from mergeflow.errors import SchemaMismatchError

WAN = "WanTransformer3DModel"
I2V = {"image_dim": 11, "added_kv_proj_dim": 36}  # added_kv_proj_dim = the width, as Wan 2.1 I2V-14B's 5120


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def _read(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__


def _shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "overrides,dtype",
    [({}, None), ({"num_layers": 3}, None), (I2V, None), ({}, torch.bfloat16)],
    ids=["t2v", "three-layers", "i2v", "t2v-bf16"],
)
def test_from_single_file_reads_back_the_exact_model(tmp_path: Path, overrides: dict[str, Any], dtype: torch.dtype | None) -> None:
    model = build_transformer(WAN, seed=7, dtype=dtype, config_overrides=overrides)
    state = model.state_dict()
    assert layout_for(WAN) is ORIGINAL
    file_state = original_layout.to_original_state_dict(ORIGINAL, state, dict(model.config))
    path = tmp_path / "wan.safetensors"
    save_file(file_state, str(path))
    model.save_config(tmp_path)
    written = _read(path)
    assert "head.modulation" in written and "blocks.0.norm3.weight" in written  # Wan-AI names, no prefix
    assert not any(k.startswith("model.diffusion_model.") for k in written)
    if overrides is I2V:
        assert {"img_emb.proj.1.weight", "blocks.0.cross_attn.k_img.weight", "blocks.0.cross_attn.norm_k_img.weight"} <= set(written)

    # Diffusers detects a Wan transformer (not VACE/Animate; the tiny width matches no release).
    assert infer_diffusers_model_type(written) == "wan-i2v-14B"
    # The converter from_single_file runs consumes every key of the file and yields exactly the model's.
    convert = SINGLE_FILE_LOADABLE_CLASSES[WAN]["checkpoint_mapping_fn"]
    assert set(convert(dict(written))) == set(state)

    loaded = WanTransformer3DModel.from_single_file(str(path), config=str(tmp_path), local_files_only=True)
    back = loaded.state_dict()
    assert set(back) == set(state)
    for key, value in state.items():
        # bf16: from_single_file without torch_dtype upcasts to float32, which is exact; the file
        # itself keeps the original dtypes (checked through the map below).
        assert _bits_equal(back[key], value.to(back[key].dtype)), key
        assert _bits_equal(back[key].to(value.dtype), value), key
    for tensor in checked_plan(ORIGINAL, _shapes(model), {}):
        assert _bits_equal(written[tensor.name], state[tensor.sources[0]]), tensor.name
    if dtype is not None:
        assert written["blocks.0.self_attn.q.weight"].dtype == torch.bfloat16
        assert written["head.modulation"].dtype == torch.float32  # Wan's keep-in-float32 modules stay


def test_flf2v_image_position_table_is_refused_by_name() -> None:
    # FLF2V's img_emb.emb_pos has no name in Diffusers' converter, so no file could be read back.
    model = build_transformer(WAN, seed=0, config_overrides={**I2V, "pos_embed_seq_len": 4})
    with pytest.raises(SchemaMismatchError, match=r"condition_embedder\.image_embedder\.pos_embed"):
        checked_plan(ORIGINAL, _shapes(model), {})


@pytest.mark.parametrize(
    "dropped",
    ["blocks.1.ffn.net.0.proj.bias", "blocks.0.attn2.norm_k.weight", "proj_out.bias", "scale_shift_table",
     "condition_embedder.image_embedder.norm2.weight"],
)
def test_a_missing_tensor_is_refused_by_name(dropped: str) -> None:
    shapes = _shapes(build_transformer(WAN, seed=0, config_overrides=I2V))
    assert len(original_shapes(ORIGINAL, shapes, {})) == len(shapes)
    del shapes[dropped]
    with pytest.raises(SchemaMismatchError, match=dropped.replace(".", r"\.")):
        checked_plan(ORIGINAL, shapes, {})


def test_a_missing_block_and_an_extra_tensor_are_refused_by_name() -> None:
    shapes = _shapes(build_transformer(WAN, seed=0, config_overrides={"num_layers": 3}))
    gap = {k: v for k, v in shapes.items() if not k.startswith("blocks.1.")}
    with pytest.raises(SchemaMismatchError, match=r"blocks\.1\.\* is missing"):
        checked_plan(ORIGINAL, gap, {})
    in_one = {**shapes, "blocks.2.attn1.to_qkv.weight": (108, 36)}  # in one block only
    with pytest.raises(SchemaMismatchError, match=r"blocks\.0\.attn1\.to_qkv\.weight is missing while blocks\.2\.attn1\.to_qkv\.weight"):
        checked_plan(ORIGINAL, in_one, {})
    in_all = {**shapes, **{f"blocks.{i}.attn1.to_qkv.weight": (108, 36) for i in range(3)}}  # no Wan-AI name
    with pytest.raises(SchemaMismatchError, match=r"no place for 3 tensor\(s\).*blocks\.0\.attn1\.to_qkv\.weight"):
        checked_plan(ORIGINAL, in_all, {})


REAL = {"patch_size": (1, 2, 2), "attention_head_dim": 128, "freq_dim": 256, "text_dim": 4096}


@pytest.mark.parametrize(
    "config,architecture,resolution",
    [
        ({**REAL, "num_attention_heads": 12, "in_channels": 16, "num_layers": 30}, "wan-2_1-text2video-1_3b", "832x480"),
        ({**REAL, "num_attention_heads": 40, "in_channels": 16, "num_layers": 40}, "wan-2_1-text2video-14b", "1280x720"),
        ({**REAL, "num_attention_heads": 40, "in_channels": 36, "num_layers": 40, "image_dim": 1280}, "wan-2_1-image2video-14b", None),
        ({**REAL, "num_attention_heads": 40, "in_channels": 36, "num_layers": 40, "image_dim": None}, "wan-2_2-image2video-14b", "1280x720"),
        ({**REAL, "num_attention_heads": 24, "in_channels": 48, "num_layers": 30}, "wan-2_2-ti2v-5b", "1280x704"),
        (dict(TINY_TRANSFORMER_CONFIGS[WAN]), "wan-2_1-text2video", None),
    ],
    ids=["2.1-t2v-1.3b", "2.1-t2v-14b", "2.1-i2v-14b", "2.2-i2v-a14b", "2.2-ti2v-5b", "tiny"],
)
def test_modelspec_architecture_and_resolution(config: dict[str, Any], architecture: str, resolution: str | None) -> None:
    assert ORIGINAL.architecture(config) == architecture
    assert ORIGINAL.resolution(config) == resolution
    assert ORIGINAL.loader_kwargs(config) == {}
