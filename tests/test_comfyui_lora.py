"""`--adapter-format comfyui`: real LoRA checkpoints exported through the real flow, then loaded by
each architecture's tiny pipeline with Diffusers' own `load_lora_weights` (which detects and converts
the file) and compared with the trained PEFT model's forward."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import diffusers
import pytest
import torch
from builders import leftovers
from lora_builders import LoraCheckpoint, build_lora_checkpoint
from peft import LoraConfig
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mergeflow import merge_model, validate_artifact
from mergeflow.architectures.original_lora import naming_for
from mergeflow.demo.checkpoints import run_tiny_forward
from mergeflow.errors import (
    ArtifactInvalidError,
    LoraError,
    SchemaMismatchError,
    UsageError,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::RuntimeWarning", "ignore::FutureWarning")

WEIGHTS = "lora_comfyui.safetensors"

# Flux: the double blocks' attention (image qkv whole, text qkv without k: a zero block), out
# projections, one MLP and one modulation. Regexes: PEFT full-matches a string target.
FLUX_DOUBLE = (r"transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_v_proj|to_add_out)"
               r"|ff\.net\.2|norm1_context\.linear)")
# class -> (target modules, pipeline class, expected key of the file)
CASES: dict[str, tuple[object, str, str]] = {
    "FluxTransformer2DModel": (FLUX_DOUBLE, "FluxPipeline", "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"),
    "WanTransformer3DModel": (["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "proj_out"], "WanPipeline",
                              "diffusion_model.blocks.0.cross_attn.o.lora_up.weight"),
    "QwenImageTransformer2DModel": (["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "img_mod.1", "norm_out.linear"],
                                    "QwenImagePipeline", "diffusion_model.transformer_blocks.1.img_mod.1.alpha"),
    # proj_in, time_embed and the a2v gate exercise Lightricks' renames (patchify_proj, adaln_single, av_ca_*).
    "LTX2VideoTransformer3DModel": (["to_q", "to_k", "to_v", "to_out.0", "proj_in", "time_embed.linear",
                                     "av_cross_attn_video_a2v_gate.linear"], "LTX2Pipeline",
                                    "diffusion_model.av_ca_a2v_gate_adaln_single.linear.lora_B.weight"),
    # SD3.5's dual attention (attn2) included
    "SD3Transformer2DModel": (["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "ff_context.net.2", "context_embedder"],
                              "StableDiffusion3Pipeline", "transformer.transformer_blocks.0.attn2.to_q.lora_B.weight"),
    # q and v only (k a zero block of the fused qkv_proj), fc1's swapped halves, the final layer's renames
    "MiniMaxH3Transformer3DModel": (["to_q", "to_v", "to_out.0", "ff.net.0.proj", "adaln_proj.linear", "proj_out"],
                                    "MiniMaxH3ModularPipeline", "diffusion_model.blocks.0.attn.qkv_proj.lora_up.weight"),
}


FULL_STATE = {"WanTransformer3DModel": "full_state"}  # the others are LoRA-only saves


def make_config(targets: object, alpha: int = 8):
    return lambda name: LoraConfig(r=4, lora_alpha=alpha, target_modules=targets)  # type: ignore[arg-type]


def pipeline_with(pipeline_class: str, transformer: torch.nn.Module) -> object:
    """The architecture's real pipeline class around `transformer` (the other components are not needed to load a LoRA)."""
    import inspect

    cls = getattr(diffusers, pipeline_class)
    if issubclass(cls, diffusers.ModularPipeline):  # H3 is modular only: components are set, not passed
        pipe = cls()
        pipe.update_components(transformer=transformer)
        return pipe
    names = [n for n in inspect.signature(cls.__init__).parameters if n != "self"]
    return cls(**{n: None for n in names if n != "transformer"}, transformer=transformer)


def load_base(ck: LoraCheckpoint) -> torch.nn.Module:
    return getattr(diffusers, ck.class_name).from_pretrained(ck.base_dir, local_files_only=True)


def export(ck: LoraCheckpoint, target: Path, adapter: str = "default") -> Path:
    # A LoRA-only adapter needs no local base (a Hub id is enough); a full-state save exports the model beside it.
    base = "tiny-org/base" if ck.layout == "lora_only" else str(ck.base_dir)
    result = merge_model(ck.config(target, base_model=base, adapter_name=adapter, adapter_format="comfyui"))
    return Path(result.output_dir)


@pytest.mark.parametrize("class_name", sorted(CASES))
def test_comfyui_lora_loads_with_load_lora_weights_and_reproduces_the_trained_forward(
    tmp_path: Path, prefect_api: object, class_name: str
) -> None:
    targets, pipeline_class, key = CASES[class_name]
    layout = FULL_STATE.get(class_name, "lora_only")
    ck = build_lora_checkpoint(tmp_path, class_name, make_config(targets), world_size=3, layout=layout)
    out = export(ck, tmp_path / "out")
    adapter_dir = out / "lora_adapter"
    assert sorted(os.listdir(adapter_dir)) == ["README.md", "lora_comfyui.safetensors", "merge_manifest.json",
                                               "merge_manifest.sha256"]
    manifest = json.loads((adapter_dir / "merge_manifest.json").read_text())
    assert manifest["lora_adapter"]["format"] == "comfyui" and manifest["architecture"] == class_name
    with safe_open(str(adapter_dir / WEIGHTS), framework="pt") as handle:
        assert key in set(handle.keys())
    pipe = pipeline_with(pipeline_class, load_base(ck))
    pipe.load_lora_weights(str(adapter_dir), weight_name=WEIGHTS, adapter_name="x")  # type: ignore[attr-defined]
    expected = ck.forward("default")
    base = run_tiny_forward(load_base(ck).eval())
    assert not all(torch.allclose(a, b, atol=1e-4) for a, b in zip(expected, base, strict=True))  # the LoRA matters
    got = run_tiny_forward(pipe.transformer.eval())  # type: ignore[attr-defined]
    for a, b in zip(expected, got, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    assert validate_artifact(adapter_dir)["integrity"] == "passed"
    if layout == "full_state":  # the model beside the adapter, and the root manifest lists the adapter's files
        root = json.loads((out / "merge_manifest.json").read_text())
        assert f"lora_adapter/{WEIGHTS}" in root["files"]
        assert validate_artifact(out)["integrity"] == "passed"


def delta(ck: LoraCheckpoint, module: str, adapter: str = "default") -> torch.Tensor:
    """PEFT's own delta weight (scale * B @ A) of one module of the trained model."""
    return ck.peft.base_model.model.get_submodule(module).get_delta_weight(adapter).detach()


def file_delta(state: dict[str, torch.Tensor], stem: str) -> torch.Tensor:
    down, up = state[f"{stem}.lora_down.weight"], state[f"{stem}.lora_up.weight"]
    return (up @ down) * (state[f"{stem}.alpha"].item() / down.shape[0])


@pytest.fixture(scope="module")
def flux_qkv(tmp_path_factory: pytest.TempPathFactory, prefect_server: Any) -> tuple[LoraCheckpoint, Path]:
    """q, k, v LoRAs in every block: double blocks' image qkv and single blocks' linear1 (proj_mlp a zero block)."""
    root = tmp_path_factory.mktemp("flux-qkv")
    ck = build_lora_checkpoint(root, "FluxTransformer2DModel", make_config(["to_q", "to_k", "to_v"]), world_size=3,
                               layout="lora_only")
    with prefect_server.activated():
        return ck, export(ck, root / "out")


def test_flux_fused_modules_hold_the_exact_block_structured_lora(flux_qkv: tuple[LoraCheckpoint, Path]) -> None:
    ck, out = flux_qkv
    state = load_file(str(out / "lora_adapter" / WEIGHTS))
    peft_state = ck.peft.base_model.model.state_dict()
    lora_a = [peft_state[f"transformer_blocks.0.attn.to_{p}.lora_A.default.weight"] for p in "qkv"]
    lora_b = [peft_state[f"transformer_blocks.0.attn.to_{p}.lora_B.default.weight"] for p in "qkv"]
    stem = "lora_unet_double_blocks_0_img_attn_qkv"
    # the checkpoint's bytes, stacked and on the block diagonal: rank 3r, alpha / rank = alpha / r of each part
    assert torch.equal(state[f"{stem}.lora_down.weight"], torch.cat(lora_a))
    assert torch.equal(state[f"{stem}.lora_up.weight"], torch.block_diag(*lora_b))
    assert state[f"{stem}.alpha"].item() == 8 / 4 * 12 and state[f"{stem}.alpha"].dtype == torch.float32
    expected = torch.cat([delta(ck, f"transformer_blocks.0.attn.to_{p}") for p in "qkv"])
    torch.testing.assert_close(file_delta(state, stem), expected, rtol=0, atol=1e-6)
    # single block: linear1 = q, k, v and the MLP input; proj_mlp has no LoRA, so its rows are zero
    single = "lora_unet_single_blocks_0_linear1"
    mlp_rows = ck.peft.base_model.model.single_transformer_blocks[0].proj_mlp.out_features
    parts = [delta(ck, f"single_transformer_blocks.0.attn.to_{p}") for p in "qkv"]
    expected = torch.cat([*parts, torch.zeros(mlp_rows, parts[0].shape[1])])
    assert state[f"{single}.lora_down.weight"].shape[0] == 12
    torch.testing.assert_close(file_delta(state, single), expected, rtol=0, atol=1e-6)
    assert not any("txt_attn_qkv" in k for k in state)  # no part of it is adapted
    assert validate_artifact(out / "lora_adapter")["integrity"] == "passed"


def test_the_test_command_catches_a_flipped_byte_and_a_renamed_key(
    tmp_path: Path, flux_qkv: tuple[LoraCheckpoint, Path]
) -> None:
    _, out = flux_qkv
    flipped = tmp_path / "flipped"
    shutil.copytree(out / "lora_adapter", flipped)
    data = bytearray((flipped / WEIGHTS).read_bytes())
    data[-3] ^= 0x01
    (flipped / WEIGHTS).write_bytes(bytes(data))
    with pytest.raises(ArtifactInvalidError):
        validate_artifact(flipped)
    renamed = tmp_path / "renamed"
    shutil.copytree(out / "lora_adapter", renamed)
    with safe_open(str(renamed / WEIGHTS), framework="pt") as handle:
        metadata = handle.metadata()
    state = load_file(str(renamed / WEIGHTS))
    key = "lora_unet_double_blocks_0_img_attn_qkv.alpha"
    state["lora_unet_double_blocks_0_img_attn_qkv_x.alpha"] = state.pop(key)
    save_file(state, str(renamed / WEIGHTS), metadata=metadata)
    with pytest.raises(ArtifactInvalidError):
        validate_artifact(renamed)


# Flux outside the blocks (what `target_modules: all-linear` adds): Diffusers module -> the file's stem.
FLUX_OUTSIDE = {
    "x_embedder": "lora_unet_img_in",
    "context_embedder": "lora_unet_txt_in",
    "time_text_embed.timestep_embedder.linear_1": "lora_unet_time_in_in_layer",
    "time_text_embed.timestep_embedder.linear_2": "lora_unet_time_in_out_layer",
    "time_text_embed.text_embedder.linear_1": "lora_unet_vector_in_in_layer",
    "time_text_embed.text_embedder.linear_2": "lora_unet_vector_in_out_layer",
    "time_text_embed.guidance_embedder.linear_1": "lora_unet_guidance_in_in_layer",
    "time_text_embed.guidance_embedder.linear_2": "lora_unet_guidance_in_out_layer",
    "proj_out": "lora_unet_final_layer_linear",
    "norm_out.linear": "lora_unet_final_layer_adaLN_modulation_1",
}
FLUX_FOLDED = ("proj_out", "norm_out.linear")  # no alpha: the scale is in the up
# The single blocks' q, k, v and MLP input (fused linear1): Diffusers' converter splits it only at
# FLUX.1's widths, so the tiny model's all-linear adapter leaves them out (proven at that width below).
LINEAR1_PART = re.compile(r"single_transformer_blocks\.\d+\.(attn\.to_[qkv]|proj_mlp)")


def flux_linears() -> list[str]:
    """Every Linear of the tiny Flux: what PEFT's `target_modules="all-linear"` adapts there."""
    from mergeflow.demo.tiny_transformers import build_transformer

    model = build_transformer("FluxTransformer2DModel", seed=0)
    return sorted(n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear))


def lora_modules(transformer: torch.nn.Module, adapter: str) -> set[str]:
    from peft.tuners.lora import LoraLayer

    return {n for n, m in transformer.named_modules() if isinstance(m, LoraLayer) and adapter in m.lora_A}


def test_flux_all_linear_names_every_module_as_comfyui_keys_the_bfl_weights() -> None:
    """ComfyUI keys a Flux LoRA module as `lora_unet_` + its BFL weight's name, dots as underscores
    (comfy/lora.py model_lora_keys_unet): every stem of an all-linear plan is such a weight of the
    original layout (mergeflow.architectures.flux, proven against Diffusers' from_single_file),
    made of the same Diffusers weights in the same row order, swapped where that layout swaps."""
    from mergeflow.architectures import flux
    from mergeflow.architectures.flux_lora import LORA_NAMING, PREFIX
    from mergeflow.architectures.original_lora import checked_plan
    from mergeflow.demo.tiny_transformers import build_transformer

    linears = flux_linears()
    modules = checked_plan(LORA_NAMING, linears)
    shapes = {k: tuple(v.shape) for k, v in build_transformer("FluxTransformer2DModel", seed=0).state_dict().items()}
    bfl = {t.name.removesuffix(".weight").replace(".", "_"): t for t in flux.plan(shapes, {}) if t.name.endswith(".weight")}
    for module in modules:
        tensor = bfl[module.stem.removeprefix(PREFIX)]
        assert tensor.sources == tuple(f"{p}.weight" for p in module.parts), module.stem
        assert (tensor.op == "swap_halves") == module.swap_halves, module.stem
    assert sorted(p for m in modules for p in m.parts) == linears
    named = {m.parts[0]: m for m in modules if len(m.parts) == 1}
    assert {p: named[p].stem for p in FLUX_OUTSIDE} == FLUX_OUTSIDE
    assert [p for p in FLUX_OUTSIDE if not named[p].alpha] == list(FLUX_FOLDED)


def test_flux_lora_outside_the_blocks_is_exact_for_diffusers_converter_and_forward(
    tmp_path: Path, prefect_api: object
) -> None:
    from diffusers.loaders.lora_conversion_utils import (
        _convert_kohya_flux_lora_to_diffusers,
    )

    targets = [n for n in flux_linears() if not LINEAR1_PART.fullmatch(n)]
    assert set(FLUX_OUTSIDE) <= set(targets)
    ck = build_lora_checkpoint(tmp_path, "FluxTransformer2DModel", make_config(targets), world_size=3,
                               layout="lora_only")
    adapter_dir = export(ck, tmp_path / "out") / "lora_adapter"
    state = load_file(str(adapter_dir / WEIGHTS))
    peft_state = ck.peft.base_model.model.state_dict()
    scale, rank = 8 / 4, 4
    lora_a = {m: peft_state[f"{m}.lora_A.default.weight"] for m in FLUX_OUTSIDE}
    lora_b = {m: peft_state[f"{m}.lora_B.default.weight"] for m in FLUX_OUTSIDE}
    for module, stem in FLUX_OUTSIDE.items():  # the file: the checkpoint's bytes, or the up scaled
        assert torch.equal(state[f"{stem}.lora_down.weight"], lora_a[module])
        if module in FLUX_FOLDED:
            assert f"{stem}.alpha" not in state
        else:
            assert state[f"{stem}.alpha"].item() == scale * rank
            assert torch.equal(state[f"{stem}.lora_up.weight"], lora_b[module])
    assert torch.equal(state["lora_unet_final_layer_linear.lora_up.weight"], lora_b["proj_out"] * scale)
    first, second = (lora_b["norm_out.linear"] * scale).chunk(2)  # Diffusers' (scale, shift) -> BFL's (shift, scale)
    assert torch.equal(state["lora_unet_final_layer_adaLN_modulation_1.lora_up.weight"], torch.cat([second, first]))

    # (a) Diffusers' own kohya converter gives every outside module back exactly: alpha / rank = 2 goes
    # whole into A where it reads an alpha; the final layer's folded up is taken as written, the
    # modulation's halves swapped back by its swap_scale_shift.
    converted = _convert_kohya_flux_lora_to_diffusers(dict(state))
    for module in FLUX_OUTSIDE:
        got_a, got_b = converted[f"{module}.lora_A.weight"], converted[f"{module}.lora_B.weight"]
        folded = module in FLUX_FOLDED
        assert torch.equal(got_a, lora_a[module] if folded else lora_a[module] * scale), module
        assert torch.equal(got_b, lora_b[module] * scale if folded else lora_b[module]), module
        torch.testing.assert_close(got_b @ got_a, delta(ck, module), rtol=0, atol=1e-6)
    # ... but names them without `transformer.`, so load_lora_weights of the file loads only the blocks' modules
    assert not any(f"transformer.{m}.lora_A.weight" in converted for m in FLUX_OUTSIDE)
    pipe = pipeline_with("FluxPipeline", load_base(ck))
    pipe.load_lora_weights(str(adapter_dir), weight_name=WEIGHTS, adapter_name="x")  # type: ignore[attr-defined]
    assert lora_modules(pipe.transformer, "x") == set(targets) - set(FLUX_OUTSIDE)  # type: ignore[attr-defined]

    # (b) end to end: the converter's output, every key under `transformer.`, loaded by load_lora_weights,
    # reproduces the trained adapter's forward with every module adapted
    prefixed = {k if k.startswith("transformer.") else f"transformer.{k}": v for k, v in converted.items()}
    pipe = pipeline_with("FluxPipeline", load_base(ck))
    pipe.load_lora_weights(prefixed, adapter_name="x")  # type: ignore[attr-defined]
    assert lora_modules(pipe.transformer, "x") == set(targets)  # type: ignore[attr-defined]
    expected = ck.forward("default")
    base = run_tiny_forward(load_base(ck).eval())
    assert not all(torch.allclose(a, b, atol=1e-4) for a, b in zip(expected, base, strict=True))
    got = run_tiny_forward(pipe.transformer.eval())  # type: ignore[attr-defined]
    for a, b in zip(expected, got, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    assert validate_artifact(adapter_dir)["integrity"] == "passed"


# name -> (class, LoraConfig factory, what the one-line refusal says)
REFUSALS = {
    "dora": ("FluxTransformer2DModel", lambda n: LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=["to_q"]),
             "is DoRA"),
    "lora-bias": ("FluxTransformer2DModel", lambda n: LoraConfig(r=4, lora_alpha=8, lora_bias=True, target_modules=["to_q"]),
                  "trains lora_B biases"),
    # q and v at alpha / r = 2, k at 1: the fused qkv's one alpha cannot carry both
    "mixed-scales": ("FluxTransformer2DModel", lambda n: LoraConfig(r=4, lora_alpha=8, alpha_pattern={"to_k": 4},
                                                                    target_modules=["to_q", "to_k", "to_v"]),
                     "different scales"),
    "wan-patch-embedding": ("WanTransformer3DModel", make_config(["to_q", "patch_embedding"]), "patch_embedding, which the Wan"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_what_a_comfyui_lora_cannot_carry_is_refused_before_any_write(tmp_path: Path, prefect_api: object, case: str) -> None:
    class_name, make, match = REFUSALS[case]
    ck = build_lora_checkpoint(tmp_path, class_name, make, world_size=1, layout="lora_only", adapter_config="actor")
    with pytest.raises(LoraError, match=match):
        export(ck, tmp_path / "out")
    assert not leftovers(tmp_path, "out")


def test_flux_naming_refuses_a_module_no_flux_loader_knows() -> None:
    """Every Linear of FluxTransformer2DModel has a kohya name (see above); a module name outside that map
    (here a norm weight, which no Flux LoRA loader reads) is still refused, naming the module."""
    from mergeflow.architectures.flux_lora import plan

    with pytest.raises(LoraError, match=r"transformer_blocks\.0\.attn\.norm_q, which the Flux ComfyUI LoRA naming cannot"):
        plan(["transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.norm_q"])
    with pytest.raises(LoraError, match="pos_embed, which the Flux"):
        plan(["pos_embed"])


def test_an_architecture_without_a_comfyui_lora_naming_is_refused() -> None:
    with pytest.raises(LoraError, match="Boogu-Image has no ComfyUI LoRA loader"):
        naming_for("BooguImageTransformer2DModel")
    with pytest.raises(LoraError, match="no LoRA naming for NoSuchTransformer; it knows FluxTransformer2DModel"):
        naming_for("NoSuchTransformer")


def test_fuse_lora_writes_no_adapter_so_the_format_flag_is_refused(tmp_path: Path, prefect_api: object,
                                                                   flux_qkv: tuple[LoraCheckpoint, Path]) -> None:
    ck, _ = flux_qkv
    with pytest.raises(UsageError, match="with --fuse-lora no adapter is written"):
        merge_model(ck.config(tmp_path / "out", base_model=str(ck.base_dir), fuse_lora=True, adapter_format="comfyui"))
    assert not leftovers(tmp_path, "out")


def test_wan_image_projections_are_written_only_as_a_pair() -> None:
    from mergeflow.architectures.wan_lora import plan

    stems = [m.stem for m in plan(["blocks.0.attn2.add_k_proj", "blocks.0.attn2.add_v_proj"])]
    assert stems == ["diffusion_model.blocks.0.cross_attn.k_img", "diffusion_model.blocks.0.cross_attn.v_img"]
    with pytest.raises(LoraError, match="k_img and v_img LoRAs only together"):
        plan(["blocks.0.attn2.add_k_proj"])


def test_every_ltx2_linear_module_round_trips_through_diffusers_converter() -> None:
    """Diffusers' LTX-2 LoRA converter renames only: every Linear of the model must come back as itself."""
    from diffusers.loaders.lora_conversion_utils import (
        _convert_non_diffusers_ltx2_lora_to_diffusers,
    )

    from mergeflow.architectures.ltx2_lora import LORA_NAMING
    from mergeflow.demo.tiny_transformers import build_transformer

    model = build_transformer("LTX2VideoTransformer3DModel", seed=0)
    linears = sorted(n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear))
    files = {f"{m.stem}.{LORA_NAMING.down}": torch.zeros(1) for m in LORA_NAMING.plan(linears)}
    assert any("adaln_single" in k for k in files) and any("patchify_proj" in k for k in files)
    converted = _convert_non_diffusers_ltx2_lora_to_diffusers(files)
    assert sorted(converted) == sorted(f"transformer.{n}.lora_A.weight" for n in linears)


# FLUX.1's own width (24 heads x 128, MLP 4x) in one single block and no double block: Diffusers' kohya
# converter splits linear1 at FLUX.1's fixed row counts (3072, 3072, 3072, 12288), so only this width loads.
FLUX1_SINGLE_BLOCK = {"num_layers": 0, "num_single_layers": 1, "num_attention_heads": 24, "attention_head_dim": 128,
                      "axes_dims_rope": (16, 56, 56)}


SINGLE_TARGETS = r"single_transformer_blocks\.\d+\.(attn\.to_[qkv]|proj_mlp|proj_out)"  # not the final proj_out


def test_flux_single_block_linear1_loads_with_load_lora_weights_at_flux1_width(tmp_path: Path, prefect_api: object) -> None:
    ck = build_lora_checkpoint(tmp_path, "FluxTransformer2DModel", make_config(SINGLE_TARGETS),
                               world_size=1, layout="lora_only", config_overrides=FLUX1_SINGLE_BLOCK)
    out = export(ck, tmp_path / "out")
    adapter_dir = out / "lora_adapter"
    with safe_open(str(adapter_dir / WEIGHTS), framework="pt") as handle:
        assert set(handle.keys()) == {f"lora_unet_single_blocks_0_{m}.{s}" for m in ("linear1", "linear2")
                                      for s in ("lora_down.weight", "lora_up.weight", "alpha")}
        assert handle.get_slice("lora_unet_single_blocks_0_linear1.lora_up.weight").get_shape() == [21504, 16]
    pipe = pipeline_with("FluxPipeline", load_base(ck))
    pipe.load_lora_weights(str(adapter_dir), weight_name=WEIGHTS, adapter_name="x")  # type: ignore[attr-defined]
    expected = ck.forward("default")
    got = run_tiny_forward(pipe.transformer.eval())  # type: ignore[attr-defined]
    for a, b in zip(expected, got, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)


def test_adapter_ops_build_the_block_up_with_zero_blocks_swaps_and_folded_scales() -> None:
    from mergeflow.lora.adapter_ops import apply_adapter_op
    from mergeflow.records import ArchitectureOp

    b_q, b_v = torch.randn(3, 2), torch.randn(3, 4)
    spec = ArchitectureOp("lora_up", (), {"rows": "3,3,3", "present": "1,0,1", "scale": 1.0, "swap_halves": 0})
    up = apply_adapter_op(spec, [b_q, b_v])
    assert torch.equal(up, torch.block_diag(b_q, torch.zeros(3, 0), b_v)) and up.shape == (9, 6)
    swapped = apply_adapter_op(ArchitectureOp("lora_up", (), {"rows": "4", "present": "1", "scale": 2.0, "swap_halves": 1}),
                               [torch.arange(8.0).reshape(4, 2)])
    assert torch.equal(swapped, torch.tensor([[8.0, 10], [12, 14], [0, 2], [4, 6]]))
    with pytest.raises(SchemaMismatchError, match="differ from"):
        apply_adapter_op(ArchitectureOp("lora_up", (), {"rows": "3,4", "present": "1,1"}), [b_q, b_v])
    alpha = apply_adapter_op(ArchitectureOp("lora_alpha", (), {"value": 24.0}), [])
    assert alpha.shape == () and alpha.dtype == torch.float32 and alpha.item() == 24.0
