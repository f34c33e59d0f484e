"""The model card: README.md for every output, listed in the manifest, byte for byte what huggingface_hub's ModelCard writes.

mergeflow renders the card without importing huggingface_hub (mergeflow/hub/model_card.py says why); every
card here is held to the bytes huggingface_hub's ModelCardData and ModelCard write for the same fields and
text. huggingface_hub's own parser reads each card back; its metadata is what the Hub shows (base model and
relation, library, pipeline tag); no path of this machine lands in it; `test` checks it like any file, and
the uploaded repo's card is the one written.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from builders import clone_export, make_export
from huggingface_hub import ModelCard, ModelCardData

from mergeflow import merge_model
from mergeflow.errors import ArtifactInvalidError, UsageError
from mergeflow.export.check.artifact_check import check_artifact
from mergeflow.formats.quantization_summary import quantization_summary
from mergeflow.hub.model_card import base_model_id, tensors_sha256

BASE_ID = "tiny-org/tiny-flux"


@pytest.fixture(scope="module")
def flux(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return make_export(tmp_path_factory.mktemp("card-flux"), "FluxTransformer2DModel", 2)


def _card(root: Path) -> tuple[ModelCard, dict[str, Any]]:
    manifest = json.loads((root / "merge_manifest.json").read_text())
    card = ModelCard.load(root / "README.md")  # huggingface_hub's own parser
    assert manifest["files"]["README.md"] == hashlib.sha256((root / "README.md").read_bytes()).hexdigest()
    # The metadata validates as the Hub's card data: every field round-trips through ModelCardData.
    data = card.data.to_dict()
    assert ModelCardData(**data).to_dict() == data
    # The bytes are huggingface_hub's: its ModelCardData and ModelCard write exactly this card from the same
    # fields (in ModelCardData's own order: the constructor's fields, then the others) and the same text.
    written = (root / "README.md").read_text(encoding="utf-8")
    assert str(ModelCard(f"---\n{ModelCardData(**data).to_yaml()}\n---\n{card.text}")) == written
    assert manifest["model_card"]["tensors_sha256"] == tensors_sha256(manifest["tensors"])
    assert manifest["model_card"]["tensors_sha256"] in card.text
    return card, manifest


def _no_local_paths(root: Path, *paths: Path) -> None:
    text = (root / "README.md").read_text()
    for path in paths:
        assert str(path) not in text


@pytest.mark.parametrize("output_format,quantize,relation,snippet", [
    ("transformer", "none", "finetune", "FluxTransformer2DModel.from_pretrained(repo"),
    ("single_file", "none", "finetune", "FluxTransformer2DModel.from_single_file("),
    ("single_file", "fp8", "quantized", "ComfyUI's scaled float8"),
    ("gguf", "q8_0", "quantized", "GGUFQuantizationConfig"),
    ("gguf", "bf16", "quantized", "GGUFQuantizationConfig"),
])
def test_every_model_output_has_a_card_the_hub_can_read(flux: Any, tmp_path: Path, prefect_api: Any, output_format: str,
                                                        quantize: str, relation: str, snippet: str) -> None:
    ex = clone_export(flux, tmp_path)
    overrides: dict[str, Any] = {"output_format": output_format, "quantize": quantize, "base_model_id": BASE_ID}
    if quantize == "fp8":
        overrides["dtype"] = "bfloat16"
    out = Path(merge_model(ex.config(**overrides)).output_dir)
    card, manifest = _card(out)
    assert card.data.base_model == BASE_ID and card.data.base_model_relation == relation
    assert card.data.library_name == "diffusers" and card.data.pipeline_tag == "text-to-image"
    assert "mergeflow" in card.data.tags and "FluxTransformer2DModel" in card.data.tags
    assert "run `ckpt`, step 1" in card.text and "world size 2" in card.text and snippet in card.text
    assert "Runtime check: not_run" in card.text and manifest["verification"]["runtime"] == "not_run"
    summary = quantization_summary(manifest.get("quantization"))
    if quantize == "none":
        assert summary is None and "read back bit-exact before publication" in card.text
    else:  # how, with what bound and with what error, as the manifest records them (GGUF: tests/test_gguf.py,
        # on models wide enough for Q8_0 blocks; this tiny one keeps every GGUF tensor F32)
        assert summary is not None
        assert "read back bit-exact before publication" not in card.text
        assert f"Quantized ({summary.how()})" in card.text and summary.bound in card.text
        if quantize == "fp8":
            assert summary.worst is not None and summary.quantized > 0
            worst = manifest["quantization"]["tensors"][summary.worst.tensor]
            assert f"{worst['max_abs_error']:.3g} abs, {worst['max_rel_error']:.3g} relative" in card.text
    _no_local_paths(out, tmp_path)
    assert check_artifact(str(out))["integrity"] == "passed"


def test_a_pipeline_card_names_its_base_from_the_hub_cache_and_says_video(tmp_path: Path, prefect_api: Any) -> None:
    from fixtures.pipelines_video import build_wan_pipeline, tiny_wan_transformer
    from pipeline_builders import Exported, make_actor

    transformer = tiny_wan_transformer()
    # A base as the Hub cache lays it out: its repo id is the card's base_model.
    base = build_wan_pipeline(tmp_path / "hub" / "models--Wan-AI--Wan2.1-T2V-1.3B-Diffusers" / "snapshots" / "abc123",
                              transformer)
    _, actor_dir = make_actor(transformer, tmp_path)
    item = Exported(base, actor_dir, transformer)
    out = Path(merge_model(item.config(tmp_path / "out")).output_dir)
    card, _ = _card(out)
    assert card.data.base_model == "Wan-AI/Wan2.1-T2V-1.3B-Diffusers" and card.data.base_model_relation == "finetune"
    assert card.data.pipeline_tag == "text-to-video"
    assert "DiffusionPipeline.from_pretrained(repo" in card.text
    _no_local_paths(out, tmp_path)


def test_adapter_and_fused_cards(tmp_path: Path, prefect_api: Any) -> None:
    from lora_builders import build_lora_checkpoint
    from peft import LoraConfig

    targets = ["to_q", "to_k", "to_v"]
    ck = build_lora_checkpoint(tmp_path / "a", "FluxTransformer2DModel",
                               lambda name: LoraConfig(r=4, lora_alpha=8, target_modules=targets), world_size=2,
                               layout="lora_only")
    # A LoRA-only adapter's base is a Hub id: the card names it; the adapter directory is the repo.
    out = Path(merge_model(ck.config(tmp_path / "a" / "out", base_model=BASE_ID)).output_dir)
    card, _ = _card(out / "lora_adapter")
    assert card.data.base_model == BASE_ID and card.data.base_model_relation == "adapter"
    assert card.data.library_name == "peft" and "lora" in card.data.tags
    assert "PeftModel.from_pretrained" in card.text
    _no_local_paths(out / "lora_adapter", tmp_path)
    assert check_artifact(str(out))["integrity"] == "passed"
    # Fused into the base: a merge of the base and the adapter.
    full = build_lora_checkpoint(tmp_path / "f", "FluxTransformer2DModel",
                                 lambda name: LoraConfig(r=4, lora_alpha=8, target_modules=targets), world_size=2)
    fused = Path(merge_model(full.config(tmp_path / "f" / "out", fuse_lora=True, base_model_id=BASE_ID)).output_dir)
    card, _ = _card(fused)
    assert card.data.base_model_relation == "merge" and card.data.library_name == "diffusers"


def test_an_edited_card_fails_test(flux: Any, tmp_path: Path, prefect_api: Any) -> None:
    ex = clone_export(flux, tmp_path)
    out = Path(merge_model(ex.config()).output_dir)
    written, _ = _card(out)  # no Hub id for a local base: neither base_model nor its relation is declared
    assert written.data.base_model is None and "base_model_relation" not in written.data.to_dict()
    card = out / "README.md"
    card.chmod(0o644)
    card.write_text(card.read_text().replace("finetune", "merge"))
    with pytest.raises(ArtifactInvalidError, match="README.md"):
        check_artifact(str(out))


def test_base_model_id_sources_and_refusal() -> None:
    assert base_model_id("org/flag", "/x", "org/named") == "org/flag"
    assert base_model_id(None, "", "org/named") == "org/named"
    assert base_model_id(None, "/cache/models--a--b/snapshots/r1/", None) == "a/b"
    assert base_model_id(None, "/models/flux", "flux") is None  # a folder name is not a Hub id
    from mergeflow.config import ModelMergerConfig

    config = ModelMergerConfig(local_dir="/x", target_dir="/y", base_model="/z", base_model_id="/not/an/id")
    with pytest.raises(UsageError, match="--base-model-id"):
        config.validate()


def test_the_uploaded_repo_s_card_is_the_one_written(flux: Any, tmp_path: Path, prefect_api: Any,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from hub_server import LocalHubServer
    from huggingface_hub import constants
    from huggingface_hub.utils import close_session

    from mergeflow.hub.upload import upload_artifact

    ex = clone_export(flux, tmp_path)
    out = Path(merge_model(ex.config(base_model_id=BASE_ID)).output_dir)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with LocalHubServer() as server:
        monkeypatch.setattr(constants, "ENDPOINT", server.base_url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.base_url + "/{repo_id}/resolve/{revision}/{filename}")
        upload_artifact(out, "org/card", endpoint=server.base_url, token="hf_test_token", base_delay=0.01)
        stored = server.files("org/card")
    close_session()
    assert stored["README.md"].content == (out / "README.md").read_bytes()
    assert ModelCard(stored["README.md"].content.decode()).data.base_model == BASE_ID
