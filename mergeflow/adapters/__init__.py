"""Per-architecture adapters: tensor conversions planned per output tensor, applied by the writer.

An adapter turns the checkpoint's writes (training names and layouts) into the deployed
layout's writes; a converted write carries a declarative `transform` spec ({"op": ..., "inputs":
[SOURCE, ...]}, SOURCE as in mergeflow.lora_fuse). The writer looks the op up here to
produce the tensor; its round trip re-verifies every source and recomputes the written bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from mergeflow.adapters import minimax_h3
from mergeflow.errors import SchemaMismatchError
from mergeflow.records import TensorWrite

Apply = Callable[[dict[str, Any], list[torch.Tensor]], torch.Tensor]

TRANSFORMS: dict[str, Apply] = {op: minimax_h3.apply_op for op in minimax_h3.OPS}
CONVERTERS: dict[str, Callable[[list[TensorWrite], Mapping[str, Any]], list[TensorWrite]]] = {
    "minimax_h3_native": minimax_h3.plan_native_writes,
}


def apply_transform(spec: dict[str, Any], inputs: list[torch.Tensor]) -> torch.Tensor:
    """The output tensor a conversion spec makes from its whole input tensors."""
    try:
        op = TRANSFORMS[spec["op"]]
    except KeyError:
        raise SchemaMismatchError(f"unknown tensor transform {spec.get('op')!r}") from None
    return op(spec, inputs)


def convert_writes(extras: Mapping[str, Any], writes: list[TensorWrite]) -> list[TensorWrite]:
    """The writes of the deployed layout, checked against its exact schema when the plan has one.

    `extras` is the plan's: `adapter` (a CONVERTERS name or absent), `adapter_params`, and
    `output_shapes` (the tensor set the artifact must hold exactly, when it is not the checkpoint's).
    """
    adapter = extras.get("adapter")
    if adapter is not None:
        try:
            converter = CONVERTERS[adapter]
        except KeyError:
            raise SchemaMismatchError(f"unknown architecture adapter {adapter!r}") from None
        writes = converter(writes, extras.get("adapter_params", {}))
    expected = extras.get("output_shapes")
    if expected is not None:
        have = {w.name: tuple(w.layout.shape) for w in writes}
        want = {k: tuple(v) for k, v in expected.items()}
        if have != want:
            missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
            wrong = sorted(k for k in set(want) & set(have) if want[k] != have[k])
            raise SchemaMismatchError(f"the converted tensors do not cover the base's schema exactly "
                                      f"(missing {missing[:3]}, extra {extra[:3]}, other shapes {wrong[:3]})")
    return writes
