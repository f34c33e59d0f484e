"""The remembered model schema: equal to building the class, rebuilt when damaged, no Diffusers import on a hit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import forked_cli
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


def test_a_remembered_schema_needs_no_diffusers_import(cache_dir: Path, prefect_server: Any) -> None:
    code = ("import json, sys; from mergeflow.architectures.schema import model_schema; "
            f"s = model_schema({FLUX!r}, json.loads(sys.argv[1])); "
            "print(len(s.tensors), 'diffusers' in sys.modules)")
    # The session server's client environment (the code never talks to it) lets tests/forked_cli.py fork
    # both runs from its pre-imported interpreter instead of importing torch cold twice. That one never
    # imports Diffusers (it refuses to serve if anything it preloads does), so each run imports it, or
    # not, itself, exactly as a fresh `python -c` does.
    env = prefect_server.client_env()
    runs = []
    for _ in range(2):
        proc = forked_cli.run(["-c", code, json.dumps(_config())], env)
        assert proc.returncode == 0, proc.stderr
        runs.append(proc.stdout.split())
    assert runs[0][0] == runs[1][0]
    assert runs[0][1] == "True" and runs[1][1] == "False"
