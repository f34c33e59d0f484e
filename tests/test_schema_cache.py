"""The remembered model schema: equal to building the class, rebuilt when damaged, no Diffusers import on a hit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mergeflow.architectures.schema import model_schema
from mergeflow.demo.tiny_transformers import TINY_TRANSFORMER_CONFIGS
from mergeflow.errors import SchemaMismatchError

FLUX = "FluxTransformer2DModel"


@pytest.fixture()
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MERGEFLOW_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _config(**changes: object) -> dict:
    return {"_class_name": FLUX, **TINY_TRANSFORMER_CONFIGS[FLUX], **changes}


def test_a_cached_schema_equals_the_built_one_and_a_damaged_entry_is_rebuilt(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MERGEFLOW_SCHEMA_CACHE", "0")
    built = model_schema(FLUX, _config())
    assert not cache_dir.exists()
    monkeypatch.delenv("MERGEFLOW_SCHEMA_CACHE")
    first = model_schema(FLUX, _config())
    (entry,) = (cache_dir / "schemas").iterdir()
    assert model_schema(FLUX, _config()) == first == built
    assert built.tensors and "patch_size" in built.fields

    entry.write_text("{not json")
    assert model_schema(FLUX, _config()) == built
    assert json.loads(entry.read_text())["class_name"] == FLUX  # rewritten whole


def test_configs_that_differ_only_in_a_default_have_no_differences(cache_dir: Path) -> None:
    explicit = model_schema(FLUX, _config(out_channels=2))
    other = model_schema(FLUX, _config(num_layers=2))
    assert model_schema(FLUX, _config()).differences(explicit) == []
    assert model_schema(FLUX, _config()).differences(other) == ["num_layers: checkpoint 1 vs base 2"]


def test_an_unbuildable_config_is_refused_and_not_remembered(cache_dir: Path) -> None:
    with pytest.raises(SchemaMismatchError):
        model_schema(FLUX, _config(num_attention_heads="three"))
    assert not (cache_dir / "schemas").exists() or not list((cache_dir / "schemas").iterdir())


def test_a_remembered_schema_needs_no_diffusers_import(cache_dir: Path) -> None:
    code = ("import json, sys; from mergeflow.architectures.schema import model_schema; "
            f"s = model_schema({FLUX!r}, json.loads(sys.argv[1])); "
            "print(len(s.tensors), 'diffusers' in sys.modules)")
    env = dict(os.environ)
    runs = [subprocess.run([sys.executable, "-c", code, json.dumps(_config())], env=env, capture_output=True, text=True,
                           check=True).stdout.split() for _ in range(2)]
    assert runs[0][0] == runs[1][0]
    assert runs[0][1] == "True" and runs[1][1] == "False"
