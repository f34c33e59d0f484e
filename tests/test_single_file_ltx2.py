"""LTX-2's original single-file layout, proven by Diffusers' own reader (`from_single_file`).

A tiny LTX2VideoTransformer3DModel is written in Lightricks' layout by the map in
mergeflow/architectures/ltx2.py, read back by `LTX2VideoTransformer3DModel.from_single_file`
(which runs `convert_ltx2_transformer_to_diffusers`), and must come back bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import LTX2VideoTransformer3DModel
from diffusers.loaders.single_file_utils import CHECKPOINT_KEY_NAMES, convert_ltx2_transformer_to_diffusers
from safetensors.torch import load_file, save_file

from mergeflow.architectures import original_layout
from mergeflow.architectures.ltx2 import ORIGINAL
from mergeflow.demo.tiny_transformers import build_transformer
from mergeflow.errors import SchemaMismatchError

CLASS = "LTX2VideoTransformer3DModel"


def _shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


# Lightricks' own module names (LTX-2's reference model; ComfyUI's LTXAVModel uses the same), written
# out here independently of the map: Diffusers' converter leaves unknown names alone (a `norm_q` key
# would load as well as `q_norm`), so a round trip alone cannot pin the names ComfyUI needs.
_LIGHTRICKS_GLOBAL = (
    [f"{m}.{p}" for m in ("patchify_proj", "audio_patchify_proj", "proj_out", "audio_proj_out") for p in ("weight", "bias")]
    + [f"{m}.linear_{i}.{p}" for m in ("caption_projection", "audio_caption_projection") for i in (1, 2)
       for p in ("weight", "bias")]
    + [f"{m}.{layer}.{p}"
       for m in ("adaln_single", "audio_adaln_single", "av_ca_video_scale_shift_adaln_single",
                 "av_ca_audio_scale_shift_adaln_single", "av_ca_a2v_gate_adaln_single", "av_ca_v2a_gate_adaln_single")
       for layer in ("emb.timestep_embedder.linear_1", "emb.timestep_embedder.linear_2", "linear")
       for p in ("weight", "bias")]
    + ["scale_shift_table", "audio_scale_shift_table"]
)
_LIGHTRICKS_BLOCK = (
    [f"{a}.{n}.weight" for a in ("attn1", "audio_attn1", "attn2", "audio_attn2", "audio_to_video_attn",
                                 "video_to_audio_attn") for n in ("q_norm", "k_norm")]
    + [f"{a}.{n}.{p}" for a in ("attn1", "audio_attn1", "attn2", "audio_attn2", "audio_to_video_attn",
                                "video_to_audio_attn") for n in ("to_q", "to_k", "to_v", "to_out.0")
       for p in ("weight", "bias")]
    + [f"{f}.{n}.{p}" for f in ("ff", "audio_ff") for n in ("net.0.proj", "net.2") for p in ("weight", "bias")]
    + ["scale_shift_table", "audio_scale_shift_table", "scale_shift_table_a2v_ca_video", "scale_shift_table_a2v_ca_audio"]
)


def lightricks_keys(depth: int) -> set[str]:
    """The transformer keys of Lightricks' LTX-2 checkpoint at `depth` blocks."""
    keys = list(_LIGHTRICKS_GLOBAL) + [f"transformer_blocks.{i}.{k}" for i in range(depth) for k in _LIGHTRICKS_BLOCK]
    return {"model.diffusion_model." + k for k in keys}


@pytest.mark.parametrize(
    ("overrides", "dtype"),
    [({}, torch.float32), ({"num_layers": 3}, torch.float32), ({"num_layers": 2}, torch.bfloat16)],
    ids=["tiny-fp32", "three-layers-fp32", "two-layers-bf16"],
)
def test_from_single_file_reads_the_layout_back_bit_exact(tmp_path: Path, overrides: dict[str, Any],
                                                          dtype: torch.dtype) -> None:
    model = build_transformer(CLASS, seed=7, dtype=dtype, config_overrides=overrides)
    state = model.state_dict()
    original = original_layout.to_original_state_dict(ORIGINAL, state, dict(model.config))
    assert set(original) == lightricks_keys(model.config.num_layers)
    path = tmp_path / "ltx2.safetensors"
    save_file(original, str(path))
    config_dir = tmp_path / "config"
    model.save_config(str(config_dir))

    written = load_file(str(path))
    # Diffusers' LTX-2 detection (the `ltx2` branch of infer_diffusers_model_type) looks for these
    # keys; the transformer's own is the first. (infer_diffusers_model_type itself answers an
    # LTX-Video type for any LTX-2 transformer file, Lightricks' own included: its earlier
    # `ltx-video` branch matches `model.diffusion_model.patchify_proj.weight`.)
    assert CHECKPOINT_KEY_NAMES["ltx2"][0] in written
    # Every key of the file is consumed: the converter turns the file into exactly the model's keys.
    converted = convert_ltx2_transformer_to_diffusers(dict(written))
    assert set(converted) == set(state)

    loaded = LTX2VideoTransformer3DModel.from_single_file(str(path), config=str(config_dir),
                                                          local_files_only=True, torch_dtype=dtype)
    back = loaded.state_dict()
    assert set(back) == set(state)
    for key, tensor in state.items():
        assert back[key].dtype == tensor.dtype == dtype, key
        assert torch.equal(back[key], tensor), key


def test_the_plan_is_the_converters_exact_inverse_at_full_depth() -> None:
    # The released 19B config (Diffusers' defaults), on the meta device: names and shapes only.
    with torch.device("meta"):
        model = LTX2VideoTransformer3DModel()
    shapes = _shapes(model)
    plan = original_layout.checked_plan(ORIGINAL, shapes, ORIGINAL.params(dict(model.config)))
    assert len(plan) == len(shapes) == 3510
    assert {t.name for t in plan} == lightricks_keys(48)
    assert {t.op for t in plan} == {"rename"}
    # The converter only renames keys, so it can run on the names alone (value = its own key).
    converted = convert_ltx2_transformer_to_diffusers({t.name: t.name for t in plan})
    assert converted == {t.sources[0]: t.name for t in plan}


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ("drop", "transformer_blocks.1.audio_to_video_attn.to_k.weight"),
        ("drop", "transformer_blocks.0.ff.net.2.bias"),
        ("drop", "av_cross_attn_audio_v2a_gate.linear.weight"),
        ("extra", "transformer_blocks.0.attn1.to_gate_logits.weight"),
        ("extra", "prompt_adaln.linear.weight"),
    ],
)
def test_a_schema_that_does_not_fit_is_refused_by_name(change: str, named: str) -> None:
    shapes = _shapes(build_transformer(CLASS, seed=0, config_overrides={"num_layers": 2}))
    if change == "drop":
        assert named in shapes
        del shapes[named]
    else:
        shapes[named] = (3, 24)
    with pytest.raises(SchemaMismatchError, match=named.replace(".", r"\.")):
        original_layout.checked_plan(ORIGINAL, shapes, {})


def test_the_layout_is_registered_for_the_class() -> None:
    assert original_layout.layout_for(CLASS) is ORIGINAL
    assert ORIGINAL.architecture({}) == "ltx-2"
    assert ORIGINAL.implementation == "https://github.com/Lightricks/LTX-2"
