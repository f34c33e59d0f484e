"""The one-pass quantize-and-measure of the FP8 and GGUF Q8_0 exports, and the read-back of the FP8 weights.

FP8 (`quantize_measured`): the export quantizes each weight once, in blocks, measuring its errors in the same
pass, and the writer's read-back compares the file with that tensor. Q8_0 (`q8_0_encode`): torch quantizes
runs of blocks as gguf-py does, bit for bit, each run measured and hashed as it is made. Here: on a real
model's weights and on odd sizes and edge values, the one pass gives exactly the bytes and exactly the
records (every number, every digest) of the straightforward whole-tensor computations the manifests were
made with before; it refuses what was refused before (inf, nan, a dequantized value off its bound); and a
write that puts other bytes in the file than the ones measured fails the export.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from builders import float64_q8_0_errors, gguf_py_q8_0, make_export
from test_single_file import FILE

from mergeflow import merge_model
from mergeflow.architectures import quantization
from mergeflow.architectures.quantization import (
    MEASURE_BLOCK,
    error_stats,
    quantize,
    quantize_measured,
    scale_of,
)
from mergeflow.demo.tiny_transformers import build_transformer
from mergeflow.errors import CheckpointError
from mergeflow.io.streamio import HashingWriter


def _flux_weights() -> Iterator[tuple[str, torch.Tensor]]:
    """Every 2-D weight of a real (small) Flux transformer, as the export quantizes them: bf16."""
    model = build_transformer("FluxTransformer2DModel", seed=0, dtype=torch.bfloat16,
                              config_overrides={"num_attention_heads": 2, "attention_head_dim": 64,
                                                "axes_dims_rope": (8, 28, 28), "num_layers": 1,
                                                "num_single_layers": 1})
    for name, value in model.state_dict().items():
        if name.endswith(".weight") and value.ndim == 2:
            yield name, value


def _edge_tensors() -> Iterator[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    odd = torch.randn(3, 2 * MEASURE_BLOCK + 7, generator=g) * 0.02  # blocks that end mid-row, a short last block
    odd[0, :MEASURE_BLOCK] = 0  # an all-zero block
    yield "odd", odd
    yield "one_block_and_one", torch.randn(MEASURE_BLOCK + 1, generator=g).reshape(1, -1)
    yield "tiny", torch.tensor([[448.0, -448.0, 0.0, 1e-30], [255.9, 256.1, -3.0e-3, 7.0]])
    yield "zeros", torch.zeros(33, 1001)
    yield "subnormal_scale", torch.full((5, 7), 1e-39)
    yield "wide", torch.randn(17, 129, generator=g) * 3e4
    yield "empty", torch.zeros(0, 16)


def _all_cases() -> list[tuple[str, torch.Tensor]]:
    return [*_flux_weights(), *_edge_tensors()]


def test_one_pass_gives_the_bytes_and_record_of_the_whole_tensor_computation() -> None:
    checked = 0
    for name, values in _all_cases():
        source = values.to(torch.bfloat16)
        scale = scale_of(source) if source.numel() else torch.tensor(1.0)
        q, record = quantize_measured(source, scale, name)
        want = quantize(source, scale)
        assert q.dtype == torch.float8_e4m3fn and q.shape == source.shape, name
        assert torch.equal(q.view(torch.uint8), want.view(torch.uint8)), name
        assert record == error_stats(source, want, scale, name), name  # every number equal, not just close
        checked += 1
    assert checked > 20  # the Flux model's weights were all there


def test_a_record_is_what_a_manifest_made_by_the_whole_tensor_computation_holds() -> None:
    # A record kept by an earlier export (error_stats at the time), as JSON: the one pass reproduces it.
    name, weight = next(_flux_weights())
    scale = scale_of(weight)
    kept = json.loads(json.dumps(error_stats(weight, quantize(weight, scale), scale, name)))
    assert quantize_measured(weight, scale, name)[1] == kept
    assert kept["max_abs_error"] > 0 and kept["amax"] > 0


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_inf_and_nan_are_refused_as_before(bad: float) -> None:
    source = torch.randn(4, 3 * MEASURE_BLOCK // 4, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    source.view(-1)[MEASURE_BLOCK + 5] = bad  # in the second block
    with pytest.raises(CheckpointError, match="inf or nan"):
        scale_of(source)  # what the writer calls first, as before
    # Given a finite scale anyway, the pass itself refuses the tensor (an inf would pass the bound: inf <= inf).
    with pytest.raises(CheckpointError, match="w holds inf or nan"):
        quantize_measured(source, torch.tensor(1.0), "w")


def test_of_several_blocks_that_break_the_bound_the_first_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    source = torch.randn(4 * MEASURE_BLOCK, generator=torch.Generator().manual_seed(8)) * 0.05
    first, later = 2 * MEASURE_BLOCK + 11, 3 * MEASURE_BLOCK + 5
    source[[first, later]] = 0.4  # the amax (7 sigma above the rest): the only elements coded 448
    source = source.to(torch.bfloat16)
    scale = scale_of(source)
    codes = quantize(source, scale).view(torch.uint8)
    code = int(codes[first])
    assert torch.nonzero(codes == code).reshape(-1).tolist() == [first, later]
    table = quantization._e4m3_table()
    wrong = table.clone()
    wrong[code] = table[code] * 0.9  # 448 read back as 403: far beyond half an ulp (16)
    monkeypatch.setattr(quantization, "_e4m3_table", lambda: wrong)
    with pytest.raises(CheckpointError, match=rf"w: dequantized element {first} is"):
        quantize_measured(source, scale, "w")


def test_a_dequantized_value_off_by_one_code_is_caught_in_its_block(monkeypatch: pytest.MonkeyPatch) -> None:
    source = torch.randn(3, MEASURE_BLOCK, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    scale = scale_of(source)
    code = int(quantize(source, scale).view(torch.uint8).reshape(-1)[2 * MEASURE_BLOCK + 9])
    table = quantization._e4m3_table()
    wrong = table.clone()
    wrong[code] = table[code + 1]  # this code would read back as the next one: a whole ulp off
    monkeypatch.setattr(quantization, "_e4m3_table", lambda: wrong)
    with pytest.raises(CheckpointError, match="beyond half an e4m3 ulp"):
        quantize_measured(source, scale, "w")


def test_a_write_of_other_bytes_than_the_measured_weight_fails_the_export(tmp_path: Path, prefect_api: object,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from mergeflow.export.write import shard_writer

    ex = make_export(tmp_path / "ckpt", "SD3Transformer2DModel", world_size=2)
    real_quantized, real_write = shard_writer.quantized_weight, HashingWriter.write
    pending: list[int] = []

    def quantized_weight(*args: object) -> torch.Tensor:
        q = real_quantized(*args)  # type: ignore[arg-type]
        pending.append(q.numel())
        return q

    def write(self: HashingWriter, view: memoryview) -> int:
        if pending and len(view) == pending[0]:  # the quantized weight's bytes: one flipped on its way to disk
            pending.clear()
            corrupted = bytearray(view)
            corrupted[len(corrupted) // 2] ^= 0x01
            return real_write(self, memoryview(bytes(corrupted)))
        return real_write(self, view)

    monkeypatch.setattr(shard_writer, "quantized_weight", quantized_weight)
    monkeypatch.setattr(HashingWriter, "write", write)
    with pytest.raises(Exception, match="round trip failed, cast piece 0 differs from the written bytes"):
        merge_model(ex.config(tmp_path / "fp8", output_format="single_file", quantize="fp8"))
    assert not (tmp_path / "fp8" / "merge_manifest.json").exists()


# --- GGUF Q8_0 ------------------------------------------------------------------------------------

def _whole_tensor_q8_0(tensor: torch.Tensor, stored_shape: tuple[int, ...]) -> tuple[np.ndarray, dict[str, object]]:
    """The figures as the writer computed them before: gguf-py on the whole tensor, then each figure in turn."""
    from mergeflow.export.write.gguf_writer import tensor_bytes_sha256
    from mergeflow.formats.gguf_quant import q8_0_dequantize, stored_figures

    values = tensor.to(torch.float32).reshape(stored_shape)
    stored = torch.from_numpy(gguf_py_q8_0(values.numpy()))
    dequantized = q8_0_dequantize(stored)
    record = {"source_sha256": tensor_bytes_sha256(tensor),
              **stored_figures(stored.numpy(), "Q8_0", dequantized.numpy()).to_json(),
              **float64_q8_0_errors(values, stored.numpy(), dequantized)}
    return stored.numpy(), record


def test_q8_0_one_pass_gives_the_bytes_and_figures_of_the_whole_tensor_computation() -> None:
    from mergeflow.formats.gguf_quant import Q8_0_RUN, q8_0_encode

    g = torch.Generator().manual_seed(6)
    odd = torch.randn(3, Q8_0_RUN + 5 * 32, generator=g) * 0.02  # runs that end mid-row, a short last run
    odd[1, :64] = 0  # all-zero blocks
    odd[2, 32] = 1000.0  # one large value in a block
    several = torch.randn(5, Q8_0_RUN * 3 // 2 + 7 * 32, generator=g) * 0.02  # runs across rows, mid-row
    cases = [*_flux_weights(), ("odd", odd), ("several_runs", several),
             ("tiny_scales", torch.randn(4, 96, generator=g) * 1e-9),
             ("overflow", torch.full((2, 64), 1e7))]  # a float16 scale that overflows: bound_ratio inf, as before
    checked = 0
    for name, values in cases:
        source = values.to(torch.bfloat16)
        if source.shape[-1] % 32:
            continue  # never Q8_0 (the layout keeps such tensors F32/BF16)
        want_stored, want = _whole_tensor_q8_0(source, tuple(source.shape))
        got = q8_0_encode(source, tuple(source.shape))
        assert got.stored.shape == want_stored.shape and np.array_equal(got.stored, want_stored), name
        assert {"source_sha256": got.source_sha256, **got.figures.to_json(), **got.errors} == want, name
        checked += 1
    assert checked > 20


def test_the_torch_q8_0_makes_gguf_py_s_bytes_and_float64_s_errors_on_edge_values() -> None:
    """`q8_0_quantize_run` against `gguf.quants.quantize` on float32 values (a float32 source keeps every bit
    the quantizer sees): ties of both signs at several scales, float32 subnormals, scales below float16's
    normal range and flushed to 0, scales that overflow float16, all-zero blocks, -0.0, one large value; and
    the errors recorded of them against float64's."""
    from mergeflow.formats.gguf_quant import Q8_0_RUN, q8_0_dequantize, q8_0_encode

    g = torch.Generator().manual_seed(11)
    ties = torch.arange(-16, 16, dtype=torch.float32) + 0.5  # halves, scaled so that x / d lands on k + 1/2 or near it
    rows = [torch.randn(256, 32, generator=g) * s for s in (1e-30, 1e-9, 3e-7, 6.1e-5, 0.02, 1.0, 300.0, 1e6)]
    rows += [ties.reshape(1, 32) * s for s in (1.0, -1.0, 2.0**-20, 2.0**-30, 1 + 2**-11, 1 - 2**-12, 1e5)]
    rows += [torch.tensor([[127.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5] + [63.5, -63.5] * 11 + [0.0, -0.0, 126.5]])]
    rows += [torch.full((1, 32), 1.4e-45), torch.tensor([[2.0**-126] * 16 + [-(2.0**-140)] * 16])]
    rows += [torch.zeros(2, 32), torch.full((1, 32), -0.0), torch.tensor([[1000.0] + [1e-3] * 31])]
    rows += [torch.full((1, 32), 65504.0 * 127 * 1.5), torch.full((1, 32), -65504.0 * 127)]  # f16 scale overflows
    rows += [torch.randn(3, Q8_0_RUN + 64, generator=g)]  # several runs, mid-row
    # A block whose float32 error is inexact: x = 1 - 2^-24 is q = 1 of d = 2 - 2^-13 (x / d just above 1/2),
    # d_h = f16(d) rounds up to 2, and x - 2 = -(1 + 2^-24) needs 25 bits; here it is each figure's maximum.
    inexact = torch.randn(4, 1024, generator=g) * 0.02
    inexact[2, 64:96] = torch.tensor([127 * (2 - 2.0**-13), 1 - 2.0**-24] + [0.0] * 30)
    assert float((inexact[2, 65] - 2.0).abs()) != 1 + 2.0**-24  # float32 alone is short of the exact error
    rows += [inexact]
    for values in rows:
        encoded = q8_0_encode(values, tuple(values.shape))
        stored = gguf_py_q8_0(values.numpy())
        assert np.array_equal(encoded.stored, stored), values.reshape(-1)[:4]
        assert encoded.errors == float64_q8_0_errors(values, stored, q8_0_dequantize(torch.from_numpy(stored)))
    assert encoded.errors["max_abs_error"] == 1 + 2.0**-24


@pytest.mark.parametrize("kind", ["Q8_0", "BF16", "F32"])
def test_scanning_a_stored_tensor_in_segments_gives_the_whole_tensor_figures(kind: str) -> None:
    """What `test` computes of a GGUF tensor, in segments on the cores, against gguf-py on the whole tensor."""
    from mergeflow.formats.gguf_quant import SCAN_VALUES, dequantize, scan_stored, stored_figures

    g = torch.Generator().manual_seed(9)
    values = (torch.randn(7, (SCAN_VALUES // 96 + 1) * 32, generator=g) * 0.03).to(torch.bfloat16)  # 3 segments, mid-row
    values[3, :64] = 0
    if kind == "Q8_0":
        stored, back_to = gguf_py_q8_0(values.float().numpy()), None
    elif kind == "BF16":
        stored, back_to = values.view(torch.uint8).numpy(), torch.bfloat16
    else:
        stored, back_to = values.float().numpy(), torch.bfloat16
    figures, back = scan_stored(stored, kind, back_to)  # type: ignore[arg-type]
    assert figures == stored_figures(stored, kind, dequantize(stored, kind))  # type: ignore[arg-type]
    if back_to is not None:  # the bytes of the source, taken back from the stored values
        assert back == hashlib.sha256(values.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
    else:
        assert back is None and figures.blocks == values.numel() // 32


# --- FP8 scales from the source pieces' range -----------------------------------------------------

def test_scales_from_the_pieces_range_are_the_whole_source_s(tmp_path: Path, prefect_api: object,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # Flux: fused (cat) sources; float32 ranks cast to bf16, so the cast of the min and max is what is compared.
    from mergeflow.export.write import quantized, shard_writer
    from mergeflow.lora import fusion

    ex = make_export(tmp_path / "ckpt", "FluxTransformer2DModel", world_size=2, dtype=torch.float32)
    whole: list[str] = []
    real = fusion.transformed_tensor

    def counted(tw: object, *args: object, **kwargs: object) -> torch.Tensor:
        if quantized.is_quantized_scale(tw):  # type: ignore[arg-type]
            whole.append(tw.name)  # type: ignore[attr-defined]
        return real(tw, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(fusion, "transformed_tensor", counted)
    ranged = Path(merge_model(ex.config(tmp_path / "ranged", output_format="single_file", quantize="fp8",
                                        dtype="bfloat16")).output_dir)
    assert not whole  # every scale came from its pieces' range
    monkeypatch.setattr(shard_writer, "quantized_scale", lambda tw, states: counted(tw, states))
    computed = Path(merge_model(ex.config(tmp_path / "whole", output_format="single_file", quantize="fp8",
                                          dtype="bfloat16")).output_dir)
    assert whole  # this time each scale was computed from its whole cast source
    assert (ranged / FILE).read_bytes() == (computed / FILE).read_bytes()
    assert (ranged / "merge_manifest.json").read_bytes() == (computed / "merge_manifest.json").read_bytes()


# --- FP8 weights quantized straight from their rank pieces ----------------------------------------

def _row_pieces(values: torch.Tensor) -> list[torch.Tensor]:
    """float32 rank pieces of a tensor split by rows as torch.chunk does for FSDP (uneven, an empty last one)."""
    rows = values.shape[0] if values.ndim else 1
    cut = [0, -(-rows // 2), rows, rows]
    flat_rows = values.reshape(rows, -1)
    return [flat_rows[a:b].clone() for a, b in zip(cut, cut[1:])]


def test_quantized_from_float32_rank_pieces_is_the_cast_whole_tensor_quantized() -> None:
    from mergeflow.architectures.quantization import quantize_pieces, scale_of_amax

    checked = 0
    for name, values in _all_cases():
        whole = values.to(torch.bfloat16)
        if not whole.numel():
            continue
        scale = scale_of(whole)
        want_q, want = quantize_measured(whole, scale, name)
        q, record, amax = quantize_pieces(_row_pieces(values.float()), torch.bfloat16, tuple(whole.shape), scale, name)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)), name
        assert record == want, name  # the source's sha256 is of the bf16 values, hashed block by block
        # The pass's own largest value proves the scale it was given.
        assert torch.equal(scale_of_amax(amax).view(torch.int32), scale.view(torch.int32)), name
        checked += 1
    assert checked > 20


def test_a_float32_piece_beyond_bf16_or_the_wrong_count_is_refused() -> None:
    from mergeflow.architectures.quantization import quantize_pieces

    pieces = [torch.ones(4, 8), torch.ones(3, 8)]
    pieces[1][2, 5] = 3.4e38  # finite in float32, inf in bf16
    with pytest.raises(CheckpointError, match="w holds inf or nan"):
        quantize_pieces(pieces, torch.bfloat16, (7, 8), torch.tensor(1.0), "w")
    with pytest.raises(CheckpointError, match=r"w: its pieces hold 56 values, its shape \[8, 8\] needs 64"):
        quantize_pieces([torch.ones(4, 8), torch.ones(3, 8)], torch.bfloat16, (8, 8), torch.tensor(1.0), "w")


def test_the_writer_quantizes_from_the_pieces_and_proves_the_scale_it_used(tmp_path: Path, prefect_api: object,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # Flux: plain and fused (cat of q, k, v and the MLP input) sources, float32 ranks cast to bf16 block by block.
    from mergeflow.export.write import quantized

    ex = make_export(tmp_path / "ckpt", "FluxTransformer2DModel", world_size=2, dtype=torch.float32)
    whole: list[str] = []
    real_source = quantized._source

    def read_whole(spec: object, states: object, **kwargs: object) -> torch.Tensor:
        whole.append(str(kwargs.get("name")))
        return real_source(spec, states, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(quantized, "_source", read_whole)
    out = Path(merge_model(ex.config(tmp_path / "pieces", output_format="single_file", quantize="fp8",
                                     dtype="bfloat16")).output_dir)
    assert not whole  # no weight was assembled or cast whole
    reference = Path(merge_model(ex.config(tmp_path / "bf16", output_format="single_file",
                                           dtype="bfloat16")).output_dir)
    from safetensors.torch import load_file

    state, bf16 = load_file(out / FILE), load_file(reference / FILE)
    records = json.loads((out / "merge_manifest.json").read_text())["quantization"]["tensors"]
    assert any("qkv" in k for k in records) and any("linear1" in k for k in records)  # fused ones too
    for key in records:  # the bytes of the whole-tensor path: quantize() of the bf16 tensor the plain export writes
        scale = state[key.removesuffix(".weight") + ".weight_scale"]
        assert torch.equal(state[key].view(torch.uint8), quantize(bf16[key], scale).view(torch.uint8)), key

    # A scale written wrong (twice amax / 448) is caught by the weight's own pass before anything is published.
    real_scale = quantized._checked_scale
    monkeypatch.setattr(quantized, "_checked_scale", lambda *a: real_scale(*a) * 2)  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match=r"quantized with scale .*, but its largest value .* gives"):
        merge_model(ex.config(tmp_path / "wrong", output_format="single_file", quantize="fp8", dtype="bfloat16"))
    assert not (tmp_path / "wrong").exists()
