"""MiniMax H3: the Diffusers training layout -> the native `MiniMaxH3DiTModel` package (SPEC section 3).

Plain functions. `native_plan` maps every Diffusers tensor name to its native name and the op
that produces it; `plan_native_writes` turns the checkpoint's tensor writes into native ones, each
carrying a small declarative transform spec that the streaming writer applies per output tensor.
The QKV layout is a declared choice (interleaved per head, or stacked), never guessed.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from mergeflow.architectures.adapters import (
    AdapterParams,
    ArchitectureAdapter,
    BaseWeights,
    TrainedSchema,
)
from mergeflow.config import QKV_LAYOUTS
from mergeflow.errors import BaseModelError, LoraError, SchemaMismatchError
from mergeflow.formats.model_config import ModelConfig

if TYPE_CHECKING:  # torch and the records load when a conversion runs: the registry imports this module
    import torch

    from mergeflow.records import (
        ArchitectureOp,
        TensorLayout,
        TensorSource,
        TensorWrite,
    )

NATIVE_CLASS = "MiniMaxH3DiTModel"
DIFFUSERS_CLASS = "MiniMaxH3Transformer3DModel"
INV_FREQ = "rope.inv_freq"
DEFAULT_THETA = 10000.0

# Diffusers constructor field -> native config field.
CONFIG_RENAMES = {
    "num_refiner_layers": "token_refiner_num_layers",
    "ffn_dim": "ffn_hidden_size",
    "in_channels": "latents_dim",
    "audio_in_channels": "audio_latents_dim",
    "freq_dim": "timestep_input_dim",
    "time_embed_hidden_dim": "time_embed_hidden_size",
    "rope_freq_dim": "rope_inv_freq_len",
}
CONFIG_SAME = ("hidden_size", "num_attention_heads", "attention_head_dim", "num_layers", "patch_size", "text_dim",
               "time_embed_dim", "rope_theta", "norm_eps", "qk_norm_eps", "final_norm_eps")

# Whole leading module paths renamed (longest first, so audio_proj_in wins over proj_in).
_PREFIXES = (
    ("time_embedder.linear_1.", "time_embedder.proj_in."),
    ("time_embedder.linear_2.", "time_embedder.proj_out."),
    ("norm_out.linear.", "final_layer.adaln_proj.linear."),
    ("norm_out.norm.", "final_layer.norm."),
    ("context_embedder.", "condition_proj."),
    ("audio_proj_out.", "final_layer.audio_out."),
    ("audio_proj_in.", "audio_patch_proj."),
    ("proj_out.", "final_layer.video_out."),
    ("proj_in.", "video_patch_proj."),
    ("token_refiner.refiner_blocks.", "token_refiner.blocks."),
    ("transformer_blocks.", "blocks."),
)
# Module paths inside a block.
_INNER = ((".attn.norm_q.", ".attn.q_norm."), (".attn.norm_k.", ".attn.k_norm."),
          (".attn.to_out.0.", ".attn.out_proj."), (".ff.net.2.", ".mlp.fc2."))
_SWAPPED = (".ff.net.0.proj.weight", ".mlp.fc1.weight")  # GEGLU [value; gate] -> native [gate; value]
_QKV = {".attn.to_q.weight": 0, ".attn.to_k.weight": 1, ".attn.to_v.weight": 2}
_FUSED = ".attn.qkv_proj.weight"


def native_name(key: str) -> tuple[str, str, int]:
    """(native name, op, part) for one Diffusers tensor; op is rename, swap_halves or fuse_qkv (part 0..2)."""
    name = key
    for old, new in _PREFIXES:
        if name.startswith(old):
            name = new + name[len(old):]
            break
    for suffix, part in _QKV.items():
        if name.endswith(suffix):
            return name[: -len(suffix)] + _FUSED, "fuse_qkv", part
    if name.endswith(_SWAPPED[0]):
        return name[: -len(_SWAPPED[0])] + _SWAPPED[1], "swap_halves", 0
    for old, new in _INNER:
        name = name.replace(old, new)
    return name, "rename", 0


def native_plan(source_names: list[str]) -> dict[str, tuple[str, list[str]]]:
    """Native tensor name -> (op, Diffusers source names in op order); refuses collisions and incomplete fusions."""
    plan: dict[str, tuple[str, list[str | None]]] = {}
    for key in sorted(source_names):
        native, op, part = native_name(key)
        if op == "fuse_qkv":
            entry = plan.setdefault(native, (op, [None, None, None]))
            if entry[0] != op or entry[1][part] is not None:
                raise SchemaMismatchError(f"two tensors convert to the native {native}")
            entry[1][part] = key
        elif native in plan:
            raise SchemaMismatchError(f"{key} and {plan[native][1]} both convert to the native {native}")
        else:
            plan[native] = (op, [key])
    out: dict[str, tuple[str, list[str]]] = {}
    for native, (op, sources) in plan.items():
        if any(s is None for s in sources):
            raise SchemaMismatchError(f"native {native} needs to_q, to_k and to_v; the checkpoint lacks some")
        out[native] = (op, [s for s in sources if s is not None])
    if INV_FREQ in out:
        raise SchemaMismatchError(f"the checkpoint holds {INV_FREQ}; it is synthesised from the config, never taken from weights")
    return out


def native_config(diffusers_config: Mapping[str, Any], constructor_fields: list[str]) -> ModelConfig:
    """The native config fields implied by a full Diffusers config (defaults filled in)."""
    unmapped = sorted(set(constructor_fields) - set(CONFIG_SAME) - set(CONFIG_RENAMES))
    if unmapped:
        raise SchemaMismatchError(f"MiniMax H3 config fields without a native counterpart: {', '.join(unmapped)}")
    out = {name: diffusers_config[name] for name in CONFIG_SAME}
    out.update({native: diffusers_config[name] for name, native in CONFIG_RENAMES.items()})
    hidden = int(diffusers_config["hidden_size"])
    out["adaln_out_features"] = 18 * hidden
    out["final_adaln_out_features"] = 2 * hidden
    return out


def diffusers_config(native: Mapping[str, Any]) -> dict[str, Any]:
    """The Diffusers constructor fields of a native config (`native_config` read backwards), for a loader that
    builds `MiniMaxH3Transformer3DModel` from a native package; refuses a native config that lacks one."""
    missing = sorted({*CONFIG_SAME, *CONFIG_RENAMES.values()} - set(native))
    if missing:
        raise SchemaMismatchError(f"the native MiniMax H3 config lacks {', '.join(missing)}")
    out = {name: native[name] for name in CONFIG_SAME}
    out.update({name: native[field] for name, field in CONFIG_RENAMES.items()})
    return out


def _normal(value: Any) -> Any:
    return [_normal(v) for v in value] if isinstance(value, (list, tuple)) else value


def config_differences(expected: Mapping[str, Any], base_config: Mapping[str, Any]) -> list[str]:
    """Native fields on which the checkpoint's translated config and the base's native config disagree."""
    fields = {k: v for k, v in base_config.items() if not k.startswith("_")}
    diffs = [f"{k}: base has it, the checkpoint's config cannot say" for k in sorted(set(fields) - set(expected))]
    for name in sorted(expected):
        if name not in fields:
            diffs.append(f"{name}: missing from the base's native config")
        elif _normal(expected[name]) != _normal(fields[name]):
            diffs.append(f"{name}: checkpoint {expected[name]!r} vs base {fields[name]!r}")
    return diffs


def rope_inv_freq(length: int, theta: float | None) -> torch.Tensor:
    """SPEC: float32 `theta ** -(arange(0, 2L, 2) / (2L))`, theta defaulting to 10000."""
    import torch

    exponents = torch.arange(0, 2 * length, 2, dtype=torch.float32) / (2 * length)
    return float(theta if theta is not None else DEFAULT_THETA) ** -exponents


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, head_dim: int, layout: str) -> torch.Tensor:
    """[H*D, in] x3 -> [3*H*D, in]: per head [q_h; k_h; v_h] (interleaved) or [q; k; v] (stacked)."""
    import torch

    if layout == "stacked":
        return torch.cat([q, k, v], dim=0)
    per_head = [t.reshape(heads, head_dim, t.shape[1]) for t in (q, k, v)]
    return torch.stack(per_head, dim=1).reshape(3 * heads * head_dim, q.shape[1])


def swap_halves(weight: torch.Tensor) -> torch.Tensor:
    """Exchange the two row halves (its own inverse)."""
    import torch

    first, second = weight.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def apply_op(spec: ArchitectureOp, inputs: list[torch.Tensor]) -> torch.Tensor:
    """The native tensor one of this adapter's ops makes from its (whole) source tensors."""
    params = spec.params
    if spec.op == "fuse_qkv":
        q, k, v = inputs
        return fuse_qkv(q, k, v, int(params["heads"] or 0), int(params["head_dim"] or 0), str(params["layout"]))
    if spec.op == "swap_halves":
        return swap_halves(inputs[0])
    if spec.op == "rope_inv_freq":
        return rope_inv_freq(int(params["length"] or 0), params["theta"])  # type: ignore[arg-type]
    raise SchemaMismatchError(f"unknown MiniMax H3 tensor transform {spec.op!r}")


OPS = ("fuse_qkv", "swap_halves", "rope_inv_freq")


def native_shapes(source_shapes: Mapping[str, tuple[int, ...]], params: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The native schema implied by the Diffusers schema: what the native weights must hold exactly."""
    out: dict[str, tuple[int, ...]] = {}
    for native, (op, sources) in native_plan(list(source_shapes)).items():
        first = tuple(source_shapes[sources[0]])
        out[native] = (3 * first[0], *first[1:]) if op == "fuse_qkv" else first
    out[INV_FREQ] = (int(params["rope_inv_freq_len"]),)
    return out


def _virtual(name: str, dtype: str, shape: tuple[int, ...]) -> TensorLayout:
    from mergeflow.records import TensorLayout

    # A transformed write's `layout` describes its output; its inputs travel in the transform spec.
    return TensorLayout(name, dtype, shape, None, (), ())


def _source(write: TensorWrite) -> TensorSource:
    # A tensor of the rank files, or, for a computed write (a fused LoRA weight), that write's
    # result, so LoRA is fused before conversion.
    from mergeflow.records import CheckpointSource, ComputedSource

    return CheckpointSource(write.layout) if write.transform is None else ComputedSource(write)


def plan_native_writes(writes: list[TensorWrite], params: Mapping[str, Any]) -> list[TensorWrite]:
    """Turn the checkpoint's (Diffusers-named) writes into the native package's writes."""
    from mergeflow.records import ArchitectureOp, TensorWrite

    by_name = {w.name: w for w in writes}
    heads, head_dim, layout = int(params["num_attention_heads"]), int(params["attention_head_dim"]), params["qkv_layout"]
    if layout not in QKV_LAYOUTS:
        raise SchemaMismatchError(f"unknown QKV layout {layout!r}; choose one of {', '.join(QKV_LAYOUTS)}")
    out: list[TensorWrite] = []
    for native, (op, sources) in sorted(native_plan(list(by_name)).items()):
        parts = [by_name[s] for s in sources]
        first = parts[0]
        if op == "rename":
            out.append(TensorWrite(native, first.source_key, first.layout, first.out_dtype, first.transform))
            continue
        if len({p.out_dtype for p in parts}) != 1:
            raise SchemaMismatchError(f"{', '.join(sources)} would be written in different dtypes; they cannot be fused")
        shape = first.layout.shape
        if op == "fuse_qkv":
            if any(p.layout.shape != (heads * head_dim, shape[1]) for p in parts):
                raise SchemaMismatchError(f"{native}: q/k/v must each be [{heads * head_dim}, in] to fuse")
            params_of_op: dict[str, int | float | str | None] = {"heads": heads, "head_dim": head_dim, "layout": layout}
            shape = (3 * shape[0], shape[1])
        else:
            if shape[0] % 2:
                raise SchemaMismatchError(f"{first.name} has an odd row count {shape[0]}; it is not a [value; gate] pair")
            params_of_op = {}
        spec = ArchitectureOp(op, tuple(_source(p) for p in parts), params_of_op)
        out.append(TensorWrite(native, first.source_key, _virtual(native, first.out_dtype, shape), first.out_dtype, spec))
    length = int(params["rope_inv_freq_len"])
    spec = ArchitectureOp("rope_inv_freq", (), {"length": length, "theta": params["rope_theta"]})
    out.append(TensorWrite(INV_FREQ, INV_FREQ, _virtual(INV_FREQ, "float32", (length,)), "float32", transform=spec))
    return sorted(out, key=lambda w: w.name)


def check_native_base(
    actor_config: Mapping[str, Any],
    base_config: Mapping[str, Any],
    base_headers: Mapping[str, tuple[str, tuple[int, ...]]],
    stored_inv_freq: torch.Tensor | None,
    qkv_layout: str,
) -> tuple[dict[str, tuple[int, ...]], tuple[str, ...], AdapterParams, dict[str, tuple[int, ...]]]:
    """Check a native base against the checkpoint's Diffusers config.

    Returns the Diffusers schema the checkpoint must cover, the fp32-kept modules, the
    conversion parameters and the native schema the written weights must hold exactly.
    """
    import torch

    from mergeflow.architectures.schema import (
        constructor_fields,
        diffusers_model_class,
        expected_tensors,
        keep_in_fp32_modules,
        meta_model,
    )

    if actor_config.get("_class_name") != DIFFUSERS_CLASS:
        raise SchemaMismatchError(f"a native MiniMax H3 export needs a {DIFFUSERS_CLASS} checkpoint, not {actor_config.get('_class_name')!r}")
    if base_config.get("_class_name") != NATIVE_CLASS:
        raise SchemaMismatchError(f"the base transformer is a {base_config.get('_class_name')!r}, expected {NATIVE_CLASS}")
    cls = diffusers_model_class(DIFFUSERS_CLASS)
    model = meta_model(cls, dict(actor_config))
    full = dict(model.config)
    expected_config = native_config(full, constructor_fields(cls))
    diffs = config_differences(expected_config, base_config)
    if diffs:
        raise SchemaMismatchError(f"checkpoint and native base configs differ on {len(diffs)} field(s): {'; '.join(diffs[:3])}")
    source = {k: tuple(v.shape) for k, v in expected_tensors(model).items()}
    params = {"num_attention_heads": full["num_attention_heads"], "attention_head_dim": full["attention_head_dim"],
              "rope_inv_freq_len": full["rope_freq_dim"], "rope_theta": full["rope_theta"], "qkv_layout": qkv_layout}
    native = native_shapes(source, params)
    have = {k: tuple(shape) for k, (_, shape) in base_headers.items()}
    if native != have:
        missing, extra = sorted(set(native) - set(have)), sorted(set(have) - set(native))
        wrong = sorted(k for k in set(native) & set(have) if native[k] != have[k])
        raise SchemaMismatchError(f"the native base's weights differ from the converted schema "
                                  f"(missing {missing[:3]}, extra {extra[:3]}, other shapes {wrong[:3]})")
    inv_freq = rope_inv_freq(int(params["rope_inv_freq_len"]), params["rope_theta"])
    if stored_inv_freq is None or stored_inv_freq.dtype != torch.float32 or not torch.equal(
        stored_inv_freq.view(torch.int32), inv_freq.view(torch.int32)
    ):
        raise SchemaMismatchError(f"the base's {INV_FREQ} is not the float32 value of rope_freq_dim/rope_theta; "
                                  "the base and the checkpoint disagree on the rotary schedule")
    return source, keep_in_fp32_modules(cls), params, native


class MiniMaxH3Native(ArchitectureAdapter):
    """The native `MiniMaxH3DiTModel` package: a Diffusers-trained checkpoint, renamed and fused on the way."""

    name: ClassVar[str] = "minimax_h3_native"
    instantiates_model: ClassVar[bool] = False  # the native class is not a Diffusers class
    ops: ClassVar[tuple[str, ...]] = OPS
    native_classes: ClassVar[tuple[str, ...]] = (NATIVE_CLASS,)

    def trained_schema(self, actor_config: Mapping[str, Any], base_config: Mapping[str, Any], weights: BaseWeights,
                       *, qkv_layout: str, what: str) -> TrainedSchema:
        from mergeflow.formats.weight_index import read_stored_tensor

        stored = read_stored_tensor(Path(weights.component_dir), weights.weights_name, INV_FREQ, BaseModelError, "the base")
        expected, keep, params, native = check_native_base(actor_config, base_config, weights.headers, stored, qkv_layout)
        return TrainedSchema(expected, keep, str(actor_config.get("_class_name")), adapter=self.name,
                             adapter_params=params, output_shapes=native)

    def convert_writes(self, writes: list[TensorWrite], params: Mapping[str, Any]) -> list[TensorWrite]:
        return plan_native_writes(writes, params)

    def apply_op(self, spec: ArchitectureOp, inputs: list[torch.Tensor]) -> torch.Tensor:
        return apply_op(spec, inputs)

    def check_lora(self, layout: str, fuse: bool) -> None:
        """Only a fused full-state save can go into the native package (LoRA is fused before conversion)."""
        if layout == "lora_only":
            raise LoraError(
                "a LoRA-only save cannot go into a native MiniMax H3 package: its adapter is keyed by Diffusers module "
                "names, which the native transformer renames and fuses (qkv_proj), and its frozen weights would have "
                "to come from that converted base. Use a Diffusers base (--output_format transformer) or a full-state save"
            )
        if not fuse:
            raise LoraError(
                "the base is a native MiniMax H3 package, whose transformer renames and fuses the Diffusers modules "
                "(qkv_proj, blocks.*); an adapter keyed by Diffusers module names would not load there. Use "
                "--fuse-lora to fold the adapter into the weights before conversion"
            )


MINIMAX_H3_NATIVE = MiniMaxH3Native()
