"""The unchanged-weights guard: refuse an export whose tensors are the base's, bit for bit.

A "merged" model byte-identical to its base is almost always a mistake (the wrong step
directory, an untrained run, a `save_lora_only` checkpoint read as full weights), and
publishing it hides the mistake. The rule: the export is unchanged when every exported tensor
has a base tensor of the same name and shape whose stored bytes equal the exported tensor's
bytes cast to the base's stored dtype (an fp32 checkpoint of an untrained bf16 base casts back
exactly, so `--dtype`/`preserve` cannot hide it; a tensor the base lacks, or of another shape,
differs).

Cheap first: one tensor per written shard is compared (its first in name order; for a fused
LoRA export its first fused weight, since a LoRA run leaves every other weight equal to the base
by design); only when every sampled tensor matches is the whole base read. A normal export therefore reads a few
base tensors and its manifest is unchanged; the manifest gains `unchanged_check` only when
every tensor was compared (so the count of differing tensors is a measurement, not a guess).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from mergeflow.errors import BaseModelError, UnchangedWeightsError
from mergeflow.formats.manifest import UNCHANGED_CHECK, UnchangedMeasurement
from mergeflow.formats.weight_index import StoredWeights, has_weights, read_weights
from mergeflow.records import MergePlan, ShardRecord

MANIFEST_FIELD = UNCHANGED_CHECK


@dataclass(frozen=True)
class UnchangedCheck:
    """What the guard compared: `differing` is None when only the sample was compared."""

    sampled: int  # tensors compared in the cheap first pass
    compared: int  # tensors compared in all (equals `sampled` when a sampled tensor differed)
    differing: int | None

    @property
    def unchanged(self) -> bool:
        return self.differing == 0


def guard_unchanged(plan: MergePlan, shards: Sequence[ShardRecord], allow_unchanged: bool,
                    trained: frozenset[str] = frozenset()) -> UnchangedMeasurement | None:
    """Refuse (or, allowed, measure) an export equal to its base; returns the manifest's `unchanged_check`.

    None (the manifest gains nothing) unless every tensor was compared. Runs on the written shards,
    before the manifest is written. trained: the tensors the training changed if anything did (a fused
    LoRA's weights), sampled first.
    """
    from mergeflow.outputs.registry import output_of

    if not output_of(plan).compares_unchanged:
        return None
    base_dir = Path(plan.base.component_dir)
    # No local base weights under the base's weights name (a Hub-named base; an architecture whose
    # base is stored differently): nothing to compare with, so the export is as it was without the guard.
    if plan.base.kind == "hub" or not plan.base.component_dir or not has_weights(base_dir, plan.output.base_weights_name):
        return None
    check = measure_unchanged(Path(plan.output.tensor_dir), [(s.file_name, sorted(s.tensors)) for s in shards],
                              base_dir, plan.output.base_weights_name, trained, output_of(plan).tensor_sources(plan))
    if check.differing is None:
        return None  # a sampled tensor differs: the manifest stays byte-identical to an unguarded export
    if check.unchanged and not allow_unchanged:
        raise UnchangedWeightsError(
            f"all {check.compared} exported tensors equal the base's bit for bit: likely the wrong global_step "
            "directory, an untrained run, or a save_lora_only checkpoint read as full weights; "
            "pass --allow-unchanged to publish it anyway")
    return UnchangedMeasurement(compared_tensors=check.compared, differing_tensors=check.differing)


# An artifact tensor's parts in the base's names: [[base name, first row, end row, halves swapped], ...]
# (an original single file's key map); None: every tensor is the base tensor of its own name.
TensorSources = Mapping[str, Sequence[Sequence[object]]]


def measure_unchanged(tensor_dir: Path, shards: Sequence[tuple[str, Sequence[str]]], base_dir: Path,
                      weights_name: str, trained: frozenset[str] = frozenset(),
                      sources: TensorSources | None = None) -> UnchangedCheck:
    """Compare the written shards (file name, tensor names) with the base: the sample, then all if it matches."""
    base = read_weights(base_dir, weights_name, BaseModelError, "the base")
    parts = (lambda name: [[name, None, None, False]]) if sources is None else (lambda name: sources.get(name, []))
    if sources is not None:  # a trained tensor is sampled first under its artifact name
        trained = frozenset(name for name, entries in sources.items() if any(e[0] in trained for e in entries))
    sample = [(file_name, _sampled(names, trained)) for file_name, names in shards if names]
    if not all(_same(tensor_dir / f, name, parts(name), base_dir, base) for f, name in sample):
        return UnchangedCheck(sampled=len(sample), compared=len(sample), differing=None)
    everything = [(file_name, name) for file_name, names in shards for name in names]
    differing = sum(not _same(tensor_dir / f, name, parts(name), base_dir, base) for f, name in everything)
    return UnchangedCheck(sampled=len(sample), compared=len(everything), differing=differing)


def _sampled(names: Sequence[str], trained: frozenset[str]) -> str:
    """The shard's tensor to compare first: a trained one when the shard holds any, else its first."""
    return next((name for name in names if name in trained), names[0])


def _same(shard: Path, name: str, parts: Sequence[Sequence[object]], base_dir: Path, base: StoredWeights) -> bool:
    """Every part of the exported tensor (its rows, halves swapped back) equals the base tensor it came from."""
    from safetensors import safe_open

    if not parts:
        return False
    with safe_open(str(shard), framework="pt") as handle:
        exported = handle.get_tensor(name)
    for base_name, start, end, swapped in parts:
        entry = base.entries.get(str(base_name))
        if entry is None:
            return False
        part = exported if start is None or exported.dim() == 0 else exported[int(start):int(end)]  # type: ignore[call-overload]
        if swapped:
            first, second = part.chunk(2, dim=0)
            part = torch.cat([second, first], dim=0)
        if tuple(part.shape) != tuple(entry.shape):
            return False
        with safe_open(str(base_dir / base.files[str(base_name)]), framework="pt") as handle:
            stored = handle.get_tensor(str(base_name))
        if part.dtype != stored.dtype:
            part = part.to(stored.dtype)
        if not torch.equal(part.reshape(-1).view(torch.uint8), stored.reshape(-1).view(torch.uint8)):
            return False
    return True
