"""Tiny offline bases (Wan, Wan2.2, LTX-2, MiniMax H3 modular/native, Boogu) load and run as the real thing."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # must precede the first huggingface_hub import

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures.boogu import (
    boogu_transformer_instance,
    build_boogu_pipeline,
    load_boogu_pipeline,
    load_boogu_transformer,
    remote_class,
)
from fixtures.minimax_h3 import (
    H3_TEXT_ENCODER_LAYERS,
    NATIVE_METADATA,
    build_minimax_h3_modular,
    build_minimax_h3_native,
    native_config_from_diffusers,
    native_tensor_shapes,
    reference_native_state_dict,
)
from fixtures.minimax_h3_reference import fuse_qkv, rope_inv_freq, swap_gate_value
from fixtures.pipelines_video import (
    build_ltx2_pipeline,
    build_wan_pipeline,
    tiny_ltx2_transformer,
    tiny_wan_transformer,
)
from fixtures.qwen3vl import load_qwen3vl_processor
from safetensors.torch import load_file

from mergeflow.demo.tiny_transformers import build_transformer
from mergeflow.errors import SchemaMismatchError

H3 = "MiniMaxH3Transformer3DModel"


def _load(root: Path) -> Any:
    from diffusers import DiffusionPipeline

    return DiffusionPipeline.from_pretrained(root, local_files_only=True)


def _assert_same_weights(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    expected = reference.state_dict()
    actual = model.state_dict()
    assert set(actual) == set(expected)
    for key, tensor in expected.items():
        assert actual[key].dtype == tensor.dtype, key
        assert torch.equal(actual[key], tensor), key


def _assert_no_local_path(root: Path) -> None:
    """No JSON of a fixture names the directory it was built in (configs get copied into outputs)."""
    for path in root.rglob("*.json"):
        assert str(root) not in path.read_text(encoding="utf-8"), path


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("video_bases")


# --- Wan / Wan2.2 --------------------------------------------------------------------------


def test_wan_base_loads_as_wan_pipeline_around_the_given_transformer(base: Path) -> None:
    transformer = build_transformer("WanTransformer3DModel", seed=0)  # the odd-sized fixture model
    root = build_wan_pipeline(base / "wan", transformer)
    pipe = _load(root)
    assert type(pipe).__name__ == "WanPipeline"
    assert type(pipe.text_encoder).__name__ == "UMT5EncoderModel"
    assert pipe.transformer_2 is None and pipe.config.boundary_ratio is None
    _assert_same_weights(pipe.transformer, transformer)
    # Every tiny component is sized from the transformer's config.
    assert pipe.text_encoder.config.d_model == transformer.config.text_dim
    assert pipe.vae.config.z_dim == transformer.config.in_channels
    assert (root / "LICENSE").is_file() and (root / "README.md").is_file()
    _assert_no_local_path(root)


def test_wan_base_is_deterministic(base: Path) -> None:
    transformer = build_transformer("WanTransformer3DModel", seed=0)
    first = build_wan_pipeline(base / "wan_a", transformer)
    second = build_wan_pipeline(base / "wan_b", transformer)
    files = sorted(p.relative_to(first) for p in first.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(second) for p in second.rglob("*") if p.is_file())
    for rel in files:
        assert (first / rel).read_bytes() == (second / rel).read_bytes(), rel


def test_wan22_base_keeps_transformer_2_and_options_and_runs(base: Path) -> None:
    high, low = tiny_wan_transformer(seed=0), tiny_wan_transformer(seed=1)
    root = build_wan_pipeline(base / "wan22", high, transformer_2=low, boundary_ratio=0.875, expand_timesteps=True)
    index = json.loads((root / "model_index.json").read_text())
    assert index["transformer_2"] == ["diffusers", "WanTransformer3DModel"]
    assert index["boundary_ratio"] == 0.875 and index["expand_timesteps"] is True
    pipe = _load(root)
    assert pipe.config.boundary_ratio == 0.875 and pipe.config.expand_timesteps is True
    _assert_same_weights(pipe.transformer, high)
    _assert_same_weights(pipe.transformer_2, low)
    frames = pipe(
        prompt="a cat", height=16, width=16, num_frames=5, num_inference_steps=2,
        guidance_scale=1.0, guidance_scale_2=1.0, output_type="pt",
        generator=torch.Generator().manual_seed(0),
    ).frames
    assert frames.shape == (1, 5, 3, 16, 16) and torch.isfinite(frames).all()


def test_wan_needs_transformer_2_and_boundary_ratio_together(base: Path) -> None:
    with pytest.raises(ValueError, match="together"):
        build_wan_pipeline(base / "wan_bad", tiny_wan_transformer(), boundary_ratio=0.5)


# --- LTX-2 -----------------------------------------------------------------------------------


def test_ltx2_base_loads_with_ltx2_library_components(base: Path) -> None:
    transformer = build_transformer("LTX2VideoTransformer3DModel", seed=0)
    root = build_ltx2_pipeline(base / "ltx2_odd", transformer)
    index = json.loads((root / "model_index.json").read_text())
    assert index["connectors"] == ["ltx2", "LTX2TextConnectors"]
    assert index["vocoder"] == ["ltx2", "LTX2Vocoder"]
    assert index["text_encoder"] == ["transformers", "Gemma3ForConditionalGeneration"]
    pipe = _load(root)
    assert type(pipe).__name__ == "LTX2Pipeline"
    assert type(pipe.audio_vae).__name__ == "AutoencoderKLLTX2Audio"
    assert pipe.text_encoder.config.text_config.hidden_size == transformer.config.caption_channels
    _assert_same_weights(pipe.transformer, transformer)
    _assert_no_local_path(root)


def test_ltx2_base_runs_end_to_end(base: Path) -> None:
    pipe = _load(build_ltx2_pipeline(base / "ltx2", tiny_ltx2_transformer()))
    out = pipe(
        prompt="a cat", negative_prompt="", height=32, width=32, num_frames=5, num_inference_steps=2,
        guidance_scale=1.0, max_sequence_length=16, output_type="pt", generator=torch.Generator().manual_seed(0),
    )
    assert out.frames.shape == (1, 5, 3, 32, 32) and torch.isfinite(out.frames).all()
    assert out.audio.shape[:2] == (1, 2)


# --- MiniMax H3: modular ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def h3_transformer() -> Any:
    return build_transformer(H3, seed=0)


@pytest.fixture(scope="module")
def h3_modular(base: Path, h3_transformer: Any) -> Path:
    return build_minimax_h3_modular(base / "h3_modular", h3_transformer)


def test_h3_modular_loads_the_way_diffusers_expects(h3_modular: Path, h3_transformer: Any) -> None:
    from diffusers import ModularPipeline

    pipe = ModularPipeline.from_pretrained(str(h3_modular), local_files_only=True)
    assert type(pipe).__name__ == "MiniMaxH3ModularPipeline"
    names = [n for n, s in pipe._component_specs.items() if s.default_creation_method == "from_pretrained"]
    assert {"transformer", "transformer_ref", "processor", "vae", "audio_vae", "scheduler"} <= set(names)
    # The index names the Hub repo; Diffusers resolves each component to the local copy.
    assert all(pipe._component_specs[n].pretrained_model_name_or_path == str(h3_modular) for n in names)
    pipe.load_components(names=[n for n in names if n != "processor"], dtype=torch.float32)
    _assert_same_weights(pipe.transformer, h3_transformer)
    assert pipe.transformer_ref.config == pipe.transformer.config
    assert not torch.equal(pipe.transformer_ref.proj_in.weight, pipe.transformer.proj_in.weight)
    assert pipe.text_encoder.config.text_config.num_hidden_layers == H3_TEXT_ENCODER_LAYERS
    assert pipe.scheduler.config.shift == 12.0 and pipe.audio_scheduler.config.shift == 3.0
    _assert_no_local_path(h3_modular)


def test_h3_modular_workflows_select_their_partition_and_t2va_runs(h3_modular: Path) -> None:
    from diffusers import ModularPipeline

    ref = ModularPipeline.from_pretrained(str(h3_modular), workflow="ref2va", local_files_only=True)
    assert "transformer_ref" in ref._component_specs and "transformer" not in ref._component_specs
    pipe = ModularPipeline.from_pretrained(str(h3_modular), workflow="t2va", local_files_only=True)
    names = [n for n, s in pipe._component_specs.items() if s.default_creation_method == "from_pretrained"]
    pipe.load_components(names=[n for n in names if n != "processor"], dtype=torch.float32)
    pipe.update_components(processor=load_qwen3vl_processor(h3_modular / "processor"))
    state = pipe(
        prompt="a robot dancing", num_inference_steps=2, height=32, width=32, num_frames=124,
        output_type="pt", generator=torch.Generator().manual_seed(0),
    )
    assert state.get("videos").shape == (1, 124, 3, 32, 32)
    assert state.get("audio").shape[:2] == (1, 2)


# --- MiniMax H3: native conversion -------------------------------------------------------------


def test_qkv_fusion_matches_hand_computed_example() -> None:
    # 2 heads of size 2, 1 input feature: rows are (head, dim).
    q = torch.tensor([[1.0], [2.0], [3.0], [4.0]])
    k = torch.tensor([[5.0], [6.0], [7.0], [8.0]])
    v = torch.tensor([[9.0], [10.0], [11.0], [12.0]])
    interleaved = fuse_qkv(q, k, v, heads=2, head_dim=2, layout="interleaved")
    assert interleaved.flatten().tolist() == [1, 2, 5, 6, 9, 10, 3, 4, 7, 8, 11, 12]
    stacked = fuse_qkv(q, k, v, heads=2, head_dim=2, layout="stacked")
    assert stacked.flatten().tolist() == list(range(1, 13))


def test_geglu_halves_swap_to_gate_first() -> None:
    value_then_gate = torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0], [4.0, 4.0]])
    assert swap_gate_value(value_then_gate)[:, 0].tolist() == [3, 4, 1, 2]


def test_inv_freq_is_the_spec_formula_in_float32() -> None:
    inv = rope_inv_freq({"rope_inv_freq_len": 4, "rope_theta": 10000.0})
    assert inv.dtype == torch.float32
    assert torch.allclose(inv, torch.tensor([1.0, 0.1, 0.01, 0.001]), rtol=1e-6)
    assert torch.equal(rope_inv_freq({"rope_inv_freq_len": 4, "rope_theta": None}), inv)  # theta defaults to 10000


@pytest.fixture(scope="module")
def h3_native(base: Path, h3_transformer: Any) -> Path:
    return build_minimax_h3_native(base / "h3_native", h3_transformer)


def test_h3_native_transformer_covers_the_native_schema_exactly(h3_native: Path, h3_transformer: Any) -> None:
    config = json.loads((h3_native / "transformer" / "config.json").read_text())
    assert config["_class_name"] == "MiniMaxH3DiTModel"
    weights = load_file(h3_native / "transformer" / "model.safetensors")
    expected = native_tensor_shapes(config)
    assert set(weights) == set(expected)
    assert all(tuple(weights[k].shape) == shape for k, shape in expected.items())
    assert "blocks.0.attn.qkv_proj.weight" in weights and "token_refiner.blocks.0.mlp.fc1.weight" in weights
    # inv_freq is stored in float32 from the config formula; Diffusers recomputes it (within float32 rounding).
    assert weights["rope.inv_freq"].dtype == torch.float32
    assert torch.equal(weights["rope.inv_freq"], rope_inv_freq(config))
    assert torch.allclose(weights["rope.inv_freq"], h3_transformer.rope.inv_freq, rtol=1e-6, atol=0)


def test_h3_native_weights_invert_to_the_diffusers_ones_with_diffusers_own_converter(
    h3_native: Path, h3_transformer: Any
) -> None:
    from diffusers.loaders.single_file_utils import (
        convert_minimax_h3_transformer_checkpoint_to_diffusers,
    )

    weights = load_file(h3_native / "transformer" / "model.safetensors")
    back = convert_minimax_h3_transformer_checkpoint_to_diffusers(
        weights, dict(h3_transformer.config), qkv_layout="interleaved"
    )
    expected = h3_transformer.state_dict()
    assert set(back) == set(expected)
    assert all(torch.equal(back[k], expected[k]) for k in expected)


def test_h3_native_config_renames_fields() -> None:
    model = build_transformer(H3, seed=0, config_overrides={"num_layers": 2, "rope_freq_dim": 16})
    diffusers_config = dict(model.config)
    native = native_config_from_diffusers(diffusers_config)
    renamed = {
        "num_refiner_layers": "token_refiner_num_layers", "ffn_dim": "ffn_hidden_size",
        "in_channels": "latents_dim", "audio_in_channels": "audio_latents_dim", "freq_dim": "timestep_input_dim",
        "time_embed_hidden_dim": "time_embed_hidden_size", "rope_freq_dim": "rope_inv_freq_len",
    }
    for source, target in renamed.items():
        assert native[target] == diffusers_config[source] and source not in native
    hidden = diffusers_config["hidden_size"]
    assert native["adaln_out_features"] == 18 * hidden == model.transformer_blocks[0].adaln_proj.linear.out_features
    assert native["final_adaln_out_features"] == 2 * hidden == model.norm_out.linear.out_features
    with pytest.raises(SchemaMismatchError, match="no native counterpart"):
        native_config_from_diffusers({**diffusers_config, "qk_norm": "rms_norm"})


def test_h3_reference_conversion_refuses_unmapped_and_incomplete_keys(h3_transformer: Any) -> None:
    state = dict(h3_transformer.state_dict())
    config = dict(h3_transformer.config)
    extra = {**state, "transformer_blocks.0.attn.to_q.bias": torch.zeros(3)}
    with pytest.raises(SchemaMismatchError, match="no MiniMax H3 conversion rule"):
        reference_native_state_dict(extra, config)
    refiner_adaln = {**state, "token_refiner.refiner_blocks.0.adaln_proj.linear.weight": torch.zeros(1)}
    with pytest.raises(SchemaMismatchError, match="no MiniMax H3 conversion rule"):
        reference_native_state_dict(refiner_adaln, config)
    missing_k = {k: v for k, v in state.items() if k != "transformer_blocks.0.attn.to_k.weight"}
    with pytest.raises(SchemaMismatchError, match="lacks"):
        reference_native_state_dict(missing_k, config)
    missing_norm = {k: v for k, v in state.items() if k != "norm_out.norm.weight"}
    with pytest.raises(SchemaMismatchError, match="missing"):
        reference_native_state_dict(missing_norm, config)


def test_h3_native_package_layout(h3_native: Path) -> None:
    index = json.loads((h3_native / "model_index.json").read_text())
    assert index["_class_name"] == "MiniMaxH3Pipeline"
    assert index["_minimax_h3"] == NATIVE_METADATA and index["scheduler"] is None
    assert index["transformer"] == ["diffusers", "MiniMaxH3DiTModel"]
    assert index["text_encoder"] == ["transformers", "MiniMaxH3Qwen3VLHFEncoder"]
    assert not (h3_native / "scheduler").exists()
    assert (h3_native / "text_encoder" / "model.safetensors").is_file()
    for component, class_name in (("video_vae", "MiniMaxH3VideoVAE"), ("audio_vae", "MiniMaxH3AudioVAE")):
        assert json.loads((h3_native / component / "config.json").read_text())["_class_name"] == class_name
        assert (h3_native / component / "diffusion_pytorch_model.safetensors").is_file()
    processor = load_qwen3vl_processor(h3_native / "processor")
    assert processor(text=["a cat"], return_tensors="pt")["input_ids"].shape[0] == 1
    _assert_no_local_path(h3_native)


# --- Boogu-Image ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def boogu(base: Path) -> Path:
    return build_boogu_pipeline(base / "boogu")


def test_boogu_layout_declares_remote_code_components(boogu: Path) -> None:
    index = json.loads((boogu / "model_index.json").read_text())
    assert index["_class_name"] == "BooguImagePipeline"
    assert index["transformer"] == ["transformer_boogu", "BooguImageTransformer2DModel"]
    scheduler_module = "scheduling_flow_match_euler_discrete_time_shifting"
    assert index["scheduler"] == [scheduler_module, "FlowMatchEulerDiscreteScheduler"]
    assert (boogu / "transformer" / "transformer_boogu.py").is_file()
    assert (boogu / "scheduler" / f"{scheduler_module}.py").is_file()
    assert json.loads((boogu / "scheduler" / "scheduler_config.json").read_text())["_class_name"] == (
        "FlowMatchEulerDiscreteScheduler"
    )
    assert (boogu / "transformer" / "diffusion_pytorch_model.safetensors").is_file()
    _assert_no_local_path(boogu)


def test_boogu_transformer_needs_trust_remote_code(boogu: Path) -> None:
    from diffusers.utils.dynamic_modules_utils import get_class_from_dynamic_module

    with pytest.raises(ValueError, match="trust_remote_code"):
        get_class_from_dynamic_module(
            str(boogu / "transformer"), module_file="transformer_boogu.py", class_name="BooguImageTransformer2DModel"
        )


def test_boogu_transformer_reloads_via_remote_code_and_runs(boogu: Path) -> None:
    model = load_boogu_transformer(boogu)
    assert type(model).__name__ == "BooguImageTransformer2DModel"
    saved = load_file(boogu / "transformer" / "diffusion_pytorch_model.safetensors")
    assert set(saved) == set(model.state_dict())
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(2, 4, 8, 8, generator=generator)
    features = torch.randn(2, 5, 12, generator=generator)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 3:] = False  # padded instruction
    with torch.no_grad():
        out = model(latents, torch.tensor([0.3, 0.7]), features, mask).sample
        reference = latents[:, :, :4]  # an edit's reference image, of another size
        edited = model(latents, torch.tensor([0.3, 0.7]), features, mask, ref_image_hidden_states=reference).sample
    assert out.shape == edited.shape == latents.shape
    assert torch.isfinite(out).all() and not torch.equal(out, edited)


def test_boogu_actor_instance_matches_the_base_schema(boogu: Path) -> None:
    actor = boogu_transformer_instance(boogu, seed=1)
    base_model = load_boogu_transformer(boogu)
    assert type(actor).__name__ == type(base_model).__name__
    fields = {k: v for k, v in base_model.config.items() if not k.startswith("_")}
    assert {k: v for k, v in actor.config.items() if not k.startswith("_")} == fields
    shapes = {k: v.shape for k, v in base_model.state_dict().items()}
    assert {k: v.shape for k, v in actor.state_dict().items()} == shapes
    assert not torch.equal(actor.x_embedder.weight, base_model.x_embedder.weight)
    cls = remote_class(boogu / "transformer", "transformer_boogu", "BooguImageTransformer2DModel")
    assert cls.__module__.endswith("transformer_boogu")


def test_boogu_pipeline_loads_through_diffusers_and_runs(boogu: Path) -> None:
    pipe = load_boogu_pipeline(boogu)
    assert type(pipe).__name__ == "BooguImagePipeline"
    assert type(pipe.mllm).__name__ == "Qwen3VLForConditionalGeneration"
    images = pipe("a cat", height=16, width=16, num_inference_steps=2, output_type="pt",
                  generator=torch.Generator().manual_seed(0)).images
    assert images.shape == (1, 3, 16, 16) and torch.isfinite(images).all()
