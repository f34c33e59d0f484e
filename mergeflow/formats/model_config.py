"""A model's config file and a pipeline's index as the code passes them around once read.

Both are JSON objects on disk whose keys the model class or the pipeline defines (hundreds of them,
different per class), so they stay mappings; but a read-only one: once read and checked, a config
is an input that nothing edits in place. A changed config is a new mapping (mergeflow.io.config_paths
rewrites the bytes it copies; native_config builds its own).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# config.json of a Diffusers model (or another component's config file: scheduler_config.json,
# tokenizer_config.json, ...), as read; also a set of overrides to a model class's defaults.
ModelConfig = Mapping[str, Any]
# model_index.json (or modular_model_index.json) of a pipeline: component name -> [library, class],
# the `_class_name`/`_diffusers_version` metadata and the pipeline's own options (boundary_ratio, ...).
PipelineIndex = Mapping[str, Any]

