"""The output seam: a test-only output, registered from outside the package, goes through the real
flag parsing, merge flow, publish and `test`, and `test` refuses its artifact once its own check fails."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from builders import assert_bit_exact, clone_export, output_state
from toy_output import TOY, TOY_PREFIX, TOY_WEIGHTS

from mergeflow import merge_model, validate_artifact
from mergeflow.config import ADAPTER_FORMATS, OUTPUT_FORMATS, ModelMergerConfig
from mergeflow.errors import ArtifactInvalidError, UsageError
from mergeflow.flows.cli import build_parser
from mergeflow.formats.manifest import MANIFEST_NAME
from mergeflow.formats.seal import PIN_NAME
from mergeflow.io.jsonfiles import dumps_canonical
from mergeflow.outputs.registry import option_values, register_output, unregister_output

ROOT = Path(__file__).resolve().parents[1]
# A decision on which output is written, made outside mergeflow/outputs/: a comparison with an output
# format, an adapter format or an artifact type (or a list of artifact types to look one up in).
OUTPUT_BRANCH = re.compile(
    r"""(output_format|adapter_format|artifact_type)["'\]]*\s*(==|!=|in\s*[(\[{]|not in\s*[(\[{])"""
    r"""|(==|!=)\s*["'](peft_adapter|diffusers_transformer|diffusers_pipeline|minimax_h3_pipeline)["']"""
    r"""|ARTIFACT_TYPES""")

MERGE_ARGS = ["merge", "--backend", "fsdp", "--local_dir", "ckpt", "--target_dir", "out", "--base_model", "base", "--output_format", "toy"]


@pytest.fixture()
def toy() -> Iterator[None]:
    register_output(TOY)
    try:
        yield
    finally:
        unregister_output(TOY.name)  # other tests of this worker see the built-in outputs only


def test_no_output_branch_outside_the_outputs_package() -> None:
    found = []
    for top in ("mergeflow", "flows", "tasks", "deployments"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if "outputs" in path.relative_to(ROOT).parts:
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if OUTPUT_BRANCH.search(line) and "DEFAULT_ADAPTER_FORMAT" not in line:  # "was the flag given"
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)
    # The pattern does find the branches this package replaced.
    assert OUTPUT_BRANCH.search('if config.output_format == "pipeline":')
    assert OUTPUT_BRANCH.search('if manifest["artifact_type"] == "peft_adapter":')
    assert OUTPUT_BRANCH.search('if lora.adapter_format == "diffusers":')


def test_output_format_choices_come_from_the_registry(tmp_path: Path) -> None:
    assert list(OUTPUT_FORMATS) == ["pipeline", "transformer", "single_file", "gguf"]
    assert option_values("adapter_format") == ADAPTER_FORMATS  # the --adapter-format Literal cannot drift
    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(MERGE_ARGS)
    assert refused.value.code == 2
    config = _toy_config(tmp_path)
    with pytest.raises(UsageError, match="--output_format must be one of pipeline, transformer, single_file, gguf, not 'toy'"):
        config.validate()
    register_output(TOY)
    try:
        assert list(OUTPUT_FORMATS) == ["pipeline", "transformer", "single_file", "gguf", "toy"]
        assert build_parser().parse_args(MERGE_ARGS).output_format == "toy"
        config.validate()
        with pytest.raises(ValueError, match="already registered"):
            register_output(TOY)
    finally:
        unregister_output(TOY.name)
    assert "toy" not in OUTPUT_FORMATS


def _toy_config(tmp_path: Path) -> ModelMergerConfig:
    """A merge config that validate() judges on its flags alone (no path is read)."""
    return ModelMergerConfig(local_dir=str(tmp_path / "ckpt"), target_dir=str(tmp_path / "out"),
                             base_model=str(tmp_path / "base"), output_format="toy")


def test_toy_output_through_merge_publish_and_test(tmp_path: Path, prefect_api: object, pristine_flux_w2, toy: None) -> None:
    ex = clone_export(pristine_flux_w2, tmp_path)
    # A shard budget far below the weights' size: the toy's single-file writer still writes one file.
    result = merge_model(ex.config(output_format="toy", max_shard_size=20_000))
    out = Path(result.output_dir)
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["artifact_type"] == "toy_transformer" and manifest["tensor_directory"] == "."
    assert sorted(manifest["files"]) == ["README.md", "config.json", TOY_WEIGHTS]
    assert sorted(p.name for p in out.iterdir()) == sorted(["README.md", "config.json", TOY_WEIGHTS, MANIFEST_NAME, PIN_NAME])
    # The mapping hook renamed every tensor, bytes unchanged.
    published = output_state(out)
    expected = {TOY_PREFIX + key: value for key, value in ex.actor.state_dict().items()}
    assert set(published) == set(manifest["tensors"])
    assert_bit_exact(expected, published)
    assert validate_artifact(out) == {"integrity": "passed", "architecture": ex.class_name}

    # A consistent edit that every generic check accepts (hashes and manifest updated, header keys renamed
    # to the same length) still breaks the toy's own rule: `test` refuses it with the toy's message.
    _rename_published_key(out, next(iter(sorted(manifest["tensors"]))))
    with pytest.raises(ArtifactInvalidError, match="toy artifact: .* lacks the 'toy.' prefix"):
        validate_artifact(out)


def _rename_published_key(out: Path, key: str) -> None:
    renamed = "tot." + key.removeprefix(TOY_PREFIX)
    for path in (out, out / TOY_WEIGHTS, out / MANIFEST_NAME):
        path.chmod(0o755 if path.is_dir() else 0o644)  # published artifacts are read-only
    weights = out / TOY_WEIGHTS
    raw = bytearray(weights.read_bytes())
    header_len = int.from_bytes(raw[:8], "little")
    header = bytes(raw[8:8 + header_len])
    assert header.count(f'"{key}"'.encode()) == 1
    raw[8:8 + header_len] = header.replace(f'"{key}"'.encode(), f'"{renamed}"'.encode())
    weights.write_bytes(bytes(raw))
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    manifest["files"][TOY_WEIGHTS] = hashlib.sha256(bytes(raw)).hexdigest()
    manifest["tensors"][renamed] = manifest["tensors"].pop(key)
    (out / MANIFEST_NAME).write_text(dumps_canonical(manifest))
