"""Pipeline output end to end: tiny real base pipelines, real rank files, the merge flow, then Diffusers loads it."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures.boogu import (
    build_boogu_pipeline,
    load_boogu_pipeline,
    load_boogu_transformer,
)
from fixtures.pipelines_image import (
    build_flux_pipeline,
    build_qwenimage_pipeline,
    build_sd3_pipeline,
)
from fixtures.pipelines_video import build_ltx2_pipeline, build_wan_pipeline
from fixtures.qwen_processor import load_edit_processor
from pipeline_builders import (
    Exported,
    assert_copied_unchanged,
    assert_same_forward,
    assert_state_equal,
    export,
    make_actor,
    refused,
)

from mergeflow import validate_artifact
from mergeflow.demo.checkpoints import build_transformer
from mergeflow.errors import ArtifactInvalidError, BaseModelError, UsageError


@dataclass(frozen=True)
class Case:
    transformer_class: str
    build: Callable[[Path, torch.nn.Module], Path]
    pipeline_class: str
    overrides: dict[str, Any] | None = None  # tiny-config overrides of the transformer


def _wan22(root: Path, transformer: torch.nn.Module) -> Path:
    second = build_transformer("WanTransformer3DModel", seed=7)
    return build_wan_pipeline(root, transformer, transformer_2=second, boundary_ratio=0.875)


CASES: dict[str, Case] = {
    "qwenimage": Case("QwenImageTransformer2DModel", build_qwenimage_pipeline, "QwenImagePipeline"),
    "qwenimage_edit": Case("QwenImageTransformer2DModel", lambda r, t: build_qwenimage_pipeline(r, t, variant="edit"),
                           "QwenImageEditPipeline"),
    "qwenimage_edit_plus": Case("QwenImageTransformer2DModel",
                                lambda r, t: build_qwenimage_pipeline(r, t, variant="edit_plus"), "QwenImageEditPlusPipeline"),
    "sd35": Case("SD3Transformer2DModel", build_sd3_pipeline, "StableDiffusion3Pipeline"),
    "flux": Case("FluxTransformer2DModel", build_flux_pipeline, "FluxPipeline"),
    "flux_schnell": Case("FluxTransformer2DModel", build_flux_pipeline, "FluxPipeline", {"guidance_embeds": False}),
    "wan21": Case("WanTransformer3DModel", build_wan_pipeline, "WanPipeline"),
    "wan22": Case("WanTransformer3DModel", _wan22, "WanPipeline"),
    "ltx2": Case("LTX2VideoTransformer3DModel", build_ltx2_pipeline, "LTX2Pipeline"),
}


def _load(out: Path, name: str) -> Any:
    from diffusers import DiffusionPipeline

    extra = {"processor": load_edit_processor(out / "processor")} if name.startswith("qwenimage_edit") else {}
    return DiffusionPipeline.from_pretrained(out, local_files_only=True, **extra)


def _base_and_actor(root: Path, case: Case) -> Exported:
    transformer = build_transformer(case.transformer_class, seed=0, config_overrides=case.overrides)
    base = case.build(root / "base", transformer)
    actor, actor_dir = make_actor(transformer, root)
    return Exported(base, actor_dir, actor)


@pytest.fixture(scope="module", params=sorted(CASES))
def exported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, prefect_server: Any) -> tuple[str, Exported]:
    """Each architecture's base pipeline exported once (pipeline output is the default)."""
    name = request.param
    root = tmp_path_factory.mktemp(name)
    item = _base_and_actor(root, CASES[name])
    return name, export(prefect_server, item, root / "out")


def test_export_loads_as_its_pipeline_with_the_trained_transformer(exported: tuple[str, Exported]) -> None:
    name, item = exported
    assert item.out is not None
    pipe = _load(item.out, name)
    assert type(pipe).__name__ == CASES[name].pipeline_class
    assert_state_equal(pipe.transformer, item.actor)
    assert_same_forward(pipe.transformer, item.actor)
    if name == "wan22":
        base_pipe = _load(item.base, name)
        assert_state_equal(pipe.transformer_2, base_pipe.transformer_2)  # the second expert is untouched
        assert pipe.config.boundary_ratio == 0.875 and pipe.config.expand_timesteps is False


def test_every_other_file_is_the_base_s_and_the_artifact_validates(exported: tuple[str, Exported], prefect_api: Any) -> None:
    name, item = exported
    assert item.out is not None
    assert_copied_unchanged(item)
    manifest = item.manifest
    assert manifest["artifact_type"] == "diffusers_pipeline"
    assert manifest["architecture"] == CASES[name].pipeline_class
    assert manifest["tensor_directory"] == "transformer" and manifest["trained_components"] == ["transformer"]
    weights = {r for r in manifest["files"] if r.startswith("transformer/") and r.endswith(".safetensors")}
    assert weights == {"transformer/diffusion_pytorch_model.safetensors"}
    assert validate_artifact(item.out) == {"integrity": "passed", "architecture": CASES[name].pipeline_class}


# --- Wan2.2: a separately trained low-noise expert -------------------------------------------


def test_wan22_component_transformer_2_export(tmp_path: Path, prefect_server: Any, prefect_api: Any) -> None:
    transformer = build_transformer("WanTransformer3DModel", seed=0)
    second = build_transformer("WanTransformer3DModel", seed=7)
    base = build_wan_pipeline(tmp_path / "base", transformer, transformer_2=second, boundary_ratio=0.9)
    actor, actor_dir = make_actor(second, tmp_path, seed=3)
    item = export(prefect_server, Exported(base, actor_dir, actor), tmp_path / "out", component="transformer_2")
    assert item.out is not None
    assert item.manifest["trained_components"] == ["transformer_2"] and item.manifest["tensor_directory"] == "transformer_2"
    assert_copied_unchanged(item, trained="transformer_2")  # transformer/ included, byte for byte
    pipe = _load(item.out, "wan22")
    assert_state_equal(pipe.transformer_2, actor)
    assert_state_equal(pipe.transformer, transformer)
    assert pipe.config.boundary_ratio == 0.9
    validate_artifact(item.out)


# --- Boogu-Image: remote code ----------------------------------------------------------------


def _boogu_forward(model: Any) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 4, 8, 8, generator=generator)
    features = torch.randn(1, 5, 12, generator=generator)
    with torch.no_grad():
        return (model.eval()(latents, torch.tensor([0.3]), features, torch.ones(1, 5, dtype=torch.bool)).sample,)


@pytest.fixture(scope="module")
def boogu(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    root = tmp_path_factory.mktemp("boogu")
    base = build_boogu_pipeline(root / "base")
    actor, actor_dir = make_actor(load_boogu_transformer(base), root)
    return Exported(base, actor_dir, actor)


def test_boogu_needs_trust_remote_code(boogu: Exported, tmp_path: Path, prefect_server: Any, prefect_api: Any) -> None:
    refused(prefect_server, boogu, tmp_path / "out", BaseModelError, r"Python code .*--trust-remote-code")


def test_boogu_remote_code_export_reloads_with_trust_remote_code(boogu: Exported, tmp_path: Path, prefect_server: Any, prefect_api: Any) -> None:
    item = export(prefect_server, boogu, tmp_path / "out", trust_remote_code=True)
    assert item.out is not None
    assert_copied_unchanged(item)
    assert {"transformer/transformer_boogu.py", "pipeline.py"} <= set(item.manifest["files"])
    pipe = load_boogu_pipeline(item.out)
    assert type(pipe).__name__ == "BooguImagePipeline"
    assert_state_equal(pipe.transformer, boogu.actor)
    assert_same_forward(pipe.transformer, boogu.actor, _boogu_forward)
    validate_artifact(item.out)


# --- The pipeline contract: refusals before any output ----------------------------------------


@pytest.fixture(scope="module")
def flux(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    return _base_and_actor(tmp_path_factory.mktemp("flux_contract"), CASES["flux"])


@pytest.fixture(scope="module")
def wan22(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    return _base_and_actor(tmp_path_factory.mktemp("wan22_contract"), CASES["wan22"])


def _json_edit(path: Path, **changes: Any) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data, indent=2))


def _drop_vocab(base: Path) -> None:
    for name in ("tokenizer.json", "vocab.json"):
        (base / "tokenizer" / name).unlink()


def _symlink_component(base: Path) -> None:
    moved = base.parent / "vae-elsewhere"
    (base / "vae").rename(moved)
    (base / "vae").symlink_to(moved, target_is_directory=True)


def _symlink_file(base: Path) -> None:
    (base / "LICENSE").rename(base.parent / "LICENSE-elsewhere")
    (base / "LICENSE").symlink_to(base.parent / "LICENSE-elsewhere")


BREAKAGES: dict[str, tuple[Callable[[Path], None], str]] = {
    "missing_component": (lambda b: shutil.rmtree(b / "vae"), r"vae/ is missing"),
    "missing_weights": (lambda b: (b / "text_encoder" / "model.safetensors").unlink(), r"text_encoder/ has no model.safetensors"),
    "wrong_scheduler_class": (lambda b: _json_edit(b / "scheduler" / "scheduler_config.json", _class_name="UniPCMultistepScheduler"),
                              r"names 'UniPCMultistepScheduler'.*declares 'FlowMatchEulerDiscreteScheduler'"),
    "tokenizer_without_vocab": (_drop_vocab, r"tokenizer/ has no vocabulary file"),
    "unknown_component": (lambda b: _json_edit(b / "model_index.json", safety_checker=["transformers", "CLIPModel"]),
                          r"unknown for FluxPipeline"),
    "quantized": (lambda b: _json_edit(b / "text_encoder" / "config.json", quantization_config={"quant_method": "bitsandbytes"}),
                  r"quantized"),
    "auto_map": (lambda b: _json_edit(b / "tokenizer" / "tokenizer_config.json", auto_map={"AutoTokenizer": "x.Tok"}),
                 r"auto_map"),
    "python_without_trust": (lambda b: (b / "helpers.py").write_text("print('hi')\n"), r"helpers.py.*--trust-remote-code"),
    "symlinked_component": (_symlink_component, r"component directory vae/ of the base is a symlink"),
    "symlinked_file": (_symlink_file, r"LICENSE of the base is a symlink"),
    "local_path_in_config": (lambda b: _json_edit(b / "vae" / "config.json", cache=str(b / "vae")), r"names the base directory"),
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_contract_refusals_leave_nothing(flux: Exported, tmp_path: Path, prefect_server: Any, prefect_api: Any, breakage: str) -> None:
    base = tmp_path / "base"
    shutil.copytree(flux.base, base)
    damage, match = BREAKAGES[breakage]
    damage(base)
    item = Exported(base, flux.actor_dir, flux.actor)
    refused(prefect_server, item, tmp_path / "out", BaseModelError, match)


def test_missing_processor_is_refused(tmp_path: Path, prefect_server: Any, prefect_api: Any) -> None:
    item = _base_and_actor(tmp_path, CASES["qwenimage_edit"])
    (item.base / "processor" / "preprocessor_config.json").unlink()
    refused(prefect_server, item, tmp_path / "out", BaseModelError, r"processor/ has no processor_config.json or preprocessor_config.json")


@pytest.mark.parametrize("changes,match", [
    ({"boundary_ratio": 1.5}, r"boundary_ratio must be a number in \(0, 1\)"),
    ({"boundary_ratio": None}, r"transformer_2 but no boundary_ratio"),
    ({"expand_timesteps": "yes"}, r"expand_timesteps must be true or false"),
], ids=["ratio-1.5", "ratio-missing", "expand-not-bool"])
def test_bad_wan22_options_are_refused(wan22: Exported, tmp_path: Path, prefect_server: Any, prefect_api: Any,
                                      changes: dict[str, Any], match: str) -> None:
    base = tmp_path / "base"
    shutil.copytree(wan22.base, base)
    _json_edit(base / "model_index.json", **changes)
    refused(prefect_server, Exported(base, wan22.actor_dir, wan22.actor), tmp_path / "out", BaseModelError, match)


def test_component_that_training_cannot_replace_is_refused(flux: Exported, tmp_path: Path, prefect_server: Any, prefect_api: Any) -> None:
    refused(prefect_server, flux, tmp_path / "out", UsageError, r"--component vae: a FluxPipeline checkpoint can replace transformer",
            component="vae")


def test_local_paths_are_removed_from_copied_configs_and_recorded(flux: Exported, tmp_path: Path, prefect_server: Any, prefect_api: Any) -> None:
    base = tmp_path / "base"
    shutil.copytree(flux.base, base)
    _json_edit(base / "text_encoder" / "config.json", _name_or_path=str(base / "text_encoder"))
    _json_edit(base / "tokenizer" / "tokenizer_config.json", name_or_path=str(base), vocab_file=str(base / "tokenizer" / "vocab.json"))
    (base / ".cache" / "huggingface").mkdir(parents=True)
    (base / ".cache" / "huggingface" / "download.metadata").write_text("etag\n")
    item = export(prefect_server, Exported(base, flux.actor_dir, flux.actor), tmp_path / "out")
    assert item.out is not None
    assert item.manifest["config_transform"]["removed_keys"] == {
        "text_encoder/config.json": ["_name_or_path"],
        "tokenizer/tokenizer_config.json": ["name_or_path", "vocab_file"],
    }
    assert item.manifest["config_transform"]["not_copied"][".cache/"] == "download tool state"
    assert not (item.out / ".cache").exists()
    for path in item.out.rglob("*.json"):
        assert str(tmp_path) not in path.read_text(), path
    tokenizer_config = json.loads((item.out / "tokenizer" / "tokenizer_config.json").read_text())
    original = json.loads((base / "tokenizer" / "tokenizer_config.json").read_text())
    assert list(tokenizer_config) == [k for k in original if k not in ("name_or_path", "vocab_file")]  # order kept
    pipe = _load(item.out, "flux")
    assert pipe.tokenizer("a cat").input_ids == _load(base, "flux").tokenizer("a cat").input_ids
    assert validate_artifact(item.out)["integrity"] == "passed"


def test_test_command_checks_pipeline_components(flux: Exported, tmp_path: Path, prefect_server: Any, prefect_api: Any) -> None:
    item = export(prefect_server, Exported(flux.base, flux.actor_dir, flux.actor), tmp_path / "out")
    assert item.out is not None
    broken = tmp_path / "broken"
    shutil.copytree(item.out, broken)
    (broken / "vae" / "config.json").write_text("{}")
    with pytest.raises(ArtifactInvalidError, match="sha256"):
        validate_artifact(broken)
    renamed = tmp_path / "renamed"
    shutil.copytree(item.out, renamed)
    _json_edit(renamed / "model_index.json", _class_name="StableDiffusion3Pipeline")
    manifest = json.loads((renamed / "merge_manifest.json").read_text())
    manifest["files"]["model_index.json"] = hashlib.sha256((renamed / "model_index.json").read_bytes()).hexdigest()
    (renamed / "merge_manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")  # canonical, as written
    with pytest.raises(ArtifactInvalidError, match="model_index.json names 'StableDiffusion3Pipeline'"):
        validate_artifact(renamed)
    dropped = tmp_path / "dropped"
    shutil.copytree(item.out, dropped)
    shutil.rmtree(dropped / "vae")
    manifest = json.loads((dropped / "merge_manifest.json").read_text())
    manifest["files"] = {rel: d for rel, d in manifest["files"].items() if not rel.startswith("vae/")}
    (dropped / "merge_manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    with pytest.raises(ArtifactInvalidError, match="declares component 'vae', but the artifact has no vae/"):
        validate_artifact(dropped)
