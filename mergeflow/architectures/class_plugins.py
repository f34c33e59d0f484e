"""Per-architecture plug-ins looked up by transformer class: an original single-file layout, a LoRA naming.

Each is an object in a module under mergeflow.architectures, imported only when its class is asked
for (the modules stay light, but there is no reason to load every architecture's tables).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from mergeflow.errors import MergeflowError


def plugin_for(transformer_class: str, modules: Mapping[str, str], refused: Mapping[str, str], attribute: str,
               error: type[MergeflowError], what: str) -> Any:
    """`attribute` of the module `modules` names for the class; `refused` classes and unknown ones raise `error`."""
    if transformer_class in refused:
        raise error(refused[transformer_class])
    module = modules.get(transformer_class)
    if module is None:
        raise error(f"{what} for {transformer_class}; it knows {', '.join(sorted(modules))}")
    return getattr(importlib.import_module(f"mergeflow.architectures.{module}"), attribute)
