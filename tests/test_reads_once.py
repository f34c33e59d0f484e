"""Plan once: during a real merge, every small input file is opened once (sys.addaudithook counts the opens)."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from builders import Export, clone_export

from mergeflow import merge_model
from mergeflow.config import ModelMergerConfig

_COUNTS: Counter[str] = Counter()
_WATCHED: list[str] = []


def _hook(event: str, args: tuple[Any, ...]) -> None:
    if event == "open" and _WATCHED and isinstance(args[0], str):
        path = args[0]
        if any(path.startswith(root) for root in _WATCHED):
            _COUNTS[path] += 1


sys.addaudithook(_hook)  # hooks cannot be removed: it counts only while _WATCHED names roots


@pytest.mark.parametrize("output_format", ["transformer", "pipeline"])
def test_each_input_file_is_opened_once(tmp_path: Path, prefect_api: Any, pristine_flux_w2: Export, output_format: str) -> None:
    ex = clone_export(pristine_flux_w2, tmp_path)
    config = ModelMergerConfig(operation="merge", local_dir=str(ex.actor_dir), base_model=str(ex.base_dir),
                               target_dir=str(tmp_path / "out"), output_format=output_format)
    _COUNTS.clear()
    _WATCHED[:] = [str(ex.actor_dir), str(ex.base_dir)]
    try:
        merge_model(config)
    finally:
        _WATCHED.clear()
    for path, n in sorted(_COUNTS.items()):
        print(n, path)
    assert 0
