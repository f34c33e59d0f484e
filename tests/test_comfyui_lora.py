"""`--adapter-format comfyui`: real LoRA checkpoints exported through the real flow, then loaded by
each architecture's tiny pipeline with Diffusers' own `load_lora_weights` (which detects and converts
the file) and compared with the trained PEFT model's forward."""

from __future__ import annotations

import json
import os
from pathlib import Path

import diffusers
import pytest
import torch
from lora_builders import LoraCheckpoint, build_lora_checkpoint
from peft import LoraConfig
from safetensors import safe_open

from mergeflow import merge_model, validate_artifact
from mergeflow.demo.checkpoints import run_tiny_forward

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
}


def make_config(targets: object, alpha: int = 8):
    return lambda name: LoraConfig(r=4, lora_alpha=alpha, target_modules=targets)  # type: ignore[arg-type]


def pipeline_with(pipeline_class: str, transformer: torch.nn.Module) -> object:
    """The architecture's real pipeline class around `transformer` (the other components are not needed to load a LoRA)."""
    import inspect

    cls = getattr(diffusers, pipeline_class)
    names = [n for n in inspect.signature(cls.__init__).parameters if n != "self"]
    return cls(**{n: None for n in names if n != "transformer"}, transformer=transformer)


def load_base(ck: LoraCheckpoint) -> torch.nn.Module:
    return getattr(diffusers, ck.class_name).from_pretrained(ck.base_dir, local_files_only=True)


def export(ck: LoraCheckpoint, target: Path, adapter: str = "default") -> Path:
    result = merge_model(ck.config(target, base_model="tiny-org/base", adapter_name=adapter, adapter_format="comfyui"))
    return Path(result.output_dir)


@pytest.mark.parametrize("class_name", sorted(CASES))
def test_comfyui_lora_loads_with_load_lora_weights_and_reproduces_the_trained_forward(
    tmp_path: Path, prefect_api: object, class_name: str
) -> None:
    targets, pipeline_class, key = CASES[class_name]
    ck = build_lora_checkpoint(tmp_path, class_name, make_config(targets), world_size=3, layout="lora_only")
    out = export(ck, tmp_path / "out")
    adapter_dir = out / "lora_adapter"
    assert sorted(os.listdir(adapter_dir)) == ["lora_comfyui.safetensors", "merge_manifest.json"]
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
