"""The runtime check: one denoising step of every architecture's tiny pipeline, through merge --smoke and alone.

Pipelines run a real one-step call (prompt encoding, scheduler, transformer; output_type="latent") with
tiny transformers whose widths match the fixtures' text encoders and VAEs. The other outputs load with
their own loaders (from_pretrained, from_single_file or the manifest's key map, GGUF/FP8 decoded, PEFT).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from builders import make_export
from fixtures.pipelines_image import (
    build_flux_pipeline,
    build_qwenimage_pipeline,
    build_sd3_pipeline,
    tiny_flux_transformer,
    tiny_qwenimage_transformer,
    tiny_sd3_transformer,
)
from fixtures.pipelines_video import (
    build_ltx2_pipeline,
    build_wan_pipeline,
    tiny_ltx2_transformer,
    tiny_wan_transformer,
)
from huggingface_hub import ModelCard
from pipeline_builders import Exported, export, make_actor

from mergeflow import merge_model
from mergeflow.errors import UsageError
from mergeflow.export.check.artifact_check import check_artifact
from mergeflow.ops.smoke import RuntimeCheckError, check_device, run_runtime_check

# name -> (tiny transformer matching the fixture pipeline's encoders, pipeline builder, pipeline class)
PIPELINES: dict[str, tuple[Any, Any, str]] = {
    "qwenimage": (tiny_qwenimage_transformer, build_qwenimage_pipeline, "QwenImagePipeline"),
    "sd3": (tiny_sd3_transformer, build_sd3_pipeline, "StableDiffusion3Pipeline"),
    "flux": (tiny_flux_transformer, build_flux_pipeline, "FluxPipeline"),
    "wan": (tiny_wan_transformer, build_wan_pipeline, "WanPipeline"),
    "ltx2": (tiny_ltx2_transformer, build_ltx2_pipeline, "LTX2Pipeline"),
}


def _digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module", params=sorted(PIPELINES))
def smoked(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, prefect_server: Any) -> tuple[str, Exported]:
    """Each architecture's tiny pipeline exported once with --smoke."""
    name = request.param
    make, build, _ = PIPELINES[name]
    root = tmp_path_factory.mktemp(f"smoke-{name}")
    transformer = make()
    base = build(root / "base", transformer)
    _, actor_dir = make_actor(transformer, root)
    item = Exported(base, actor_dir, transformer)
    return name, export(prefect_server, item, root / "out", smoke=True)


def test_merge_smoke_runs_one_pipeline_step_and_records_it(smoked: tuple[str, Exported]) -> None:
    name, item = smoked
    assert item.out is not None
    manifest = item.manifest
    assert manifest["verification"]["runtime"] == "passed"
    runtime = manifest["runtime"]
    assert runtime["loaded_as"] == f"DiffusionPipeline ({PIPELINES[name][2]})"
    assert runtime["step"] == "pipeline, 1 step" and runtime["device"] == "cpu" and runtime["dtype"] == "float32"
    assert runtime["seconds"] > 0 and runtime["peak_memory_bytes"] > 0
    output = runtime["output"]
    assert output["finite"] and output["shape"] == output["expected_shape"] and output["std"] > 0
    # The card says so, and the published artifact (card and runtime record included) validates.
    card = ModelCard.load(item.out / "README.md")
    assert "Runtime check: passed" in card.text and runtime["loaded_as"] in card.text
    assert check_artifact(str(item.out))["integrity"] == "passed"
    from mergeflow.flows.artifacts import runtime_rows

    (row,) = runtime_rows(runtime)  # the UI summary's row
    assert row.startswith(f"| runtime check | passed: {runtime['loaded_as']}, pipeline, 1 step on cpu")


def test_standalone_smoke_reports_and_never_rewrites(smoked: tuple[str, Exported], capsys: pytest.CaptureFixture[str],
                                                     prefect_api: Any) -> None:
    name, item = smoked
    if name != "flux":
        pytest.skip("one architecture is enough for the command line")
    assert item.out is not None
    before = _digests(item.out)
    from mergeflow.flows.cli import main

    assert main(["smoke", "--test_hf_dir", str(item.out)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["status"] == "passed" and result["loaded_as"] == "DiffusionPipeline (FluxPipeline)"
    # Same seed, same step: the same output as the merge recorded.
    assert result["output"] == item.manifest["runtime"]["output"]
    assert _digests(item.out) == before  # immutable: nothing rewritten


def test_a_device_this_machine_lacks_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(UsageError, match="no CUDA device"):
        check_device("cuda")
    from mergeflow.flows.cli import main

    assert main(["smoke", "--test_hf_dir", str(tmp_path), "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDA device" in err[0]


@pytest.fixture(scope="module")
def flux_transformer_export(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return make_export(tmp_path_factory.mktemp("smoke-transformer"), "FluxTransformer2DModel", 2)


def test_transformer_export_smoke(flux_transformer_export: Any, tmp_path: Path, prefect_api: Any) -> None:
    from builders import clone_export

    ex = clone_export(flux_transformer_export, tmp_path)
    result = merge_model(ex.config(smoke=True))
    manifest = json.loads(Path(result.manifest_path).read_text())
    assert manifest["runtime"]["loaded_as"] == "FluxTransformer2DModel.from_pretrained"
    assert manifest["runtime"]["step"] == "transformer forward"


@pytest.mark.parametrize("class_name,output_format,quantize,loaded", [
    ("SD3Transformer2DModel", "single_file", "none", "SD3Transformer2DModel.from_single_file"),
    # Diffusers' Flux converter hard-codes FLUX.1's width: the narrow test model loads through the key map.
    ("FluxTransformer2DModel", "single_file", "none", "via the manifest's key map (from_single_file"),
    ("SD3Transformer2DModel", "single_file", "fp8", "fp8_scaled_e4m3fn_per_tensor dequantized)"),
    ("WanTransformer3DModel", "gguf", "q8_0", "dequantized)"),
])
def test_single_file_outputs_smoke(tmp_path: Path, prefect_api: Any, class_name: str, output_format: str,
                                   quantize: str, loaded: str) -> None:
    ex = make_export(tmp_path, class_name, 2, dtype=torch.bfloat16 if quantize == "fp8" else None)
    overrides: dict[str, Any] = {"output_format": output_format, "quantize": quantize}
    if quantize == "fp8":
        overrides["dtype"] = "bfloat16"
    result = merge_model(ex.config(**overrides))
    out = Path(result.output_dir)
    before = _digests(out)
    record = run_runtime_check(out)
    assert loaded in record["loaded_as"] and record["output"]["finite"]
    assert _digests(out) == before


def test_a_non_finite_model_fails_the_merge_and_publishes_nothing(tmp_path: Path, prefect_api: Any) -> None:
    import copy

    from builders import Export

    from mergeflow.demo.checkpoints import (
        build_transformer,
        save_base_transformer,
        save_fsdp_checkpoint,
    )

    base = build_transformer("FluxTransformer2DModel", seed=0)
    base_dir = save_base_transformer(base, tmp_path / "base")
    actor = copy.deepcopy(base)
    with torch.no_grad():  # finite weights the exporter copies faithfully (it refuses nan/inf), whose output overflows
        actor.proj_out.weight.fill_(3e38)
    actor_dir = save_fsdp_checkpoint(actor, tmp_path / "ckpt" / "global_step_1" / "actor", 2)
    ex = Export(tmp_path, actor_dir, base_dir, actor, "FluxTransformer2DModel")
    with pytest.raises(RuntimeCheckError, match="not finite"):
        merge_model(ex.config(smoke=True))
    assert not (tmp_path / "out").exists()


def test_a_modular_minimax_h3_pipeline_runs_its_transformer_forward(tmp_path: Path, prefect_server: Any,
                                                                   prefect_api: Any) -> None:
    from fixtures.minimax_h3 import build_minimax_h3_modular

    from mergeflow.demo.checkpoints import build_transformer

    transformer = build_transformer("MiniMaxH3Transformer3DModel", seed=0)
    base = build_minimax_h3_modular(tmp_path / "base", transformer)
    index_path = base / "modular_model_index.json"  # as ModularPipeline.save_pretrained writes a local save
    index = json.loads(index_path.read_text())
    index["transformer_ref"][2]["pretrained_model_name_or_path"] = str(base)
    index_path.write_text(json.dumps(index, indent=2))
    actor, actor_dir = make_actor(transformer, tmp_path)
    item = export(prefect_server, Exported(base, actor_dir, actor), tmp_path / "out", smoke=True)
    runtime = item.manifest["runtime"]
    assert runtime["loaded_as"].startswith("MiniMaxH3Transformer3DModel.from_pretrained (transformer/")
    assert runtime["step"].startswith("transformer forward (a modular pipeline") and runtime["output"]["finite"]


EDITING = {"edit": "QwenImageEditPipeline", "edit_plus": "QwenImageEditPlusPipeline"}


@pytest.mark.parametrize("variant", sorted(EDITING))
def test_an_editing_pipeline_steps_on_an_input_image(tmp_path: Path, prefect_server: Any, prefect_api: Any,
                                                     variant: str) -> None:
    from fixtures.qwen_processor import load_edit_processor

    transformer = tiny_qwenimage_transformer()
    base = build_qwenimage_pipeline(tmp_path / "base", transformer, variant=variant)
    actor, actor_dir = make_actor(transformer, tmp_path)
    item = export(prefect_server, Exported(base, actor_dir, actor), tmp_path / "out")
    assert item.out is not None
    before = _digests(item.out)
    # The processor is passed in: its video processor needs torchvision, which the CPU torch here lacks.
    record = run_runtime_check(item.out, components={"processor": load_edit_processor(item.out / "processor")})
    assert record["loaded_as"] == f"DiffusionPipeline ({EDITING[variant]})" and record["step"] == "pipeline, 1 step"
    output = record["output"]
    assert output["finite"] and output["shape"] == output["expected_shape"] and output["std"] > 0
    # The transformer saw the input image's latents beside the 2x2 patches it denoises: more than 4 tokens.
    assert output["shape"][1] > 4, output
    assert _digests(item.out) == before


def test_a_remote_code_pipeline_steps_only_with_trust_remote_code(tmp_path: Path, prefect_server: Any,
                                                                  prefect_api: Any) -> None:
    from fixtures.boogu import build_boogu_pipeline, load_boogu_transformer
    from fixtures.qwen3vl import load_qwen3vl_processor

    base = build_boogu_pipeline(tmp_path / "base")
    actor, actor_dir = make_actor(load_boogu_transformer(base), tmp_path)
    item = export(prefect_server, Exported(base, actor_dir, actor), tmp_path / "out", trust_remote_code=True)
    assert item.out is not None
    components = {"processor": load_qwen3vl_processor(item.out / "processor")}  # torchvision, as above
    with pytest.raises(UsageError, match=r"BooguImagePipeline is the artifact's own code .*--trust-remote-code"):
        run_runtime_check(item.out, components=components)
    record = run_runtime_check(item.out, trust_remote_code=True, components=components)
    assert record["loaded_as"] == "DiffusionPipeline (BooguImagePipeline)" and record["step"] == "pipeline, 1 step"
    output = record["output"]
    assert output["finite"] and output["shape"] == output["expected_shape"] and output["std"] > 0


@pytest.mark.parametrize("qkv_layout", ["interleaved", "stacked"])
def test_a_native_minimax_h3_package_runs_its_transformer_as_the_actor_does(tmp_path: Path, prefect_server: Any,
                                                                           prefect_api: Any, qkv_layout: str) -> None:
    from fixtures.minimax_h3 import build_minimax_h3_native

    from mergeflow.demo.checkpoints import build_transformer
    from mergeflow.ops.smoke import transformer_step

    transformer = build_transformer("MiniMaxH3Transformer3DModel", seed=0)
    base = build_minimax_h3_native(tmp_path / "base", transformer)
    actor, actor_dir = make_actor(transformer, tmp_path)
    item = export(prefect_server, Exported(base, actor_dir, actor), tmp_path / "out", smoke=True, qkv_layout=qkv_layout)
    runtime = item.manifest["runtime"]
    assert item.manifest["artifact_type"] == "minimax_h3_pipeline" and runtime["status"] == "passed"
    assert runtime["loaded_as"].startswith(
        f"MiniMaxH3Transformer3DModel via Diffusers' native converter (qkv_layout={qkv_layout}")
    # The native weights, read back through Diffusers' converter in the declared row order, run as the actor
    # does: a wrong order (or a wrong rename) would run, finite, to another output.
    assert runtime["output"] == transformer_step(actor, "cpu", torch.float32)


@pytest.mark.parametrize("adapter_format,loaded", [
    ("peft", "PeftModel.from_pretrained onto the base transformer"),
    ("diffusers", "load_lora_adapter onto the base transformer"),
])
def test_an_adapter_runs_on_its_base(tmp_path: Path, prefect_api: Any, adapter_format: str, loaded: str) -> None:
    from lora_builders import build_lora_checkpoint
    from peft import LoraConfig

    ck = build_lora_checkpoint(tmp_path, "FluxTransformer2DModel",
                               lambda name: LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v"]),
                               world_size=2, layout="lora_only")
    out = Path(merge_model(ck.config(tmp_path / "out", base_model=str(ck.base_dir), adapter_format=adapter_format)).output_dir)
    with pytest.raises(UsageError, match="needs its base"):
        run_runtime_check(out)
    record = run_runtime_check(out, base=ck.base_dir)
    assert record["loaded_as"] == loaded and record["artifact_type"] == "peft_adapter" and record["output"]["finite"]
    # The adapter changes the output: the base alone gives another one.
    import diffusers

    from mergeflow.ops.smoke import transformer_step

    base = diffusers.FluxTransformer2DModel.from_pretrained(ck.base_dir, local_files_only=True)
    assert transformer_step(base, "cpu", torch.float32) != record["output"]
