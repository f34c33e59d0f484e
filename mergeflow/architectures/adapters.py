"""Architecture adapters: what an architecture needs beyond the default Diffusers handling.

`ArchitectureAdapter` is the default: the trained class is a Diffusers class, instantiated on
the meta device to learn its schema; tensors are written as trained. An architecture that needs
more subclasses it beside its own code (`mergeflow.architectures.minimax_h3.MiniMaxH3Native`)
or uses `RemoteCode`; registry entries carry their adapter, and generic code asks the adapter
instead of branching on a model name. The registry, and so the pre-flight checks, import this
module: it stays light, and torch and Diffusers load inside the methods that need them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from mergeflow.errors import BaseModelError, CheckpointError, SchemaMismatchError

if TYPE_CHECKING:
    import torch

    from mergeflow.architectures.schema import ModelSchema
    from mergeflow.records import ArchitectureOp, TensorWrite

Headers = Mapping[str, tuple[str, tuple[int, ...]]]  # tensor -> (dtype, shape) from safetensors headers
AdapterParams = dict[str, str | int | float | bool]  # a conversion's parameters, recorded in the manifest


@dataclass(frozen=True)
class BaseWeights:
    """The base's weights of the trained component: where they are and their headers."""

    component_dir: str
    weights_name: str
    headers: Headers


@dataclass(frozen=True)
class TrainedSchema:
    """What the checkpoint must cover, and how its tensors become the artifact's."""

    expected_shapes: dict[str, tuple[int, ...]]
    keep_fp32: tuple[str, ...]
    transformer_class: str
    adapter: str | None = None  # set when the writes are converted (the manifest records it)
    adapter_params: AdapterParams = field(default_factory=dict)
    output_shapes: dict[str, tuple[int, ...]] | None = None  # the artifact's exact tensor set, when not the checkpoint's


class ArchitectureAdapter:
    """The default adapter: a Diffusers class, written as trained."""

    name: ClassVar[str] = "diffusers"
    # Whether the trained class is a Diffusers class (its schema comes from a meta instance, and
    # the pre-flight compares checkpoint and base by Diffusers' class rules).
    instantiates_model: ClassVar[bool] = True
    ops: ClassVar[tuple[str, ...]] = ()  # the tensor transforms this adapter's writes use
    native_classes: ClassVar[tuple[str, ...]] = ()  # base transformer classes that are this adapter's own

    def trained_schema(self, actor_config: Mapping[str, Any], base_config: Mapping[str, Any], weights: BaseWeights,
                       *, qkv_layout: str, what: str) -> TrainedSchema:
        """Same class and config on both sides, and base weights as the base's own config says."""
        schema = diffusers_schema(actor_config, base_config)
        check_base_headers(weights.headers, schema.tensors, f"{what} ({schema.class_name})")
        return TrainedSchema(schema.tensors, schema.keep_fp32, schema.class_name)

    def convert_writes(self, writes: list[TensorWrite], params: Mapping[str, Any]) -> list[TensorWrite]:
        """The artifact's writes from the checkpoint's (unchanged by default)."""
        return writes

    def apply_op(self, spec: ArchitectureOp, inputs: list[torch.Tensor]) -> torch.Tensor:
        """The tensor one of `ops` makes from its whole source tensors."""
        raise SchemaMismatchError(f"unknown tensor transform {spec.op!r}")

    def concatenates(self, spec: ArchitectureOp) -> bool:
        """Whether the op's output bytes are its inputs' bytes one after another (the writer then streams
        each input as a tensor of its own, never building the output)."""
        return False

    def check_lora(self, layout: str, fuse: bool) -> None:
        """Refuse a LoRA export this architecture's base cannot take (any is fine by default)."""


class RemoteCode(ArchitectureAdapter):
    """A transformer class shipped as remote code (e.g. Boogu-Image), which mergeflow never runs."""

    name: ClassVar[str] = "remote_code"
    instantiates_model: ClassVar[bool] = False

    def trained_schema(self, actor_config: Mapping[str, Any], base_config: Mapping[str, Any], weights: BaseWeights,
                       *, qkv_layout: str, what: str) -> TrainedSchema:
        """Same class, identical config fields, and the base's own weight headers as the schema."""
        if actor_config.get("_class_name") != base_config.get("_class_name"):
            raise SchemaMismatchError(f"the checkpoint is a {actor_config.get('_class_name')} "
                                      f"but the base transformer is a {base_config.get('_class_name')}")
        actor = {k: v for k, v in actor_config.items() if not k.startswith("_")}
        base = {k: v for k, v in base_config.items() if not k.startswith("_")}
        diffs = sorted(k for k in set(actor) | set(base) if actor.get(k, "<absent>") != base.get(k, "<absent>"))
        if diffs:
            shown = "; ".join(f"{k}: checkpoint {actor.get(k, '<absent>')!r} vs base {base.get(k, '<absent>')!r}"
                              for k in diffs[:3])
            raise SchemaMismatchError(f"checkpoint and base configs differ on {len(diffs)} field(s): {shown}")
        expected = {k: tuple(shape) for k, (_, shape) in weights.headers.items()}
        # The class is never run here, so no meta instantiation checks the written tensors: the
        # artifact must hold exactly the base's tensor set.
        return TrainedSchema(expected, (), str(actor_config.get("_class_name")), output_shapes=expected)


DIFFUSERS = ArchitectureAdapter()
REMOTE_CODE = RemoteCode()


def diffusers_schema(actor_config: Mapping[str, Any], base_config: Mapping[str, Any]) -> ModelSchema:
    """Same Diffusers class, equal constructor fields (defaults filled in); the base meta module's schema."""
    from mergeflow.architectures.schema import model_schema

    actor_class, base_class = actor_config.get("_class_name"), base_config.get("_class_name")
    if not isinstance(actor_class, str):
        raise CheckpointError("huggingface/config.json of the checkpoint has no _class_name")
    if actor_class != base_class:
        raise SchemaMismatchError(f"the checkpoint is a {actor_class} but the base transformer is a {base_class}")
    actor, base = model_schema(actor_class, dict(actor_config)), model_schema(actor_class, dict(base_config))
    diffs = actor.differences(base)
    if diffs:
        raise SchemaMismatchError(f"checkpoint and base configs differ on {len(diffs)} field(s): {'; '.join(diffs[:3])}")
    return base


def check_base_headers(headers: Headers, expected: Mapping[str, tuple[int, ...]], what: str) -> None:
    """The base's weights hold exactly the tensors its own config implies."""
    if {k: tuple(v[1]) for k, v in headers.items()} != {k: tuple(v) for k, v in expected.items()}:
        raise BaseModelError(f"the base's {what} weights do not match its own config.json; the base is damaged")
