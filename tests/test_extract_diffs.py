"""--extract-lora into a ComfyUI file: changed biases and norms as `.diff` / `.diff_b` entries, proven with the loaders.

A synthetic full fine-tune: every linear weight moved by a rank-2 update, every other tensor (biases,
norms, modulation tables, the patch embedding) by noise. At rank 2 the factors are exact, so a file
that carries every other change reproduces the trained checkpoint itself.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from comfy_keys import apply_comfy_lora
from safetensors.torch import load_file, save_file
from test_extract_lora import RANK, _rewrite_listed, config, low_rank_finetune_

from mergeflow import merge_model, validate_artifact
from mergeflow.architectures.original_layout import layout_for, to_original_state_dict
from mergeflow.demo.checkpoints import (
    build_transformer,
    run_tiny_forward,
    save_base_transformer,
    save_fsdp_checkpoint,
)
from mergeflow.errors import ArtifactInvalidError
from mergeflow.lora.diffs import NOT_COMFYUI, is_diff_key
from mergeflow.lora.extract_spec import EXTRACTION_NAME

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::RuntimeWarning")

WEIGHTS = "lora_comfyui.safetensors"


def full_finetune_(model: torch.nn.Module, seed: int = 5) -> set[str]:
    """A rank-2 update on every linear weight and noise on every other parameter; returns the latter's names."""
    low_rank_finetune_(model, RANK)
    linear = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    gen = torch.Generator().manual_seed(seed)
    other = set()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name not in linear:
                param.add_((torch.randn(param.shape, generator=gen) * 0.05).to(param.dtype))
                other.add(name)
    return other


def fine_tuned(root: Path, class_name: str, unchanged: tuple[str, ...] = ()):  # type: ignore[no-untyped-def]
    """The base, its full fine-tune (tensors in `unchanged` kept as the base's) and their directories."""
    base = build_transformer(class_name, seed=0)
    base_dir = save_base_transformer(base, root / "base")
    actor = copy.deepcopy(base)
    other = full_finetune_(actor)
    with torch.no_grad():
        for name in unchanged:
            actor.get_parameter(name).copy_(base.get_parameter(name))
    other -= set(unchanged)
    actor_dir = save_fsdp_checkpoint(actor, root / "ckpt" / "global_step_1" / "actor", 2)
    return base, actor, base_dir, actor_dir, other


def comfy_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model as ComfyUI holds it: the original single-file layout under `diffusion_model.`."""
    layout = layout_for(type(model).__name__)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    return {f"diffusion_model.{k}": v for k, v in to_original_state_dict(layout, state, dict(model.config)).items()}


def assert_comfy_reproduces(base: torch.nn.Module, actor: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """ComfyUI's key handling applies every tensor of the file, and the base becomes the trained checkpoint;
    without the `.diff` entries it does not."""
    want = comfy_state(actor)
    got = apply_comfy_lora(comfy_state(base), weights)
    assert set(got) == set(want)
    for key in sorted(want):
        torch.testing.assert_close(got[key], want[key].float(), rtol=0, atol=2e-5, msg=key)
    lora_only = apply_comfy_lora(comfy_state(base), {k: v for k, v in weights.items() if not is_diff_key(k)})
    worst = max(float((lora_only[k] - want[k].float()).abs().max()) for k in want)
    assert worst > 1e-2  # the diffs carry changes nothing else in the file does


def export_comfyui(actor_dir: Path, base_dir: Path, target: Path) -> Path:
    out = Path(merge_model(config(actor_dir, base_dir, target, extract_lora=RANK, adapter_format="comfyui")).output_dir)
    return out / "lora_adapter"


def test_wan_diffs_reproduce_the_trained_checkpoint_in_comfyui_and_the_biases_in_load_lora_weights(
    tmp_path: Path, prefect_api: object
) -> None:
    from test_comfyui_lora import pipeline_with

    base, actor, base_dir, actor_dir, other = fine_tuned(tmp_path, "WanTransformer3DModel")
    adapter_dir = export_comfyui(actor_dir, base_dir, tmp_path / "out")
    record = json.loads((adapter_dir / EXTRACTION_NAME).read_text())
    weights = load_file(adapter_dir / WEIGHTS)
    # every changed non-linear tensor is listed with its change's norm and the entry written for it
    listed = {item["name"]: item for item in record["not_extracted"]}
    assert set(listed) == other and all(item["written_as"] for item in listed.values())
    state_actor, state_base = actor.state_dict(), base.state_dict()
    for name, item in listed.items():
        want = float(torch.linalg.norm(state_actor[name].float() - state_base[name].float()))
        assert abs(item["delta_norm"] - want) <= 1e-6 * max(1.0, want), name
    assert record["summary"]["not_extracted_delta_norm"] == 0 and record["summary"]["diff_entries"] == len(record["diffs"])
    diff_keys = {k for k in weights if is_diff_key(k)}
    assert diff_keys == {d["key"] for d in record["diffs"]}
    assert "diffusion_model.blocks.0.self_attn.q.diff_b" in diff_keys  # a LoRA'd linear's bias, on its LoRA stem
    assert "diffusion_model.blocks.0.self_attn.q.lora_down.weight" in weights
    assert {"diffusion_model.blocks.0.norm3.diff", "diffusion_model.blocks.0.norm3.diff_b",
            "diffusion_model.blocks.0.self_attn.norm_q.diff", "diffusion_model.blocks.0.modulation.diff",
            "diffusion_model.patch_embedding.diff", "diffusion_model.head.modulation.diff"} <= diff_keys
    entry = next(d for d in record["diffs"] if d["key"] == "diffusion_model.blocks.0.self_attn.q.diff_b")
    assert entry["sources"] == ["blocks.0.attn1.to_q.bias"] and entry["dtype"] == "float32"
    assert torch.equal(weights[entry["key"]], state_actor["blocks.0.attn1.to_q.bias"] - state_base["blocks.0.attn1.to_q.bias"])
    # ComfyUI: the whole trained checkpoint
    assert_comfy_reproduces(base, actor, weights)
    # Diffusers: the LoRA and every `.diff_b` (as lora_B.bias); it drops the norms' and other diffs
    expected = copy.deepcopy(base)
    linear = {f"{n}.{p}" for n, m in base.named_modules() if isinstance(m, torch.nn.Linear) for p in ("weight", "bias")}
    expected.load_state_dict({k: (state_actor[k] if k in linear else v) for k, v in state_base.items()})
    pipe = pipeline_with("WanPipeline", copy.deepcopy(base))
    pipe.load_lora_weights(str(adapter_dir), weight_name=WEIGHTS, adapter_name="x")  # type: ignore[attr-defined]
    got = run_tiny_forward(pipe.transformer.eval())  # type: ignore[attr-defined]
    for want, out in zip(run_tiny_forward(expected.eval()), got, strict=True):
        torch.testing.assert_close(out, want, rtol=0, atol=1e-4)
    stripped = tmp_path / "stripped.safetensors"
    save_file({k: v for k, v in weights.items() if not k.endswith(".diff_b")}, str(stripped))
    pipe = pipeline_with("WanPipeline", copy.deepcopy(base))
    pipe.load_lora_weights(str(tmp_path), weight_name=stripped.name, adapter_name="x")  # type: ignore[attr-defined]
    without = run_tiny_forward(pipe.transformer.eval())  # type: ignore[attr-defined]
    assert max(float((a - b).abs().max()) for a, b in zip(without, got, strict=True)) > 1e-3
    assert validate_artifact(adapter_dir)["integrity"] == "passed"
    manifest = json.loads((adapter_dir / "merge_manifest.json").read_text())  # the entries are the file's tensors
    for entry in record["diffs"]:
        assert manifest["tensors"][entry["key"]] == {"dtype": entry["dtype"], "shape": entry["shape"]}
    assert EXTRACTION_NAME in manifest["files"]  # the record (with each entry's sha256) is hashed by the manifest
    # the UI lists every changed tensor and its entry
    from prefect_runs import latest_flow_run
    from test_ui import _artifact

    table = _artifact("merge-extraction-diffs-ckpt-step1", latest_flow_run("merge-ckpt-step1").id)
    rows = table.data if isinstance(table.data, list) else json.loads(table.data)
    assert {r["tensor"]: r["written_as"] for r in rows} == {n: i["written_as"] for n, i in listed.items()}
    # `test`: the record's entries are the file's, byte for byte
    tampered = dict(record, diffs=record["diffs"][1:])
    _rewrite_listed(adapter_dir, EXTRACTION_NAME, (json.dumps(tampered, indent=2, sort_keys=True) + "\n").encode())
    with pytest.raises(ArtifactInvalidError, match="disagree on the .diff entries"):
        validate_artifact(adapter_dir)
    tampered = dict(record, diffs=[dict(record["diffs"][0], sha256="0" * 64)] + record["diffs"][1:])
    _rewrite_listed(adapter_dir, EXTRACTION_NAME, (json.dumps(tampered, indent=2, sort_keys=True) + "\n").encode())
    with pytest.raises(ArtifactInvalidError, match="does not hash to the sha256"):
        validate_artifact(adapter_dir)


def test_flux_fused_biases_and_norm_scales_reproduce_the_trained_checkpoint_in_comfyui(
    tmp_path: Path, prefect_api: object
) -> None:
    from test_comfyui_lora import pipeline_with

    # to_k's bias unchanged: its rows of the fused qkv bias diff are zeros
    base, actor, base_dir, actor_dir, other = fine_tuned(tmp_path, "FluxTransformer2DModel",
                                                         unchanged=("transformer_blocks.0.attn.to_k.bias",))
    adapter_dir = export_comfyui(actor_dir, base_dir, tmp_path / "out")
    record = json.loads((adapter_dir / EXTRACTION_NAME).read_text())
    weights = load_file(adapter_dir / WEIGHTS)
    assert all(item["written_as"] for item in record["not_extracted"]) and {i["name"] for i in record["not_extracted"]} == other
    qkv = next(d for d in record["diffs"] if d["key"] == "lora_unet_double_blocks_0_img_attn_qkv.diff_b")
    assert qkv["op"] == "cat" and qkv["sources"] == [f"transformer_blocks.0.attn.to_{p}.bias" for p in "qkv"]
    rows = weights[qkv["key"]].chunk(3)
    assert torch.count_nonzero(rows[1]) == 0 and torch.count_nonzero(rows[0]) > 0
    assert "diffusion_model.double_blocks.0.img_attn.norm.query_norm.scale.diff" in weights  # no lora_unet_ name
    final = next(d for d in record["diffs"] if d["key"] == "lora_unet_final_layer_adaLN_modulation_1.diff_b")
    assert final["op"] == "swap_halves"
    assert_comfy_reproduces(base, actor, weights)
    # Diffusers' kohya converter filters the diffs out and loads the LoRA as it would without them. (Its
    # single-block split assumes FLUX.1's widths, so the tiny model's double-block LoRA is what it can load.)
    double = {k: v for k, v in weights.items() if k.startswith("lora_unet_double_blocks_") and not is_diff_key(k)}
    diffs = {k: v for k, v in weights.items() if is_diff_key(k)}
    outputs = []
    for name, tensors in (("with", {**double, **diffs}), ("without", double)):
        save_file(tensors, str(tmp_path / f"{name}.safetensors"))
        pipe = pipeline_with("FluxPipeline", copy.deepcopy(base))
        pipe.load_lora_weights(str(tmp_path), weight_name=f"{name}.safetensors", adapter_name="x")  # type: ignore[attr-defined]
        outputs.append(run_tiny_forward(pipe.transformer.eval()))  # type: ignore[attr-defined]
    for a, b in zip(*outputs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert validate_artifact(adapter_dir)["integrity"] == "passed"


# The Diffusers loader that would refuse a file with `.diff` keys, as the record names it.
REFUSED = {
    "QwenImageTransformer2DModel": "_convert_non_diffusers_qwen_lora_to_diffusers",
    "LTX2VideoTransformer3DModel": "LTX2LoraLoaderMixin",
    "SD3Transformer2DModel": "SD3LoraLoaderMixin",
    "MiniMaxH3Transformer3DModel": "_convert_non_diffusers_minimax_h3_lora_to_diffusers",
}


@pytest.mark.parametrize("class_name", sorted(REFUSED))
def test_where_diffusers_would_refuse_the_file_the_diffs_are_left_out_and_listed(
    tmp_path: Path, prefect_api: object, class_name: str
) -> None:
    from test_comfyui_lora import CASES

    _, _, base_dir, actor_dir, other = fine_tuned(tmp_path, class_name)
    adapter_dir = export_comfyui(actor_dir, base_dir, tmp_path / "out")
    record = json.loads((adapter_dir / EXTRACTION_NAME).read_text())
    loader = REFUSED[class_name]
    listed = {i["name"]: i for i in record["not_extracted"]}
    assert record["diffs"] == [] and other <= set(listed)
    assert all(listed[n]["written_as"] is None and loader in listed[n]["reason"] for n in other)
    assert record["summary"]["not_extracted_delta_norm"] > 0
    assert not any(is_diff_key(k) for k in load_file(adapter_dir / WEIGHTS))
    assert validate_artifact(adapter_dir)["integrity"] == "passed"
    if class_name == "QwenImageTransformer2DModel":  # the whole file, as Diffusers reads it, still loads
        from test_comfyui_lora import pipeline_with

        pipe = pipeline_with(CASES[class_name][1], build_transformer(class_name, seed=0))
        pipe.load_lora_weights(str(adapter_dir), weight_name=WEIGHTS, adapter_name="x")  # type: ignore[attr-defined]
        peft = Path(merge_model(config(actor_dir, base_dir, tmp_path / "peft", extract_lora=RANK)).output_dir)
        record = json.loads((peft / "lora_adapter" / EXTRACTION_NAME).read_text())
        assert record["diffs"] == [] and all(i["reason"] == NOT_COMFYUI.format(fmt="peft") for i in record["not_extracted"])


def test_diffs_are_stored_in_the_output_dtype_and_their_rounding_recorded(tmp_path: Path, prefect_api: object) -> None:
    base, actor, base_dir, actor_dir, _ = fine_tuned(tmp_path, "WanTransformer3DModel")
    cfg = config(actor_dir, base_dir, tmp_path / "out", extract_lora=RANK, adapter_format="comfyui", dtype="bfloat16")
    adapter_dir = Path(merge_model(cfg).output_dir) / "lora_adapter"
    record = json.loads((adapter_dir / EXTRACTION_NAME).read_text())
    weights = load_file(adapter_dir / WEIGHTS)
    trained, original = actor.state_dict(), base.state_dict()
    assert weights["diffusion_model.blocks.0.self_attn.q.lora_down.weight"].dtype == torch.bfloat16
    by_key = {d["key"]: d for d in record["diffs"]}
    # Wan keeps its norms and modulation tables in float32 (_keep_in_fp32_modules): so do their diffs
    expected = {"diffusion_model.blocks.0.self_attn.q.diff_b": ("blocks.0.attn1.to_q.bias", torch.bfloat16),
                "diffusion_model.blocks.0.norm3.diff": ("blocks.0.norm2.weight", torch.float32),
                "diffusion_model.blocks.0.modulation.diff": ("blocks.0.scale_shift_table", torch.float32)}
    for key, (source, dtype) in expected.items():
        exact = trained[source].float() - original[source].float()
        assert weights[key].dtype == dtype and by_key[key]["dtype"] == str(dtype).removeprefix("torch.")
        assert torch.equal(weights[key], exact.to(dtype).reshape(weights[key].shape))
        assert by_key[key]["max_abs_rounding"] == float((exact.to(dtype).float() - exact).abs().max())
    assert by_key["diffusion_model.blocks.0.self_attn.q.diff_b"]["max_abs_rounding"] > 0
    assert validate_artifact(adapter_dir)["integrity"] == "passed"


def test_a_changed_bias_of_a_linear_without_a_lora_is_left_out_and_a_fused_bias_takes_zero_rows() -> None:
    from mergeflow.architectures.flux_lora import LORA_NAMING as FLUX
    from mergeflow.architectures.wan_lora import LORA_NAMING as WAN
    from mergeflow.lora.diffs import NO_LORA_BIAS, plan_diffs

    for class_name, naming, changed, lora in (
        ("WanTransformer3DModel", WAN, "blocks.0.attn1.to_q.bias", []),
        ("FluxTransformer2DModel", FLUX, "transformer_blocks.0.attn.to_k.bias", ["transformer_blocks.0.ff.net.2"]),
    ):
        model = build_transformer(class_name, seed=0)
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        linear = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        entries, left = plan_diffs(class_name, dict(model.config), shapes, [changed], linear, naming.plan(lora))
        assert entries == [] and left == {changed: NO_LORA_BIAS}
    # only to_k's bias changed, the fused qkv LoRA'd: one entry over all three parts (the others zero rows)
    entries, left = plan_diffs("FluxTransformer2DModel", dict(model.config), shapes, ["transformer_blocks.0.attn.to_k.bias"],
                               linear, FLUX.plan(["transformer_blocks.0.attn.to_q"]))
    assert left == {} and [(e.key, e.op, len(e.sources)) for e in entries] == [
        ("lora_unet_double_blocks_0_img_attn_qkv.diff_b", "cat", 3)]
