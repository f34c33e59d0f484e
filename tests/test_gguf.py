"""`--output_format gguf --quantize bf16|q8_0`: city96's ComfyUI-GGUF layout, bounded error instead of bit-exactness.

Real exports (rank files, the merge flow, the GGUF writer, publish, `test`) of tiny models 32 wide, so the
blocks' linear weights hold whole Q8_0 blocks and are really quantized. The file is read back with
`gguf.GGUFReader` + `gguf.quants.dequantize` (what ComfyUI-GGUF runs), turned back into the original
single-file layout and through Diffusers' own `from_single_file` into a model whose forward is compared
with the trained model's.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from builders import Export, float64_q8_0_errors, gguf_py_q8_0, tree_digest

from mergeflow import merge_model, validate_artifact
from mergeflow.architectures.gguf_layout import STRIPPED_PREFIX
from mergeflow.architectures.original_layout import layout_for
from mergeflow.demo.checkpoints import (
    build_transformer,
    perturb_,
    save_base_transformer,
    save_fsdp_checkpoint,
)
from mergeflow.demo.tiny_transformers import run_tiny_forward
from mergeflow.errors import ArtifactInvalidError, UsageError
from mergeflow.formats.gguf_quant import q8_0_bounds, q8_0_scales
from mergeflow.formats.quantization_summary import quantization_summary

FILE = "transformer.gguf"
ARCH = {"FluxTransformer2DModel": "flux", "SD3Transformer2DModel": "sd3", "WanTransformer3DModel": "wan",
        "LTX2VideoTransformer3DModel": "ltxv", "QwenImageTransformer2DModel": "qwen_image"}
# 32 wide (two heads of 16; Wan 64): every block's linear weight has rows of whole 32-value blocks.
WIDE: dict[str, dict[str, Any]] = {
    "FluxTransformer2DModel": {"attention_head_dim": 16, "num_attention_heads": 2, "axes_dims_rope": (4, 6, 6),
                               "joint_attention_dim": 32},
    "SD3Transformer2DModel": {"attention_head_dim": 16, "num_attention_heads": 2, "caption_projection_dim": 32,
                              "joint_attention_dim": 32},
    "QwenImageTransformer2DModel": {"attention_head_dim": 16, "num_attention_heads": 2, "axes_dims_rope": (4, 6, 6),
                                    "joint_attention_dim": 32},
    # Wan 64 wide: its 32-wide attention weights would hold 1,024 values, which convert.py keeps F32.
    "WanTransformer3DModel": {"attention_head_dim": 32, "num_attention_heads": 2, "ffn_dim": 128, "text_dim": 64},
    "LTX2VideoTransformer3DModel": {"attention_head_dim": 16, "num_attention_heads": 2, "cross_attention_dim": 32,
                                    "audio_attention_head_dim": 16, "audio_num_attention_heads": 2,
                                    "audio_cross_attention_dim": 32, "caption_channels": 32},
}
# The forward of the model built from the dequantized file, against the trained model's: max |diff| over max |ref|.
# Q8_0 weights are within ~1/254 of each block's max, BF16 within 2^-9 relative; measured on these models
# (two seeds' worth of slack): Q8_0 at most ~0.6%, BF16 ~0.2%. Recorded in the test report by `print`.
TOLERANCE = {"q8_0": 0.03, "bf16": 0.01}


def wide_export(root: Path, class_name: str, world_size: int = 2) -> Export:
    """make_export's checkpoint, 32 wide."""
    base = build_transformer(class_name, seed=0, config_overrides=WIDE[class_name])
    base_dir = save_base_transformer(base, root / "base")
    actor = copy.deepcopy(base)
    perturb_(actor, seed=1)
    actor_dir = save_fsdp_checkpoint(actor, root / "ckpt" / "global_step_1" / "actor", world_size)
    return Export(root, actor_dir, base_dir, actor, class_name)


def dequantized_original(out: Path) -> dict[str, torch.Tensor]:
    """The file as ComfyUI-GGUF reads it: each tensor dequantized, in its original shape, under its single-file key."""
    manifest = json.loads((out / "merge_manifest.json").read_text())
    original_key = {k.removeprefix(STRIPPED_PREFIX): k for k in manifest["original_layout"]["key_map"]}
    reader = gguf.GGUFReader(out / FILE)
    state = {}
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        field = reader.get_field(f"comfy.gguf.orig_shape.{t.name}")
        shape = [int(field.parts[i][0]) for i in field.data] if field is not None else list(reversed(t.shape.tolist()))
        state[original_key[t.name]] = torch.from_numpy(np.ascontiguousarray(values)).reshape(shape)
    return state


def load_dequantized(class_name: str, out: Path, tmp: Path) -> torch.nn.Module:
    """The dequantized file through Diffusers' own single-file conversion (Flux: the manifest's key map, see below)."""
    import diffusers
    from safetensors.torch import save_file

    state = dequantized_original(out)
    config = json.loads((out / "config.json").read_text())
    cls = getattr(diffusers, class_name)
    if class_name == "FluxTransformer2DModel":
        # Diffusers' Flux converter hard-codes FLUX.1's width (tests/test_single_file.py NARROW_UNREADABLE): the
        # manifest's key map (proven against that converter at FLUX.1's width in test_single_file_flux.py) inverts it.
        key_map = json.loads((out / "merge_manifest.json").read_text())["original_layout"]["key_map"]
        model = cls.from_config(config)
        diffusers_state = {}
        for key, entries in key_map.items():
            for source, start, end, swapped in entries:
                part = state[key] if len(entries) == 1 else state[key][int(start):int(end)]
                diffusers_state[source] = torch.cat(part.chunk(2)[::-1]) if swapped else part
        model.load_state_dict(diffusers_state, strict=True, assign=True)
        return model.eval()
    copy_path = tmp / "dequantized.safetensors"
    save_file(state, str(copy_path))
    kwargs = layout_for(class_name).loader_kwargs(config)
    return cls.from_single_file(str(copy_path), config=str(out), local_files_only=True, **kwargs).eval()


def _relative(expected: tuple[torch.Tensor, ...], got: tuple[torch.Tensor, ...]) -> float:
    return max(float((a.float() - b.float()).abs().max() / a.float().abs().max()) for a, b in zip(expected, got))


@pytest.mark.parametrize("method", ["q8_0", "bf16"])
@pytest.mark.parametrize("class_name", list(ARCH))
def test_the_dequantized_file_loads_and_forwards_within_tolerance(tmp_path: Path, prefect_api: object, class_name: str,
                                                                  method: str) -> None:
    ex = wide_export(tmp_path / "ckpt", class_name)
    out = Path(merge_model(ex.config(tmp_path / "out", output_format="gguf", quantize=method)).output_dir)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "merge_manifest.json", "merge_manifest.sha256", FILE]
    assert validate_artifact(out) == {"integrity": "passed", "architecture": class_name}

    reader = gguf.GGUFReader(out / FILE)
    field = reader.get_field("general.architecture")
    assert str(bytes(field.parts[field.data[-1]]), encoding="utf-8") == ARCH[class_name]
    assert not any(t.name.startswith(STRIPPED_PREFIX) for t in reader.tensors)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    manifest = json.loads((out / "merge_manifest.json").read_text())
    q = manifest["quantization"]
    assert q["method"] == method and q["architecture"] == ARCH[class_name] and manifest["artifact_type"] == "gguf"
    assert {k: r["type"] for k, r in q["tensors"].items()} == types
    for name, t in zip(types, reader.tensors):
        if len(manifest["tensors"][name]["shape"]) == 1 or t.n_elements <= 1024:
            assert types[name] == "F32", name  # convert.py: 1-D and small tensors stay F32
    main = "Q8_0" if method == "q8_0" else "BF16"
    assert sum(v == main for v in types.values()) >= 4, types  # the blocks' linear weights are really encoded
    # The model card says how, with what bound and (Q8_0) with what worst error, as the manifest records.
    card = (out / "README.md").read_text()
    summary = quantization_summary(q)
    assert summary is not None and summary.quantized == sum(v == main for v in types.values())
    assert f"Quantized ({summary.how()})" in card and summary.bound in card
    if method == "q8_0":
        assert summary.worst is not None
        worst = q["tensors"][summary.worst.tensor]
        assert f"Worst dequantization error against the source: {worst['max_abs_error']:.3g} abs" in card
    else:
        assert summary.worst is None and "Worst dequantization error" not in card

    trained = {k: v.detach() for k, v in ex.actor.state_dict().items()}
    if method == "q8_0":
        # Every Q8_0 tensor against its source: within each block's bound from the file's own scale, as recorded.
        from mergeflow.architectures.original_layout import to_original_state_dict

        config = json.loads((out / "config.json").read_text())
        source = {k.removeprefix(STRIPPED_PREFIX): v for k, v in
                  to_original_state_dict(layout_for(class_name), trained, config).items()}
        for t in reader.tensors:
            if t.tensor_type.name != "Q8_0":
                continue
            x = source[t.name].double().reshape(-1, 32)
            got = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)).reshape(-1, 32)
            err = (x - got).abs().amax(dim=1).numpy()
            assert (err <= q8_0_bounds(q8_0_scales(t.data))).all(), t.name
            assert q["tensors"][t.name]["max_abs_error"] == pytest.approx(float(err.max()), rel=0, abs=0)
            assert 0 < q["tensors"][t.name]["max_rel_error"] <= 1 / 254 + 1e-3

    model = load_dequantized(class_name, out, tmp_path)
    expected = run_tiny_forward(ex.actor.eval())
    got = run_tiny_forward(model)
    relative = _relative(expected, got)
    print(f"gguf {method} {class_name}: forward max |diff| / max |ref| = {relative:.2e} (tolerance {TOLERANCE[method]})")
    assert 0 < relative <= TOLERANCE[method]


def test_two_runs_give_identical_bytes_and_a_flipped_byte_is_caught(tmp_path: Path, prefect_api: object) -> None:
    import shutil

    ex = wide_export(tmp_path / "ckpt", "WanTransformer3DModel")
    first = Path(merge_model(ex.config(tmp_path / "a", output_format="gguf", quantize="q8_0")).output_dir)
    second = Path(merge_model(ex.config(tmp_path / "b", output_format="gguf", quantize="q8_0")).output_dir)
    assert tree_digest(first) == tree_digest(second)
    # Wan's 5-D patch embedding: F32, 2-D in the file, its shape in comfy.gguf.orig_shape (ComfyUI-GGUF's get_orig_shape).
    reader = gguf.GGUFReader(first / FILE)
    patch = next(t for t in reader.tensors if t.name == "patch_embedding.weight")
    field = reader.get_field("comfy.gguf.orig_shape.patch_embedding.weight")
    assert patch.tensor_type.name == "F32" and len(patch.shape) == 2
    assert [int(field.parts[i][0]) for i in field.data] == list(ex.actor.state_dict()["patch_embedding.weight"].shape)
    assert [t.name for t in field.types] == ["ARRAY", "INT32"]

    broken = tmp_path / "broken"
    shutil.copytree(first, broken)
    data = bytearray((broken / FILE).read_bytes())
    data[-7] ^= 0x01
    (broken / FILE).chmod(0o644)
    (broken / FILE).write_bytes(bytes(data))
    with pytest.raises(ArtifactInvalidError):
        validate_artifact(broken)


def _rewrite_manifest(out: Path, edit) -> None:  # type: ignore[no-untyped-def]
    path = out / "merge_manifest.json"
    path.chmod(0o644)
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest, indent=2))


def test_test_refuses_recorded_figures_the_file_does_not_reproduce(tmp_path: Path, prefect_api: object) -> None:
    import shutil

    ex = wide_export(tmp_path / "ckpt", "QwenImageTransformer2DModel", world_size=1)
    out = Path(merge_model(ex.config(tmp_path / "out", output_format="gguf", quantize="q8_0")).output_dir)
    manifest = json.loads((out / "merge_manifest.json").read_text())
    quantized = next(k for k, r in manifest["quantization"]["tensors"].items() if r["type"] == "Q8_0")
    f32 = manifest["quantization"]["kept_f32"][0]

    def edited(name: str, edit) -> Path:  # type: ignore[no-untyped-def]
        copy_dir = tmp_path / name
        shutil.copytree(out, copy_dir)
        _rewrite_manifest(copy_dir, edit)
        return copy_dir

    cases = {
        "scale": lambda m: m["quantization"]["tensors"][quantized].update(scale_max=1.0),
        "error": lambda m: m["quantization"]["tensors"][quantized].update(max_abs_error=1.0),
        "ratio": lambda m: m["quantization"]["tensors"][quantized].update(bound_ratio=1.5),
        "source": lambda m: m["quantization"]["tensors"][f32].update(source_sha256="0" * 64),
        "type": lambda m: m["quantization"]["tensors"][quantized].update(type="BF16"),
    }
    for name, edit in cases.items():
        with pytest.raises(ArtifactInvalidError):
            validate_artifact(edited(name, edit))


def test_an_architecture_without_a_gguf_loader_is_refused_before_any_work(tmp_path: Path, prefect_api: object) -> None:
    from builders import make_export

    ex = make_export(tmp_path / "ckpt", "MiniMaxH3Transformer3DModel", world_size=1)
    with pytest.raises(UsageError, match="--output_format gguf: MiniMax H3 has no GGUF loader"):
        merge_model(ex.config(tmp_path / "out", output_format="gguf", quantize="q8_0"))
    assert not (tmp_path / "out").exists()


def test_boogu_image_is_refused_in_one_line() -> None:
    # No tiny Boogu-Image exists to export (its remote code): the output's own pre-flight check, on its base layout.
    from mergeflow import ModelMergerConfig
    from mergeflow.architectures.registry import BaseLayout
    from mergeflow.outputs.registry import model_output

    config = ModelMergerConfig(local_dir="ckpt", target_dir="out", base_model="base", output_format="gguf", quantize="q8_0")
    layout = BaseLayout("transformer", "BooguImageTransformer2DModel", "BooguImageTransformer2DModel", Path("base"))
    with pytest.raises(UsageError, match="--output_format gguf: Boogu-Image has no GGUF loader"):
        model_output("gguf").check_base(config, layout)


@pytest.mark.parametrize(("quantize", "message"), [
    ("none", "--output_format gguf needs --quantize"),
    ("fp8", "--quantize fp8 is not available with --output_format gguf"),
])
def test_gguf_needs_one_of_its_encodings(tmp_path: Path, prefect_api: object, quantize: str, message: str) -> None:
    from builders import make_export

    ex = make_export(tmp_path / "ckpt", "QwenImageTransformer2DModel", world_size=1)
    with pytest.raises(UsageError, match=message):
        merge_model(ex.config(tmp_path / "out", output_format="gguf", quantize=quantize))
    assert not (tmp_path / "out").exists()


def test_the_q8_0_bound_holds_where_rounding_is_hardest() -> None:
    # Blocks gguf-py's Q8_0 finds hardest: ties (x/d at k + 1/2), scales that round up or down in float16, scales
    # below the float16 normal range (subnormal, and flushed to 0), all-zero blocks, a block with one large value.
    from mergeflow.formats.gguf_quant import q8_0_dequantize, q8_0_encode

    gen = torch.Generator().manual_seed(0)
    rows = [torch.randn(64, 32, generator=gen) * scale for scale in (1e-9, 3e-7, 6.1e-5, 1e-3, 1.0, 300.0)]
    ties = (torch.arange(32, dtype=torch.float32) - 15.5) / 15.5 * 127 / 127  # multiples of 1/31: many exact halves
    rows += [ties.reshape(1, 32) * s for s in (1.0, 2.0**-20, 2.0**-30, 1 + 2**-11, 1 - 2**-12)]
    rows += [torch.zeros(1, 32), torch.tensor([[1000.0] + [1e-3] * 31])]
    values = torch.cat([r.reshape(-1, 32) for r in rows]).to(torch.bfloat16).to(torch.float32).numpy()
    stored = gguf_py_q8_0(values)
    # The writer's torch quantizer makes gguf-py's bytes on exactly these blocks.
    encoded = q8_0_encode(torch.from_numpy(values), values.shape)
    assert np.array_equal(encoded.stored, stored)
    ours = q8_0_dequantize(torch.from_numpy(stored))
    theirs = gguf.quants.dequantize(stored, gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(ours.numpy().view(np.uint32), theirs.view(np.uint32))  # torch's dequantize is gguf-py's
    errors = float64_q8_0_errors(torch.from_numpy(values), stored, ours)
    assert encoded.errors == errors  # the writer's float32 errors, refined, are float64's
    assert 0 < errors["bound_ratio"] <= 1.0, errors
    # The bound is tight: half a step dominates, so the worst block uses most of it.
    assert errors["bound_ratio"] > 0.9, errors
    # Per block: no error above its bound, and the bound is at most ~0.57 of a step (not a loose multiple).
    x = values.astype(np.float64).reshape(-1, 32)
    err = np.abs(x - theirs.astype(np.float64).reshape(-1, 32)).max(axis=1)
    bounds = q8_0_bounds(q8_0_scales(stored))
    assert (err <= bounds).all()
    scales = np.abs(q8_0_scales(stored))
    normal = scales >= 2.0**-14
    assert (bounds[normal] <= 0.57 * scales[normal]).all()


def test_a_tensor_q8_0_cannot_hold_is_refused_not_written() -> None:
    # A block whose max |x| / 127 overflows float16 (x > 65504 * 127) gets an infinite scale: gguf-py would write
    # it; the writer measures it against the source and refuses it.
    from mergeflow.architectures.gguf_layout import architecture_for, encoding
    from mergeflow.errors import CheckpointError
    from mergeflow.export.write.gguf_writer import _encode
    from mergeflow.records import TensorLayout, TensorWrite

    shape = (16, 128)  # 2,048 values: above convert.py's F32 threshold
    tensor = torch.full(shape, 0.5)
    tensor[2, 40] = 1e7
    tw = TensorWrite("blocks.0.ffn.0.weight", "x", TensorLayout("x", "float32", shape, None, ((0,),), (shape,)), "float32")
    enc = encoding(architecture_for("WanTransformer3DModel"), tw.name, shape, "q8_0")
    assert enc.kind == "Q8_0"
    with pytest.raises(CheckpointError, match="exceeds its block-scale bound"):
        _encode(tw, enc, tensor)
    _, record = _encode(tw, enc, torch.full(shape, 0.5))
    # A constant block: q = 127 exactly, the whole error is the float16 rounding of its scale (127 |d - d_h|).
    assert 0 < record["max_abs_error"] <= 127 * 2.0**-11 * 0.5 / 127 * 1.01 and record["bound_ratio"] <= 1
