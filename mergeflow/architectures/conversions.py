"""Applying an architecture adapter's tensor conversion: planned per output tensor, run by the writer.

An adapter turns the checkpoint's writes (training names and layouts) into the deployed
layout's writes; a converted write carries an `ArchitectureOp` (mergeflow.records: the op, its
sources and parameters). The writer looks the op's adapter up here to
produce the tensor; its round trip re-verifies every source and recomputes the written bytes.
"""

from __future__ import annotations

import torch

from mergeflow.architectures.registry import ADAPTERS, adapter_for_op
from mergeflow.errors import SchemaMismatchError
from mergeflow.records import ArchitectureOp, Conversion, TensorWrite


def apply_transform(spec: ArchitectureOp, inputs: list[torch.Tensor]) -> torch.Tensor:
    """The output tensor a conversion spec makes from its whole input tensors."""
    return adapter_for_op(spec.op).apply_op(spec, inputs)


def convert_writes(conversion: Conversion, writes: list[TensorWrite]) -> list[TensorWrite]:
    """The writes of the deployed layout, checked against its exact schema when the plan has one.

    `conversion.adapter` names the adapter that converts (None: written as trained), with its
    `adapter_params`; `output_shapes` is the tensor set the artifact must hold exactly, when it
    is not the checkpoint's.
    """
    if conversion.adapter is not None:
        adapter = ADAPTERS.get(conversion.adapter)
        if adapter is None:
            raise SchemaMismatchError(f"unknown architecture adapter {conversion.adapter!r}")
        writes = adapter.convert_writes(writes, conversion.adapter_params)
    expected = conversion.output_shapes
    if expected is not None:
        have = {w.name: tuple(w.layout.shape) for w in writes}
        want = {k: tuple(v) for k, v in expected.items()}
        if have != want:
            missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
            wrong = sorted(k for k in set(want) & set(have) if want[k] != have[k])
            raise SchemaMismatchError(f"the converted tensors do not cover the base's schema exactly "
                                      f"(missing {missing[:3]}, extra {extra[:3]}, other shapes {wrong[:3]})")
    return writes
