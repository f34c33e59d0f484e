"""`--output_format single_file --quantize fp8`: ComfyUI's fp8 "scaled" file, error-bounded and proven.

Real exports (rank files, the merge flow, publish, `test`) of every architecture with a single-file layout.
The float8 weights are dequantized (fp8 -> float32 * scale), turned back into the Diffusers model (with
Diffusers' own `from_single_file` where it reads a tiny file; through the manifest's key map for Flux, whose
converter hard-codes FLUX.1's width), and the model's forward output is compared with the unquantized
model's within FORWARD_TOLERANCE (relative L2 error of every output), recorded here and in the README.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from builders import make_export, output_state
from test_single_file import (  # the single-file architectures; Flux read through its map
    CLASSES,
    FILE,
    NARROW_UNREADABLE,
)

from mergeflow import merge_model, validate_artifact
from mergeflow.architectures.original_layout import layout_for
from mergeflow.architectures.quantization import (
    METADATA_KEY,
    METHOD,
    error_stats,
    max_error_bound,
    quantize,
    scale_of,
)
from mergeflow.demo.tiny_transformers import run_tiny_forward
from mergeflow.errors import ArtifactInvalidError, CastError, CheckpointError, UsageError

# The stated tolerance: relative L2 error of the dequantized model's forward outputs against the bf16 model's.
# (e4m3 keeps 3 mantissa bits: each weight within 2**-4 of its value relative to its binade.)
FORWARD_TOLERANCE = 0.08


def _diffusers_state(file_state: dict[str, torch.Tensor], key_map: dict[str, list[list[Any]]]) -> dict[str, torch.Tensor]:
    """The Diffusers tensors back from an original-layout state, by the manifest's key map (rows, swapped halves)."""
    out: dict[str, torch.Tensor] = {}
    for key, entries in key_map.items():
        tensor = file_state[key]
        for source, start, end, swapped in entries:
            part = tensor if len(entries) == 1 else tensor[int(start):int(end)]
            if swapped:
                first, second = part.chunk(2, dim=0)
                part = torch.cat([second, first], dim=0)
            out[source] = part.contiguous()
    return out


def _dequantized(out: Path) -> dict[str, torch.Tensor]:
    """The file with every float8 weight dequantized (float32 * scale) and kept as float32, scales dropped."""
    state = output_state(out)
    deq: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key.endswith(".weight_scale"):
            continue
        scale = state.get(key.removesuffix(".weight") + ".weight_scale")
        deq[key] = value.to(torch.float32) * scale if scale is not None else value.to(torch.float32)
    return deq


def _model(class_name: str, out: Path, file_state: dict[str, torch.Tensor], copy: Path) -> torch.nn.Module:
    import diffusers
    from safetensors.torch import save_file

    cls = getattr(diffusers, class_name)
    if class_name in NARROW_UNREADABLE:
        manifest = json.loads((out / "merge_manifest.json").read_text())
        model = cls.from_config(json.loads((out / "config.json").read_text()))
        model.load_state_dict(_diffusers_state(file_state, manifest["original_layout"]["key_map"]), strict=True)
        return model.to(torch.float32).eval()
    save_file({k: v.contiguous() for k, v in file_state.items()}, str(copy))
    config = json.loads((out / "config.json").read_text())
    kwargs = layout_for(class_name).loader_kwargs(config)
    model = cls.from_single_file(str(copy), config=str(out), local_files_only=True, torch_dtype=torch.float32, **kwargs)
    return model.to(torch.float32).eval()


def _relative_l2(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> float:
    assert len(got) == len(want) and got
    return max(float((g.float() - w.float()).norm() / w.float().norm().clamp_min(1e-12)) for g, w in zip(got, want))


@pytest.mark.parametrize("class_name", CLASSES)
def test_fp8_file_is_comfyui_s_format_bounded_and_forwards_within_tolerance(tmp_path: Path, prefect_api: object,
                                                                          class_name: str) -> None:
    ex = make_export(tmp_path / "ckpt", class_name, world_size=2)
    ref = Path(merge_model(ex.config(tmp_path / "bf16", output_format="single_file", dtype="bfloat16")).output_dir)
    out = Path(merge_model(ex.config(tmp_path / "fp8", output_format="single_file", quantize="fp8")).output_dir)
    assert validate_artifact(out) == {"integrity": "passed", "architecture": class_name}

    from safetensors import safe_open

    with safe_open(str(out / FILE), framework="pt") as handle:
        metadata = handle.metadata()
    manifest = json.loads((out / "merge_manifest.json").read_text())
    record = manifest["quantization"]
    quantized = sorted(record["tensors"])
    assert quantized, "the rule quantizes the blocks' linear weights"
    assert record["method"] == METHOD
    # ComfyUI's `_quantization_metadata`: every quantized layer, by its key in the file, float8_e4m3fn.
    assert json.loads(metadata[METADATA_KEY]) == {
        "format_version": "1.0", "layers": {k.removesuffix(".weight"): {"format": "float8_e4m3fn"} for k in quantized}}
    state, reference = output_state(out), output_state(ref)
    assert set(state) == set(reference) | {k.removesuffix(".weight") + ".weight_scale" for k in quantized}
    assert sorted(record["excluded"]) == sorted(set(reference) - set(quantized))
    for key in reference:
        if key in record["tensors"]:
            scale = state[key.removesuffix(".weight") + ".weight_scale"]
            assert state[key].dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == ()
            source = reference[key]
            assert source.dtype == torch.bfloat16
            entry = record["tensors"][key]
            # The record's source is the bf16 original-layout tensor, its scale amax / 448, the float8 torch's cast.
            assert entry["source_sha256"] == hashlib.sha256(source.contiguous().view(torch.uint8).numpy()).hexdigest()
            assert float(scale) == entry["scale"] == float(source.float().abs().max() / 448)
            assert torch.equal(state[key].view(torch.uint8), quantize(source, scale).view(torch.uint8))
            err = (state[key].float() * scale - source.float()).abs().max()
            assert float(err) == entry["max_abs_error"] <= max_error_bound(entry["scale"], entry["amax"])
            assert "norm" not in key and "mod" not in key.split(".")[-2]
        else:
            assert state[key].dtype == torch.bfloat16
            assert torch.equal(state[key].view(torch.int16), reference[key].to(torch.bfloat16).view(torch.int16)), key

    # A tiny model from the dequantized weights forwards within the stated tolerance of the unquantized one.
    deq = _dequantized(out)
    got = run_tiny_forward(_model(class_name, out, deq, tmp_path / "dequantized.safetensors"))
    want = run_tiny_forward(_model(class_name, ref, {k: v.float() for k, v in reference.items()},
                                   tmp_path / "reference.safetensors"))
    error = _relative_l2(got, want)
    print(f"FORWARD {class_name} {error:.4f}")
    assert 0 < error <= FORWARD_TOLERANCE, (class_name, error)


def test_two_runs_give_identical_bytes_and_test_catches_tampering(tmp_path: Path, prefect_api: object) -> None:
    ex = make_export(tmp_path / "ckpt", "SD3Transformer2DModel", world_size=2)
    one = Path(merge_model(ex.config(tmp_path / "one", output_format="single_file", quantize="fp8")).output_dir)
    two = Path(merge_model(ex.config(tmp_path / "two", output_format="single_file", quantize="fp8")).output_dir)
    assert (one / FILE).read_bytes() == (two / FILE).read_bytes()
    assert (one / "merge_manifest.json").read_bytes() == (two / "merge_manifest.json").read_bytes()

    # A flipped byte in a float8 weight: the manifest's sha256.
    bad = tmp_path / "flipped"
    _copy_tree(one, bad)
    data = bytearray((bad / FILE).read_bytes())
    data[-3] ^= 0x01
    (bad / FILE).write_bytes(bytes(data))
    with pytest.raises(ArtifactInvalidError):
        validate_artifact(bad)


def _copy_tree(src: Path, dst: Path) -> None:
    import shutil

    shutil.copytree(src, dst)
    for path in dst.rglob("*"):
        path.chmod(0o644 if path.is_file() else 0o755)


def _rehash(out: Path, manifest: dict[str, Any]) -> None:
    """A consistent manifest (what an attacker or a bug would write): only the record's checks can refuse it."""
    (out / "merge_manifest.json").write_text(json.dumps(manifest, indent=2))


@pytest.mark.parametrize("edit", ["scale", "error", "set", "excluded"])
def test_test_refuses_a_record_that_does_not_fit_the_file(tmp_path: Path, prefect_api: object, edit: str) -> None:
    from mergeflow.formats.manifest import MANIFEST_NAME  # noqa: F401 - the manifest's name is the file written above
    from mergeflow.outputs.fp8_checks import check_quantization

    ex = make_export(tmp_path / "ckpt", "QwenImageTransformer2DModel", world_size=2)
    out = Path(merge_model(ex.config(tmp_path / "fp8", output_format="single_file", quantize="fp8")).output_dir)
    manifest = json.loads((out / "merge_manifest.json").read_text())
    check_quantization(out / FILE, manifest["original_layout"], manifest)  # as published: passes
    record = manifest["quantization"]
    first = min(record["tensors"])
    if edit == "scale":
        record["tensors"][first]["scale"] *= 2
    elif edit == "error":
        entry = record["tensors"][first]
        entry["max_abs_error"] = max_error_bound(entry["scale"], entry["amax"]) * 1.01
        entry["max_rel_error"] = entry["max_abs_error"] / entry["amax"]
    elif edit == "set":
        record["excluded"].append(first)
        del record["tensors"][first]
    else:
        record["excluded"] = record["excluded"][1:]
    with pytest.raises(ArtifactInvalidError):
        check_quantization(out / FILE, manifest["original_layout"], manifest)


# --- the numbers, on their edges -------------------------------------------------------------------

@pytest.mark.parametrize("values", [
    torch.zeros(4, 8),  # all zero: scale 1.0, everything encodes as 0 exactly
    torch.full((4, 8), 1e-39),  # amax / 448 below float32's normal range: scale 1.0, values round to 0
    torch.tensor([[448.0, -448.0, 0.0, 1e-30], [255.9, 256.1, -3.0e-3, 7.0]]),  # the clamp and the binade edges
    torch.randn(64, 48, generator=torch.Generator().manual_seed(0)) * 0.02,
    torch.randn(64, 48, generator=torch.Generator().manual_seed(1)) * 3e4,
])
def test_every_element_is_within_half_an_e4m3_ulp_times_the_scale(values: torch.Tensor) -> None:
    source = values.to(torch.bfloat16)
    scale = scale_of(source)
    assert scale.dtype == torch.float32 and scale.shape == ()
    if float(source.float().abs().max()) == 0 or float(source.float().abs().max()) / 448 < torch.finfo(torch.float32).tiny:
        assert float(scale) == 1.0
    q = quantize(source, scale)
    assert torch.equal(q.view(torch.uint8), quantize(source, scale).view(torch.uint8))  # deterministic
    stats = error_stats(source, q, scale, "w")
    assert stats["max_abs_error"] <= max_error_bound(stats["scale"], stats["amax"])
    assert math.isfinite(stats["max_rel_error"])


def test_a_value_off_by_one_code_is_caught_by_the_element_bound() -> None:
    source = (torch.randn(32, 32, generator=torch.Generator().manual_seed(2))).to(torch.bfloat16)
    scale = scale_of(source)
    q = quantize(source, scale).view(torch.uint8).clone()
    q[3, 5] += 1  # the next e4m3 code: a whole ulp away
    with pytest.raises(CheckpointError, match="beyond half an e4m3 ulp"):
        error_stats(source, q.view(torch.float8_e4m3fn), scale, "w")


# --- entry points ---------------------------------------------------------------------------------

def test_a_lora_adapter_export_with_quantize_is_refused_and_a_fused_one_quantizes(tmp_path: Path,
                                                                                  prefect_api: object) -> None:
    from lora_builders import ATTN_TARGETS, build_lora_checkpoint
    from peft import LoraConfig

    ck = build_lora_checkpoint(tmp_path, "SD3Transformer2DModel",
                               lambda name: LoraConfig(r=4, lora_alpha=8, target_modules=ATTN_TARGETS), world_size=2)
    with pytest.raises(UsageError, match="--quantize needs a full model"):
        merge_model(ck.config(tmp_path / "adapter", output_format="single_file", quantize="fp8"))
    assert not (tmp_path / "adapter").exists()
    out = Path(merge_model(ck.config(tmp_path / "fused", fuse_lora=True, output_format="single_file",
                                     quantize="fp8")).output_dir)
    manifest = json.loads((out / "merge_manifest.json").read_text())
    assert "lora_fusion" in manifest and manifest["quantization"]["tensors"]
    assert validate_artifact(out)["integrity"] == "passed"


def test_the_ui_summary_says_it_is_quantized_how_and_the_worst_error(tmp_path: Path, prefect_api: object) -> None:
    from mergeflow.flows.artifacts import quantization_rows

    ex = make_export(tmp_path / "ckpt", "WanTransformer3DModel", world_size=2)
    out = Path(merge_model(ex.config(tmp_path / "fp8", output_format="single_file", quantize="fp8")).output_dir)
    record = json.loads((out / "merge_manifest.json").read_text())["quantization"]
    rows = quantization_rows(record)
    worst = max(record["tensors"].values(), key=lambda e: e["max_rel_error"])
    assert rows[0].startswith(f"| quantized | {METHOD}: {len(record['tensors'])} tensors quantized")
    assert f"{worst['max_abs_error']:.3g} abs" in rows[1] and quantization_rows(None) == []


def test_served_and_backfilled_settings_carry_quantize(tmp_path: Path) -> None:
    from mergeflow.flows.checkpoint import resolve_checkpoint_config
    from mergeflow.io.confinement import Confinement
    from mergeflow.ops.serve_settings import ServeSettings

    actor = tmp_path / "run" / "global_step_3" / "actor"
    actor.mkdir(parents=True)
    (tmp_path / "base").mkdir()
    (tmp_path / "out").mkdir()
    confinement = Confinement.of([str(tmp_path / "run")], str(tmp_path / "out"), [str(tmp_path / "base")])
    config = resolve_checkpoint_config({"local_dir": str(actor)}, confinement=confinement, base_model=str(tmp_path / "base"),
                                       target_root=str(tmp_path / "out"), output_format="single_file", quantize="fp8")
    assert config.quantize == "fp8"
    settings = ServeSettings(base_model="/b", target_root="/t", checkpoint_roots=("/c",), output_format="single_file",
                             quantize="fp8")
    assert settings.parameters()["quantize"] == settings.backfill_parameters()["quantize"] == "fp8"


def test_fp8_with_another_dtype_is_refused_before_any_work(tmp_path: Path, prefect_api: object) -> None:
    ex = make_export(tmp_path / "ckpt", "QwenImageTransformer2DModel", world_size=2)
    with pytest.raises(UsageError, match="--quantize fp8 writes every unquantized tensor bf16"):
        merge_model(ex.config(tmp_path / "out", output_format="single_file", quantize="fp8", dtype="float16"))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value,error,message", [(float("nan"), CheckpointError, r"to_q\.weight \(rank 1\) holds inf or nan values"),
                                                 (3.4e38, CastError, r"casting transformer_blocks\.0\.attn\.to_q\.weight to bfloat16 overflows")])
def test_a_quantized_weight_that_is_broken_or_overflows_bf16_is_refused_for_what_it_is(
        tmp_path: Path, prefect_api: object, value: float, error: type[Exception], message: str) -> None:
    # The quantizer skips the finiteness scans of an unquantized export (scale_of proves the weight finite in its
    # own pass); a refusal then reads the weight again, checked, to say which it is: a broken weight, or a float32
    # value beyond bf16's range (the weights are bf16 before they are quantized).
    from rank_tools import rewrite_rank
    from torch.distributed.tensor import DTensor

    ex = make_export(tmp_path / "ckpt", "QwenImageTransformer2DModel", world_size=2)
    key = "transformer_blocks.0.attn.to_q.weight"

    def poison(state: dict[str, Any]) -> None:
        local = state[key].to_local() if isinstance(state[key], DTensor) else state[key]
        local.view(-1)[3] = value

    rewrite_rank(ex.actor_dir / "model_world_size_2_rank_1.pt", poison)
    with pytest.raises(error, match=message):
        merge_model(ex.config(tmp_path / "out", output_format="single_file", quantize="fp8"))
    assert not (tmp_path / "out").exists()
