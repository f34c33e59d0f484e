"""MiniMax H3: export to the native package (converted) and to Diffusers' modular layout (unchanged)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures.minimax_h3 import (
    build_minimax_h3_modular,
    build_minimax_h3_native,
    native_tensor_shapes,
    reference_native_state_dict,
)
from pipeline_builders import (
    Exported,
    assert_copied_unchanged,
    assert_same_forward,
    assert_state_equal,
    export,
    make_actor,
    refused,
)
from safetensors.torch import load_file, save_file

import mergeflow.architectures.minimax_h3 as product_conversion
from mergeflow import validate_artifact
from mergeflow.demo.checkpoints import build_transformer
from mergeflow.errors import SchemaMismatchError

H3 = "MiniMaxH3Transformer3DModel"


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    root = tmp_path_factory.mktemp("h3_native")
    transformer = build_transformer(H3, seed=0)
    base = build_minimax_h3_native(root / "base", transformer)
    actor, actor_dir = make_actor(transformer, root)
    return Exported(base, actor_dir, actor)


def _cast_like_policy(state: dict[str, torch.Tensor], dtype: torch.dtype, keep: list[str]) -> dict[str, torch.Tensor]:
    """The dtype policy of SPEC section 5 applied to a Diffusers state dict."""
    return {k: v if any(m in k.split(".") for m in keep) else v.to(dtype) for k, v in state.items()}


@pytest.mark.parametrize("qkv_layout,dtype", [("interleaved", None), ("stacked", torch.bfloat16)], ids=["interleaved", "stacked-bf16"])
def test_native_export_equals_the_reference_conversion(
    native: Exported, tmp_path: Path, prefect_server: Any, prefect_api: Any, qkv_layout: str, dtype: torch.dtype | None
) -> None:
    overrides: dict[str, Any] = {"qkv_layout": qkv_layout}
    if dtype is not None:
        overrides["dtype"] = "bfloat16"
    item = export(prefect_server, Exported(native.base, native.actor_dir, native.actor), tmp_path / "out", **overrides)
    assert item.out is not None
    manifest = item.manifest
    assert manifest["artifact_type"] == "minimax_h3_pipeline" and manifest["architecture"] == "MiniMaxH3Pipeline"
    assert manifest["tensor_directory"] == "transformer"
    assert manifest["config_transform"]["tensor_conversion"]["qkv_layout"] == qkv_layout
    written = load_file(item.out / "transformer" / "model.safetensors")
    native_config = json.loads((item.out / "transformer" / "config.json").read_text())
    assert set(written) == set(native_tensor_shapes(native_config))  # exactly the native schema
    state = native.actor.state_dict()
    if dtype is not None:
        state = _cast_like_policy(state, dtype, list(type(native.actor)._keep_in_fp32_modules))
    reference = reference_native_state_dict(state, dict(native.actor.config), qkv_layout=qkv_layout)
    assert set(reference) == set(written)
    for key, value in reference.items():
        assert _bits_equal(written[key], value), key
    assert written["rope.inv_freq"].dtype == torch.float32
    if dtype is not None:
        assert written["video_patch_proj.weight"].dtype == torch.float32  # proj_in stays float32
        assert written["blocks.0.attn.qkv_proj.weight"].dtype == torch.bfloat16
    assert_copied_unchanged(item)
    assert validate_artifact(item.out) == {"integrity": "passed", "architecture": "MiniMaxH3Pipeline"}


def test_native_weights_convert_back_and_run_like_the_actor(native: Exported, tmp_path: Path, prefect_server: Any, prefect_api: Any) -> None:
    from diffusers import MiniMaxH3Transformer3DModel
    from diffusers.loaders.single_file_utils import (
        convert_minimax_h3_transformer_checkpoint_to_diffusers,
    )

    item = export(prefect_server, Exported(native.base, native.actor_dir, native.actor), tmp_path / "out")
    assert item.out is not None
    written = load_file(item.out / "transformer" / "model.safetensors")
    back = convert_minimax_h3_transformer_checkpoint_to_diffusers(written, dict(native.actor.config), qkv_layout="interleaved")
    model = MiniMaxH3Transformer3DModel.from_config(native.actor.config)
    model.load_state_dict(back, strict=True)
    assert_state_equal(model, native.actor)
    assert_same_forward(model, native.actor)


def test_product_conversion_is_independent_of_the_reference() -> None:
    source = Path(product_conversion.__file__).read_text()
    assert "minimax_h3_reference" not in source and "fixtures" not in source


def _damaged_native_base(native: Exported, root: Path) -> Path:
    base = root / "base"
    shutil.copytree(native.base, base)
    return base


def test_native_base_with_another_rotary_schedule_is_refused(native: Exported, tmp_path: Path, prefect_server: Any, prefect_api: Any) -> None:
    base = _damaged_native_base(native, tmp_path)
    weights = base / "transformer" / "model.safetensors"
    state = load_file(weights)
    state["rope.inv_freq"] = torch.nextafter(state["rope.inv_freq"], torch.zeros(1))  # 1 ulp off
    save_file(state, str(weights), metadata={"format": "pt"})
    refused(prefect_server, Exported(base, native.actor_dir, native.actor), tmp_path / "out", SchemaMismatchError, "rope.inv_freq")


def test_native_base_with_another_config_is_refused(native: Exported, tmp_path: Path, prefect_server: Any, prefect_api: Any) -> None:
    base = _damaged_native_base(native, tmp_path)
    config_path = base / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    config["qk_norm_eps"] = 1e-6
    config_path.write_text(json.dumps(config, indent=2))
    refused(prefect_server, Exported(base, native.actor_dir, native.actor), tmp_path / "out", SchemaMismatchError,
            r"qk_norm_eps: checkpoint 1e-05 vs base 1e-06")


def test_native_base_missing_a_tensor_is_refused(native: Exported, tmp_path: Path, prefect_server: Any, prefect_api: Any) -> None:
    base = _damaged_native_base(native, tmp_path)
    weights = base / "transformer" / "model.safetensors"
    state = load_file(weights)
    del state["final_layer.norm.weight"]
    save_file(state, str(weights), metadata={"format": "pt"})
    refused(prefect_server, Exported(base, native.actor_dir, native.actor), tmp_path / "out", SchemaMismatchError,
            r"missing \['final_layer.norm.weight'\]")


def test_modular_export_loads_with_modular_pipeline(tmp_path: Path, prefect_server: Any, prefect_api: Any) -> None:
    from diffusers import ModularPipeline

    transformer = build_transformer(H3, seed=0)
    base = build_minimax_h3_modular(tmp_path / "base", transformer)
    # What ModularPipeline.save_pretrained writes for a local save: the save directory in a spec.
    index_path = base / "modular_model_index.json"
    index = json.loads(index_path.read_text())
    index["transformer_ref"][2]["pretrained_model_name_or_path"] = str(base)
    index_path.write_text(json.dumps(index, indent=2))
    actor, actor_dir = make_actor(transformer, tmp_path)
    item = export(prefect_server, Exported(base, actor_dir, actor), tmp_path / "out")
    assert item.out is not None
    assert item.manifest["artifact_type"] == "diffusers_pipeline"
    assert item.manifest["architecture"] == "MiniMaxH3ModularPipeline"
    assert item.manifest["config_transform"]["removed_keys"] == {
        "modular_model_index.json": ["transformer_ref.pretrained_model_name_or_path"]
    }
    assert not (item.out / "model_index.json").exists()
    assert_copied_unchanged(item)  # transformer_ref, schedulers, VAEs, text side: byte for byte
    pipe = ModularPipeline.from_pretrained(str(item.out), local_files_only=True)
    assert type(pipe).__name__ == "MiniMaxH3ModularPipeline"
    for name in ("transformer", "transformer_ref"):  # both resolve to the artifact's own copy
        assert pipe._component_specs[name].pretrained_model_name_or_path == str(item.out)
    pipe.load_components(names=["transformer", "transformer_ref"], dtype=torch.float32)
    assert_state_equal(pipe.transformer, actor)
    assert_same_forward(pipe.transformer, actor)
    reference_partition = ModularPipeline.from_pretrained(str(base), local_files_only=True)
    reference_partition.load_components(names=["transformer_ref"], dtype=torch.float32)
    assert_state_equal(pipe.transformer_ref, reference_partition.transformer_ref)
    assert validate_artifact(item.out)["architecture"] == "MiniMaxH3ModularPipeline"
