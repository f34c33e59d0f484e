"""MiniMax H3's original single file, proven by the loader that reads it: Diffusers' `from_single_file`.

Tiny real models, no mocks: the map's file must be detected as MiniMax H3, be consumed key for key
by Diffusers' own converter, and load back bit for bit; its keys and shapes are the native package's.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from mergeflow.architectures import original_layout
from mergeflow.architectures.minimax_h3 import INV_FREQ, native_shapes
from mergeflow.architectures.minimax_h3_single_file import ORIGINAL
from mergeflow.demo.tiny_transformers import build_transformer
from mergeflow.errors import SchemaMismatchError

H3 = "MiniMaxH3Transformer3DModel"
# (id, seed, dtype, config overrides): the tiny config, a deeper one, and bf16 weights.
VARIANTS = [
    ("tiny", 0, torch.float32, {}),
    ("deeper", 1, torch.float32, {"num_layers": 3, "num_refiner_layers": 2}),
    ("bf16", 2, torch.bfloat16, {"num_layers": 2}),
]


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _write(tmp_path: Path, seed: int, dtype: torch.dtype, overrides: dict[str, Any]) -> tuple[Any, Path, Path]:
    """A tiny H3, its single file (written through the map) and its saved config directory."""
    model = build_transformer(H3, seed=seed, dtype=dtype, config_overrides=overrides)
    state = model.state_dict()
    original = original_layout.to_original_state_dict(ORIGINAL, state, dict(model.config))
    path = tmp_path / "minimax_h3.safetensors"
    save_file(original, str(path))
    config_dir = tmp_path / "config"
    model.save_config(config_dir)
    return model, path, config_dir


@pytest.mark.parametrize(("seed", "dtype", "overrides"), [v[1:] for v in VARIANTS], ids=[v[0] for v in VARIANTS])
def test_single_file_loads_back_bit_for_bit(tmp_path: Path, seed: int, dtype: torch.dtype, overrides: dict[str, Any]) -> None:
    from diffusers import MiniMaxH3Transformer3DModel

    model, path, config_dir = _write(tmp_path, seed, dtype, overrides)
    kwargs = ORIGINAL.loader_kwargs(dict(model.config))
    # No torch_dtype: `from_single_file` has no keep-in-fp32 rule for bf16 (it would cast the fp32
    # modules a bf16 H3 keeps down), so it loads every tensor as float32, a widening that is exact.
    # The file's own mixed dtypes are checked bit for bit by the converter test below.
    loaded = MiniMaxH3Transformer3DModel.from_single_file(str(path), config=str(config_dir), local_files_only=True,
                                                          **kwargs)
    want, got = model.state_dict(), loaded.state_dict()
    assert set(got) == set(want)
    assert all(v.dtype == torch.float32 for v in got.values())
    unequal = [k for k in want if not _bits_equal(got[k], want[k].to(torch.float32))]
    assert not unequal, f"{len(unequal)} tensor(s) differ after the round trip, e.g. {unequal[:3]}"


@pytest.mark.parametrize(("seed", "dtype", "overrides"), [v[1:] for v in VARIANTS], ids=[v[0] for v in VARIANTS])
def test_single_file_is_detected_and_every_key_is_consumed(tmp_path: Path, seed: int, dtype: torch.dtype,
                                                           overrides: dict[str, Any]) -> None:
    from diffusers.loaders.single_file_utils import (
        convert_minimax_h3_transformer_checkpoint_to_diffusers,
        infer_diffusers_model_type,
    )

    model, path, _ = _write(tmp_path, seed, dtype, overrides)
    written = load_file(str(path))
    assert infer_diffusers_model_type(written) == "minimax-h3"
    # Diffusers' converter renames every key it is given: an unused file key would come out under a
    # name the model lacks, a missing one would leave a model key unset. Same key set = exact cover.
    config = dict(model.config)
    converted = convert_minimax_h3_transformer_checkpoint_to_diffusers(dict(written), config,
                                                                       **ORIGINAL.loader_kwargs(config))
    want = model.state_dict()
    assert sorted(converted) == sorted(want)
    assert all(_bits_equal(converted[k], want[k]) for k in want)


@pytest.mark.parametrize("overrides", [{}, {"num_layers": 4, "num_refiner_layers": 3}], ids=["tiny", "deeper"])
def test_single_file_schema_is_the_native_package(overrides: dict[str, Any]) -> None:
    model = build_transformer(H3, seed=0, config_overrides=overrides)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    config = dict(model.config)
    native = native_shapes(shapes, {"rope_inv_freq_len": config["rope_freq_dim"], "qkv_layout": "stacked"})
    native.pop(INV_FREQ)  # synthesised from the config: the single file leaves it to the loader
    assert original_layout.original_shapes(ORIGINAL, shapes, ORIGINAL.params(config)) == native
    blocks = {k.split(".")[1] for k in native if k.startswith("blocks.")}
    assert len(blocks) == config["num_layers"]  # depth comes from the names, not a fixed count


def _tiny_shapes() -> dict[str, tuple[int, ...]]:
    model = build_transformer(H3, seed=0)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


@pytest.mark.parametrize(("change", "named"), [
    (lambda s: s.pop("transformer_blocks.0.attn.to_v.weight"), r"blocks\.0\.attn\.qkv_proj\.weight"),
    (lambda s: s.update({"token_refiner.refiner_blocks.0.ff.net.0.proj.weight": (27, 25)}),
     r"token_refiner\.refiner_blocks\.0\.ff\.net\.0\.proj\.weight"),
    (lambda s: s.update({"transformer_blocks.0.attn.to_k.weight": (32, 25)}), r"blocks\.0\.attn\.qkv_proj\.weight"),
    (lambda s: s.update({INV_FREQ: (2,)}), r"rope\.inv_freq"),
], ids=["missing_to_v", "odd_geglu_rows", "unequal_qkv", "inv_freq_in_schema"])
def test_schema_that_does_not_fit_the_map_is_refused(change: Any, named: str) -> None:
    shapes = _tiny_shapes()
    change(shapes)
    with pytest.raises(SchemaMismatchError, match=named):
        original_layout.checked_plan(ORIGINAL, shapes, {})


def test_layout_is_registered_and_imports_without_torch() -> None:
    assert original_layout.layout_for(H3) is ORIGINAL
    assert ORIGINAL.architecture({}) == "minimax-h3"
    assert ORIGINAL.loader_kwargs({}) == {"qkv_layout": "stacked"}
    probe = ("import sys, mergeflow.architectures.minimax_h3_single_file; "
             "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", probe], check=True)
