"""mergeflow: FSDP2 diffusion checkpoints in, verified and published Diffusers artifacts out.

The public API is exposed lazily so that importing a domain module (``mergeflow.formats.manifest``,
say) never pulls in Prefect or the flows that import the domain back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "ModelMergerConfig": "mergeflow.config",
    "MergeResult": "mergeflow.config",
    "merge_model": "mergeflow.flows.api",
    "validate_artifact": "mergeflow.flows.api",
}

__all__ = ["ModelMergerConfig", "MergeResult", "merge_model", "validate_artifact", "__version__"]

if TYPE_CHECKING:  # pragma: no cover - for type checkers only
    from mergeflow.config import MergeResult, ModelMergerConfig
    from mergeflow.flows.api import merge_model, validate_artifact


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'mergeflow' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value
