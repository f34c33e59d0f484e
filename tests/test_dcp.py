"""torch Distributed Checkpoint input, written by real gloo ranks with fully_shard + dcp.save."""

from __future__ import annotations

import collections
import copy
import datetime
import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from builders import assert_bit_exact, output_state

import mergeflow.errors as E
from mergeflow import validate_artifact
from mergeflow.demo.checkpoints import build_transformer, save_base_transformer
from mergeflow.formats import dcp
from mergeflow.sources import dcp as dcp_source
from tests.fixtures.dcp_writers import DcpCheckpoint


def _copy(ckpt: DcpCheckpoint, root: Path) -> Path:
    target = root / "pytorch_model_fsdp_0"
    shutil.copytree(ckpt.dcp_dir, target)
    return target


def _assert_reads_bit_exact(ckpt: DcpCheckpoint) -> dcp.DcpCheckpoint:
    parsed = dcp.open_dcp(ckpt.dcp_dir)
    chunks = dcp.DcpChunks(parsed)
    expected = {dcp.model_name(key): value for key, value in ckpt.trained.items()}
    assert set(parsed.tensors) == set(expected)
    for name, want in expected.items():
        got = dcp_source.read_tensor(chunks, name)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.contiguous().reshape(-1).view(torch.uint8)), name
    return parsed


def test_a_real_gloo_dcp_reads_back_bit_exact_with_uneven_and_empty_shards(accelerate_dcp: DcpCheckpoint) -> None:
    parsed = _assert_reads_bit_exact(accelerate_dcp)
    assert parsed.files == (".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp")
    assert all(not name.startswith("model.") for name in parsed.tensors)  # accelerate's wrapper stripped
    sizes = {t.chunk_shapes for t in parsed.tensors.values() if len(t.chunks) == 3}
    assert any(shapes[-1][0] == 0 for shapes in sizes), "the fixture must hold an empty trailing shard"
    assert any(len({s[0] for s in shapes}) > 1 for shapes in sizes), "the fixture must hold uneven shards"
    base = build_transformer(accelerate_dcp.class_name, seed=0)
    dcp_source.check_keys(parsed, {k: tuple(v.shape) for k, v in base.state_dict().items()})


def test_a_bf16_peft_dcp_reads_back_bit_exact(bf16_lora_dcp: DcpCheckpoint) -> None:
    parsed = _assert_reads_bit_exact(bf16_lora_dcp)
    names = set(parsed.tensors)
    assert any(n.endswith(".lora_A.default.weight") for n in names)
    assert any(n.endswith(".base_layer.weight") for n in names)
    assert not any(n.startswith("base_model.") for n in names)
    # PEFT keeps adapters in float32 beside bf16 base weights (autocast_adapter_dtype): both kinds must read back
    dtypes = {n: t.dtype for n, t in parsed.tensors.items()}
    assert {d for n, d in dtypes.items() if "lora_" not in n} == {"bfloat16"}
    assert {d for n, d in dtypes.items() if "lora_" in n} == {"float32"}


def test_source_files_hash_the_metadata_and_every_distcp(accelerate_dcp: DcpCheckpoint) -> None:

    parsed = dcp.open_dcp(accelerate_dcp.dcp_dir)
    digests = dcp.source_files(parsed)
    assert set(digests) == {".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"}
    for name, digest in digests.items():
        assert digest == hashlib.sha256((accelerate_dcp.dcp_dir / name).read_bytes()).hexdigest()


class _CreatesAFile:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("where", ["top_level", "inside_metadata"])
def test_a_malicious_metadata_is_refused_without_running_anything(accelerate_dcp: DcpCheckpoint, tmp_path: Path,
                                                                  where: str) -> None:
    target = _copy(accelerate_dcp, tmp_path)
    marker = tmp_path / "pwned"
    payload: object = _CreatesAFile(marker)
    if where == "inside_metadata":
        metadata = pickle.loads((target / ".metadata").read_bytes())  # our own, trusted fixture
        metadata.storage_meta = payload
        payload = metadata
    (target / ".metadata").write_bytes(pickle.dumps(payload))
    with pytest.raises(E.UnsafeCheckpointError, match="--trust-checkpoint") as info:
        dcp.open_dcp(target)
    assert "posix.system" in str(info.value) or "os.system" in str(info.value)
    assert "\n" not in str(info.value)
    assert not marker.exists()


def test_trust_checkpoint_admits_a_benign_global_the_closed_reader_refuses(accelerate_dcp: DcpCheckpoint,
                                                                          tmp_path: Path) -> None:
    target = _copy(accelerate_dcp, tmp_path)
    metadata = pickle.loads((target / ".metadata").read_bytes())
    metadata.planner_data = {"saved_at": datetime.datetime(2026, 1, 1)}
    (target / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(E.UnsafeCheckpointError, match="datetime"):
        dcp.open_dcp(target)
    parsed = dcp.open_dcp(target, trust_checkpoint=True)
    assert set(parsed.tensors) == {dcp.model_name(k) for k in accelerate_dcp.trained}


def _repickle_enum_members(target: Path, reduce: object) -> bytes:
    """Re-pickle our own (trusted) `.metadata` with the memory-format enum's members reduced by `reduce`."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    metadata = pickle.loads((target / ".metadata").read_bytes())
    original = _MEM_FORMAT_ENCODING.__reduce_ex__
    _MEM_FORMAT_ENCODING.__reduce_ex__ = reduce  # type: ignore[method-assign]
    try:
        data = pickle.dumps(metadata)
    finally:
        _MEM_FORMAT_ENCODING.__reduce_ex__ = original  # type: ignore[method-assign]
    (target / ".metadata").write_bytes(data)
    return data


def test_an_enum_member_pickled_by_name_reads_as_by_value(accelerate_dcp: DcpCheckpoint, tmp_path: Path) -> None:
    """Debian's Python 3.11.2 pickles an enum member as getattr(Enum, "NAME"): such a DCP reads, on any Python."""
    target = _copy(accelerate_dcp, tmp_path)
    expected = dcp.open_dcp(target)
    data = _repickle_enum_members(target, lambda self, proto: (getattr, (type(self), self._name_)))
    assert b"getattr" in data and b"TORCH_CONTIGUOUS_FORMAT" in data  # the 3.11.2 form, whatever Python runs this
    assert pickle.loads(data).state_dict_metadata  # and torch's own reader loads it
    parsed = dcp.open_dcp(target)
    assert parsed.tensors == expected.tensors
    for name, tensor in parsed.tensors.items():
        assert dcp.DcpChunks(parsed).local(0, tensor.key).shape == tensor.chunks[0].sizes, name


@pytest.mark.parametrize("lookup", ["another member name", "another owner"])
def test_any_other_getattr_in_metadata_is_refused(accelerate_dcp: DcpCheckpoint, tmp_path: Path, lookup: str) -> None:
    target = _copy(accelerate_dcp, tmp_path)
    if lookup == "another member name":  # getattr on the allowed enum, for an attribute that is not a member
        reduce = lambda self, proto: (getattr, (type(self), "__class__"))  # noqa: E731
    else:  # getattr on another admitted global (a dict class), the first step of calling its methods
        reduce = lambda self, proto: (getattr, (collections.OrderedDict, "fromkeys"))  # noqa: E731
    _repickle_enum_members(target, reduce)
    with pytest.raises(E.UnsafeCheckpointError, match="getattr outside the memory-format enum") as info:
        dcp.open_dcp(target)
    assert "\n" not in str(info.value) and "--trust-checkpoint" in str(info.value)


def test_a_truncated_metadata_is_refused_as_damaged(accelerate_dcp: DcpCheckpoint, tmp_path: Path) -> None:
    target = _copy(accelerate_dcp, tmp_path)
    data = (target / ".metadata").read_bytes()
    (target / ".metadata").write_bytes(data[: len(data) // 3])
    with pytest.raises(E.CheckpointError, match=r"\.metadata in pytorch_model_fsdp_0/ is truncated or damaged") as info:
        dcp.open_dcp(target)
    assert not isinstance(info.value, E.UnsafeCheckpointError)


def test_a_metadata_with_wrong_shapes_inside_is_refused_as_malformed(accelerate_dcp: DcpCheckpoint,
                                                                      tmp_path: Path) -> None:
    target = _copy(accelerate_dcp, tmp_path)
    metadata = pickle.loads((target / ".metadata").read_bytes())
    first = sorted(metadata.state_dict_metadata)[0]
    metadata.state_dict_metadata[first].chunks[0].sizes = None
    (target / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(E.CheckpointError, match="is malformed"):
        dcp.open_dcp(target)


def test_a_truncated_distcp_is_refused(accelerate_dcp: DcpCheckpoint, tmp_path: Path) -> None:
    target = _copy(accelerate_dcp, tmp_path)
    victim = target / "__1_0.distcp"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    with pytest.raises(E.CheckpointError, match=r"__1_0\.distcp is truncated"):
        dcp.open_dcp(target)


def test_damaged_chunk_bytes_are_refused_on_read(accelerate_dcp: DcpCheckpoint, tmp_path: Path) -> None:
    target = _copy(accelerate_dcp, tmp_path)
    victim = target / "__0_0.distcp"
    data = bytearray(victim.read_bytes())
    data[:64] = b"\0" * 64  # the first chunk's zip header
    victim.write_bytes(bytes(data))
    parsed = dcp.open_dcp(target)
    first = min(parsed.tensors.values(), key=lambda t: (t.chunks[0].file, t.chunks[0].offset))
    with pytest.raises(E.CheckpointError, match="damaged or not a tensor"):
        dcp_source.read_tensor(dcp.DcpChunks(parsed), first.name)


def test_a_metadata_that_names_a_missing_file_is_refused(accelerate_dcp: DcpCheckpoint, tmp_path: Path) -> None:
    target = _copy(accelerate_dcp, tmp_path)
    (target / "__2_0.distcp").unlink()
    with pytest.raises(E.CheckpointError, match=r"names __2_0\.distcp, which is missing"):
        dcp.open_dcp(target)


def test_a_dcp_whose_keys_do_not_match_the_base_is_refused(accelerate_dcp: DcpCheckpoint) -> None:
    parsed = dcp.open_dcp(accelerate_dcp.dcp_dir)
    other = build_transformer("SD3Transformer2DModel", seed=0)  # another architecture: some names agree
    with pytest.raises(E.SchemaMismatchError, match=r"lacks \d+ tensor"):
        dcp_source.check_keys(parsed, {k: tuple(v.shape) for k, v in other.state_dict().items()})
    same = {k: tuple(v.shape) for k, v in build_transformer(accelerate_dcp.class_name, seed=0).state_dict().items()}
    with pytest.raises(E.SchemaMismatchError, match="none of the"):  # a wrapper prefix nobody stripped
        dcp_source.check_keys(parsed, {f"transformer.{k}": shape for k, shape in same.items()})
    shape_off = dict(same, **{"proj_out.bias": (3,)})
    with pytest.raises(E.SchemaMismatchError, match=r"proj_out\.bias has shape \[2\]"):
        dcp_source.check_keys(parsed, shape_off)
    with pytest.raises(E.SchemaMismatchError, match="lacks 1 tensor"):
        dcp_source.check_keys(parsed, {**same, "extra_block.weight": (2, 2)})


def test_wrapper_prefixes_are_stripped_to_the_diffusers_names() -> None:
    assert dcp.model_name("model.transformer_blocks.0.attn.to_q.weight") == "transformer_blocks.0.attn.to_q.weight"
    assert dcp.model_name("base_model.model.proj_out.lora_A.default.weight") == "proj_out.lora_A.default.weight"
    assert dcp.model_name("module._fsdp_wrapped_module.proj_out.weight") == "proj_out.weight"
    assert dcp.model_name("model._orig_mod.norm_out.linear.bias") == "norm_out.linear.bias"


def test_a_dcp_dir_that_is_not_finished_says_so(tmp_path: Path) -> None:
    from mergeflow.formats.verl_checkpoint import read_fsdp_config

    unfinished = tmp_path / "pytorch_model_fsdp_0"
    unfinished.mkdir()
    (unfinished / "__0_0.distcp").write_bytes(b"x")
    with pytest.raises(E.CheckpointError, match="DCP checkpoint without .metadata: the save did not finish"):
        dcp.open_dcp(unfinished)
    with pytest.raises(E.CheckpointError, match="DCP checkpoint without .metadata: the save did not finish"):
        read_fsdp_config(unfinished)
    only_metadata = tmp_path / "only_metadata"
    only_metadata.mkdir()
    (only_metadata / ".metadata").write_bytes(b"\x80\x04")
    with pytest.raises(E.CheckpointError, match=r"no \*\.distcp"):
        dcp.open_dcp(only_metadata)
    with pytest.raises(E.CheckpointError, match="not a torch Distributed Checkpoint"):
        dcp.open_dcp(tmp_path)


def test_inspect_describes_a_dcp_from_its_metadata(bf16_lora_dcp: DcpCheckpoint) -> None:
    from mergeflow.export.describe import describe_checkpoint

    summary = describe_checkpoint(bf16_lora_dcp.dcp_dir)
    assert summary["layout"] == "DCP" and summary["world_size"] == 2
    assert summary["tensors"] == len(bf16_lora_dcp.trained)
    assert summary["lora_adapters"] == ["default"]
    assert summary["bytes"] == sum(t.numel() * t.element_size() for t in bf16_lora_dcp.trained.values())
    assert set(summary["dtypes"]) == {"bfloat16", "float32"}


# --- merge: a DCP through the whole export, every output kind ---------------------------------------------


def _merge(ckpt: DcpCheckpoint, target: Path, **overrides: object) -> tuple[Path, dict]:
    from mergeflow import merge_model
    from mergeflow.config import ModelMergerConfig

    values: dict[str, object] = dict(operation="merge", local_dir=str(ckpt.dcp_dir), base_model=str(ckpt.base_dir),
                                     target_dir=str(target), output_format="transformer")
    values.update(overrides)
    result = merge_model(ModelMergerConfig(**values))
    out = Path(result.output_dir)
    return out, json.loads((out / "merge_manifest.json").read_text())


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_a_dcp_merges_into_a_transformer_bit_exact_with_its_files_in_the_manifest(
        tmp_path: Path, prefect_api: object, accelerate_dcp: DcpCheckpoint) -> None:
    import diffusers

    out, manifest = _merge(accelerate_dcp, tmp_path / "out")
    expected = {dcp.model_name(k): v for k, v in accelerate_dcp.trained.items()}
    assert_bit_exact(expected, output_state(out))
    assert manifest["source_files"] == _digests(accelerate_dcp.dcp_dir)  # .metadata and every .distcp, nothing else
    assert set(manifest["source_files"]) == {".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"}
    base_config = accelerate_dcp.base_dir / "config.json"
    assert manifest["source_model_config"] == {"logical_path": "base_model/config.json",
                                               "sha256": hashlib.sha256(base_config.read_bytes()).hexdigest()}
    assert manifest["checkpoint"] == {"layout": "dcp", "world_size": 3}
    assert validate_artifact(out) == {"integrity": "passed", "architecture": accelerate_dcp.class_name}
    loaded = getattr(diffusers, accelerate_dcp.class_name).from_pretrained(out, local_files_only=True)
    assert_bit_exact(expected, {k: v.detach() for k, v in loaded.state_dict().items()})


def test_a_dcp_exports_an_original_single_file(tmp_path: Path, prefect_api: object, accelerate_dcp: DcpCheckpoint) -> None:
    from mergeflow.architectures.original_layout import layout_for, to_original_state_dict

    out, manifest = _merge(accelerate_dcp, tmp_path / "out", output_format="single_file")
    expected = {dcp.model_name(k): v for k, v in accelerate_dcp.trained.items()}
    config = json.loads((out / "config.json").read_text())
    assert_bit_exact(to_original_state_dict(layout_for(accelerate_dcp.class_name), expected, config), output_state(out))
    assert manifest["artifact_type"] == "single_file" and manifest["checkpoint"] == {"layout": "dcp", "world_size": 3}
    assert validate_artifact(out) == {"integrity": "passed", "architecture": accelerate_dcp.class_name}


def test_a_dcp_exports_a_gguf_file(tmp_path: Path, prefect_api: object, accelerate_dcp: DcpCheckpoint) -> None:
    import gguf
    import numpy as np

    from mergeflow.architectures.gguf_layout import gguf_key
    from mergeflow.architectures.original_layout import layout_for, to_original_state_dict

    out, manifest = _merge(accelerate_dcp, tmp_path / "out", output_format="gguf", quantize="bf16")
    expected = {dcp.model_name(k): v for k, v in accelerate_dcp.trained.items()}
    config = json.loads((out / "config.json").read_text())
    original = {gguf_key(k): v for k, v in to_original_state_dict(layout_for(accelerate_dcp.class_name), expected, config).items()}
    reader = gguf.GGUFReader(out / "transformer.gguf")
    assert {t.name for t in reader.tensors} == set(original)
    for t in reader.tensors:  # BF16 tensors: the bf16 cast of the DCP's tensor; F32 ones: the tensor itself
        got = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type))).reshape(original[t.name].shape)
        want = original[t.name].to(torch.bfloat16).float() if t.tensor_type.name == "BF16" else original[t.name].float()
        assert torch.equal(got, want), t.name
    assert manifest["artifact_type"] == "gguf" and manifest["checkpoint"] == {"layout": "dcp", "world_size": 3}
    assert manifest["quantization"]["method"] == "bf16"
    assert validate_artifact(out) == {"integrity": "passed", "architecture": accelerate_dcp.class_name}


def test_a_dcp_merges_into_a_sharded_bf16_pipeline_with_the_flag_s_config(
        tmp_path: Path, prefect_api: object, accelerate_dcp: DcpCheckpoint) -> None:
    from tests.fixtures.pipelines_image import build_flux_pipeline

    base = build_flux_pipeline(tmp_path / "pipeline", build_transformer(accelerate_dcp.class_name, seed=0))
    config_dir = tmp_path / "model_config"
    config_dir.mkdir()
    shutil.copy(base / "transformer" / "config.json", config_dir / "config.json")
    out, manifest = _merge(accelerate_dcp, tmp_path / "out", base_model=str(base), output_format="pipeline",
                           dtype="bfloat16", max_shard_size=4096, hf_model_config_path=str(config_dir))
    expected = {dcp.model_name(k): v.to(torch.bfloat16) for k, v in accelerate_dcp.trained.items()}
    shards = sorted((out / "transformer").glob("*.safetensors"))
    assert len(shards) > 1 and (out / "transformer" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    assert_bit_exact(expected, output_state(out / "transformer"))
    assert manifest["source_model_config"]["logical_path"] == "hf_model_config_path/config.json"
    assert manifest["artifact_type"] == "diffusers_pipeline" and manifest["dtype"] == "bfloat16"
    assert validate_artifact(out)["integrity"] == "passed"
    for copied in ("vae", "text_encoder", "scheduler"):  # the rest of the pipeline is the base's, byte for byte
        assert _digests(out / copied) == _digests(base / copied)


def test_a_peft_dcp_exports_its_adapter_and_fuses_it(
        tmp_path: Path, prefect_api: object, bf16_lora_dcp: DcpCheckpoint) -> None:
    from peft import PeftModel

    assert bf16_lora_dcp.peft is not None and bf16_lora_dcp.adapter_config is not None
    with pytest.raises(E.LoraError, match="pass --adapter-config PATH"):  # a DCP carries no r / lora_alpha
        _merge(bf16_lora_dcp, tmp_path / "refused", fuse_lora=True)
    assert not (tmp_path / "refused").exists()
    config = str(bf16_lora_dcp.adapter_config)
    fused_out, fused = _merge(bf16_lora_dcp, tmp_path / "fused", fuse_lora=True, adapter_config=config)
    exact = copy.deepcopy(bf16_lora_dcp.peft).to(torch.float32).merge_and_unload(adapter_names=["default"]).state_dict()
    ours = output_state(fused_out)
    assert {v.dtype for v in ours.values()} == {torch.bfloat16}
    assert_bit_exact({k: v.to(torch.bfloat16) for k, v in exact.items()}, ours)  # float32 math, rounded once
    assert fused["lora_fusion"]["r"] == 2 and fused["lora_fusion"]["lora_alpha"] == 4
    assert "lora_train_meta.json" not in fused["source_files"]
    assert validate_artifact(fused_out)["integrity"] == "passed"
    adapter_out, _ = _merge(bf16_lora_dcp, tmp_path / "adapter", adapter_config=config)
    base = build_transformer(bf16_lora_dcp.class_name, seed=0, dtype=torch.bfloat16)
    loaded = PeftModel.from_pretrained(base, str(adapter_out / "lora_adapter"))
    trained = {k: v for k, v in bf16_lora_dcp.peft.state_dict().items() if "lora_" in k}
    got = {k: v for k, v in loaded.state_dict().items() if "lora_" in k}
    assert_bit_exact(trained, got)
    assert validate_artifact(adapter_out)["integrity"] == "passed"


def test_the_cli_merges_and_tests_a_dcp_and_refuses_a_foreign_base_in_one_line(
        tmp_path: Path, prefect_server: object, accelerate_dcp: DcpCheckpoint) -> None:
    import forked_cli

    env = {**prefect_server.client_env(), "HF_HUB_OFFLINE": "1"}  # type: ignore[attr-defined]
    args = ["merge", "--backend", "fsdp", "--local_dir", str(accelerate_dcp.dcp_dir), "--output_format", "transformer"]
    done = forked_cli.mergeflow([*args, "--base_model", str(accelerate_dcp.base_dir), "--target_dir", str(tmp_path / "out")], env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["output_dir"] == str(tmp_path / "out")
    tested = forked_cli.mergeflow(["test", "--backend", "fsdp", "--local_dir", str(accelerate_dcp.dcp_dir),
                                   "--test_hf_dir", str(tmp_path / "out")], env)
    assert tested.returncode == 0, tested.stderr
    other = save_base_transformer(build_transformer("SD3Transformer2DModel", seed=0), tmp_path / "sd3")
    refused = forked_cli.mergeflow([*args, "--base_model", str(other), "--target_dir", str(tmp_path / "no")], env)
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    # the flow run's UI link, then one error line: the model config is the base's, so the keys tell
    errors = [line for line in lines if line.startswith("mergeflow: error:")]
    assert refused.returncode == 2 and all(line.startswith("mergeflow: ") for line in lines), refused.stderr
    assert len(errors) == 1 and "the checkpoint lacks" in errors[0] and lines[-1] == errors[0], refused.stderr
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("output_format", ["transformer", "single_file"])
def test_a_dcp_export_reads_streamed_chunks_in_place_never_copied(
        tmp_path: Path, prefect_api: object, accelerate_dcp: DcpCheckpoint, monkeypatch: pytest.MonkeyPatch,
        output_format: str) -> None:
    # `local` copies a chunk at an odd offset into an aligned tensor; the writer and its read-back of a streamed
    # tensor (and the single file's hash ahead) only use the bytes, so they read every chunk in place.
    typed: list[str] = []
    real = dcp.DcpChunks.local

    def local(self: dcp.DcpChunks, chunk: int, key: str) -> torch.Tensor:
        typed.append(key)
        return real(self, chunk, key)

    monkeypatch.setattr(dcp.DcpChunks, "local", local)
    out, _ = _merge(accelerate_dcp, tmp_path / "out", output_format=output_format)
    expected = {dcp.model_name(k): v for k, v in accelerate_dcp.trained.items()}
    if output_format == "transformer":
        assert_bit_exact(expected, output_state(out))
        assert typed == []
    else:
        from mergeflow.architectures.original_layout import layout_for, to_original_state_dict

        config = json.loads((out / "config.json").read_text())
        assert_bit_exact(to_original_state_dict(layout_for(accelerate_dcp.class_name), expected, config),
                         output_state(out))
        # Only the sources of computed tensors (a layout's reordered halves) are read as values.
        assert len(set(typed)) < len(expected) // 4, sorted(set(typed))
    assert validate_artifact(out) == {"integrity": "passed", "architecture": accelerate_dcp.class_name}
