"""Reference Diffusers -> native MiniMax H3 transformer conversion, written from SPEC section 3.

Tests use it to build native base packages and to check mergeflow's own conversion, which is
written independently. Every key of the Diffusers state dict must match exactly one rule of
``_RULES`` (an unmapped or doubly mapped key raises), and the result must equal the native schema
that :func:`native_tensor_shapes` derives from the native config alone.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from mergeflow.errors import SchemaMismatchError

NATIVE_CLASS_NAME = "MiniMaxH3DiTModel"
DIFFUSERS_CLASS_NAME = "MiniMaxH3Transformer3DModel"
QKV_LAYOUTS = ("interleaved", "stacked")
_DEFAULT_ROPE_THETA = 10000.0
# One AdaLN table row per (timestep, modality): 6 modulation vectors x 3 modalities.
_ADALN_FACTOR = 18
_FINAL_ADALN_FACTOR = 2

# Diffusers config field -> native field; the others keep their name.
RENAMED_CONFIG_FIELDS: dict[str, str] = {
    "num_refiner_layers": "token_refiner_num_layers",
    "ffn_dim": "ffn_hidden_size",
    "in_channels": "latents_dim",
    "audio_in_channels": "audio_latents_dim",
    "freq_dim": "timestep_input_dim",
    "time_embed_hidden_dim": "time_embed_hidden_size",
    "rope_freq_dim": "rope_inv_freq_len",
}
SHARED_CONFIG_FIELDS: tuple[str, ...] = (
    "hidden_size",
    "num_attention_heads",
    "attention_head_dim",
    "num_layers",
    "patch_size",
    "text_dim",
    "time_embed_dim",
    "rope_theta",
    "norm_eps",
    "qk_norm_eps",
    "final_norm_eps",
)

# Tensor transforms a rule can ask for.
RENAME = "rename"
SWAP_HALVES = "swap_halves"  # GEGLU fc1: Diffusers [value; gate] -> native [gate; value]
FUSE_Q, FUSE_K, FUSE_V = "fuse_q", "fuse_k", "fuse_v"

# Modules outside the blocks: Diffusers path -> (native path, parameter names).
_TOP_LEVEL: dict[str, tuple[str, tuple[str, ...]]] = {
    "proj_in": ("video_patch_proj", ("weight", "bias")),
    "audio_proj_in": ("audio_patch_proj", ("weight", "bias")),
    "context_embedder": ("condition_proj", ("weight", "bias")),
    "time_embedder.linear_1": ("time_embedder.proj_in", ("weight", "bias")),
    "time_embedder.linear_2": ("time_embedder.proj_out", ("weight", "bias")),
    "norm_out.linear": ("final_layer.adaln_proj.linear", ("weight", "bias")),
    "norm_out.norm": ("final_layer.norm", ("weight",)),
    "proj_out": ("final_layer.video_out", ("weight", "bias")),
    "audio_proj_out": ("final_layer.audio_out", ("weight", "bias")),
    "token_refiner.final_norm": ("token_refiner.final_norm", ("weight",)),
}
# Modules inside a main or refiner block: Diffusers path -> (native path, transform); weights only.
_BLOCK_INNER: dict[str, tuple[str, str]] = {
    "norm1": ("norm1", RENAME),
    "norm2": ("norm2", RENAME),
    "attn.norm_q": ("attn.q_norm", RENAME),
    "attn.norm_k": ("attn.k_norm", RENAME),
    "attn.to_out.0": ("attn.out_proj", RENAME),
    "ff.net.2": ("mlp.fc2", RENAME),
    "ff.net.0.proj": ("mlp.fc1", SWAP_HALVES),
    "attn.to_q": ("attn.qkv_proj", FUSE_Q),
    "attn.to_k": ("attn.qkv_proj", FUSE_K),
    "attn.to_v": ("attn.qkv_proj", FUSE_V),
}
_BLOCK_PREFIXES: dict[str, str] = {
    r"transformer_blocks\.(?P<index>\d+)\.": "blocks.{index}.",
    r"token_refiner\.refiner_blocks\.(?P<index>\d+)\.": "token_refiner.blocks.{index}.",
}


@dataclass(frozen=True)
class _Rule:
    """One conversion rule: a full-match pattern on the Diffusers key, the native key template, a transform."""

    pattern: re.Pattern[str]
    template: str
    transform: str


def _build_rules() -> tuple[_Rule, ...]:
    """Expand the module tables into one full-match rule per (module, parameter) family."""
    rules = []
    for source, (target, params) in _TOP_LEVEL.items():
        pattern = re.escape(source) + r"\.(?P<param>" + "|".join(params) + ")"
        rules.append(_Rule(re.compile(pattern), target + ".{param}", RENAME))
    for prefix, native_prefix in _BLOCK_PREFIXES.items():
        for source, (target, transform) in _BLOCK_INNER.items():
            pattern = prefix + re.escape(source) + r"\.(?P<param>weight)"
            rules.append(_Rule(re.compile(pattern), native_prefix + target + ".{param}", transform))
    # Only main blocks carry a per-block AdaLN projection.
    rules.append(
        _Rule(
            re.compile(r"transformer_blocks\.(?P<index>\d+)\.adaln_proj\.linear\.(?P<param>weight|bias)"),
            "blocks.{index}.adaln_proj.linear.{param}",
            RENAME,
        )
    )
    return tuple(rules)


_RULES = _build_rules()


def _diffusers_defaults() -> dict[str, Any]:
    """Constructor defaults of the Diffusers class, for fields a config dict leaves out."""
    from diffusers import MiniMaxH3Transformer3DModel

    signature = inspect.signature(MiniMaxH3Transformer3DModel.__init__)
    return {name: p.default for name, p in signature.parameters.items() if p.default is not inspect.Parameter.empty}


def native_config_from_diffusers(config: Mapping[str, Any]) -> dict[str, Any]:
    """Translate a MiniMaxH3Transformer3DModel config into the native MiniMaxH3DiTModel config."""
    fields = {key: value for key, value in config.items() if not key.startswith("_")}
    unknown = sorted(set(fields) - set(SHARED_CONFIG_FIELDS) - set(RENAMED_CONFIG_FIELDS))
    if unknown:
        raise SchemaMismatchError(f"MiniMax H3 config fields with no native counterpart: {unknown}")
    full = {**_diffusers_defaults(), **fields}
    if full.get("rope_theta") is None:
        full["rope_theta"] = _DEFAULT_ROPE_THETA
    native: dict[str, Any] = {"_class_name": NATIVE_CLASS_NAME}
    for name in SHARED_CONFIG_FIELDS:
        native[name] = full[name]
    for name, native_name in RENAMED_CONFIG_FIELDS.items():
        native[native_name] = full[name]
    native["patch_size"] = list(native["patch_size"])  # JSON form, whatever the input held
    hidden = int(native["hidden_size"])
    native["adaln_out_features"] = _ADALN_FACTOR * hidden
    native["final_adaln_out_features"] = _FINAL_ADALN_FACTOR * hidden
    return native


def rope_inv_freq(native_config: Mapping[str, Any]) -> torch.Tensor:
    """The native ``rope.inv_freq`` buffer: float32 ``theta ** -(arange(0, 2L, 2) / (2L))``."""
    length = int(native_config["rope_inv_freq_len"])
    theta = float(native_config.get("rope_theta") or _DEFAULT_ROPE_THETA)
    exponents = torch.arange(0, 2 * length, 2, dtype=torch.float32) / (2 * length)
    return theta**-exponents


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, head_dim: int, layout: str) -> torch.Tensor:
    """Fuse [H*D, in] q/k/v into [3*H*D, in]: per-head interleaved [h0: q k v, h1: ...] or stacked [q; k; v]."""
    if layout == "stacked":
        return torch.cat([q, k, v], dim=0)
    if layout != "interleaved":
        raise ValueError(f"unknown QKV layout {layout!r}; choose one of {QKV_LAYOUTS}")
    parts = [t.reshape(heads, head_dim, t.shape[-1]) for t in (q, k, v)]
    return torch.stack(parts, dim=1).reshape(3 * heads * head_dim, q.shape[-1])


def swap_gate_value(weight: torch.Tensor) -> torch.Tensor:
    """Turn a Diffusers SwiGLU projection [value; gate] into the native [gate; value]."""
    if weight.shape[0] % 2:
        raise SchemaMismatchError(f"SwiGLU projection has an odd row count {weight.shape[0]}")
    value, gate = weight.chunk(2, dim=0)
    return torch.cat([gate, value], dim=0)


def _match(key: str) -> tuple[_Rule, re.Match[str]]:
    """The one rule covering ``key``; raise when none or several do."""
    hits = [(rule, m) for rule in _RULES if (m := rule.pattern.fullmatch(key))]
    if not hits:
        raise SchemaMismatchError(f"no MiniMax H3 conversion rule covers the Diffusers key {key!r}")
    if len(hits) > 1:
        raise SchemaMismatchError(f"{len(hits)} MiniMax H3 conversion rules cover {key!r}; the rules are ambiguous")
    return hits[0]


def reference_native_state_dict(
    diffusers_state_dict: Mapping[str, torch.Tensor], config: Mapping[str, Any], *, qkv_layout: str = "interleaved"
) -> dict[str, torch.Tensor]:
    """Convert a Diffusers MiniMax H3 transformer state dict into the native MiniMaxH3DiTModel one."""
    native_config = native_config_from_diffusers(config)
    heads, head_dim = int(native_config["num_attention_heads"]), int(native_config["attention_head_dim"])
    out: dict[str, torch.Tensor] = {}
    fused_parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in diffusers_state_dict.items():
        rule, match = _match(key)
        native_key = rule.template.format(**match.groupdict())
        if rule.transform in (FUSE_Q, FUSE_K, FUSE_V):
            fused_parts.setdefault(native_key, {})[rule.transform] = tensor
            continue
        if native_key in out:
            raise SchemaMismatchError(f"two Diffusers keys convert to the native key {native_key!r}")
        out[native_key] = swap_gate_value(tensor) if rule.transform == SWAP_HALVES else tensor
    for native_key, parts in fused_parts.items():
        missing = sorted({FUSE_Q, FUSE_K, FUSE_V} - set(parts))
        if missing:
            raise SchemaMismatchError(f"{native_key!r} lacks its {missing} projection(s) to fuse")
        out[native_key] = fuse_qkv(parts[FUSE_Q], parts[FUSE_K], parts[FUSE_V], heads, head_dim, qkv_layout)
    # Diffusers recomputes inv_freq (non-persistent buffer); the native checkpoint stores it.
    out["rope.inv_freq"] = rope_inv_freq(native_config)
    _check_schema(out, native_config)
    return out


def _check_schema(state_dict: Mapping[str, torch.Tensor], native_config: Mapping[str, Any]) -> None:
    """Raise unless ``state_dict`` has exactly the native schema's names and shapes."""
    expected = native_tensor_shapes(native_config)
    missing, extra = sorted(set(expected) - set(state_dict)), sorted(set(state_dict) - set(expected))
    if missing or extra:
        raise SchemaMismatchError(f"native MiniMax H3 schema mismatch: missing {missing}, extra {extra}")
    for key, shape in expected.items():
        if tuple(state_dict[key].shape) != shape:
            raise SchemaMismatchError(f"{key}: shape {tuple(state_dict[key].shape)}, native schema says {shape}")


def native_tensor_shapes(native_config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of a native MiniMaxH3DiTModel with its shape, derived from the native config alone."""
    c = native_config
    hidden, inner = int(c["hidden_size"]), int(c["num_attention_heads"]) * int(c["attention_head_dim"])
    head_dim, ffn, temb = int(c["attention_head_dim"]), int(c["ffn_hidden_size"]), int(c["time_embed_dim"])
    video = int(c["latents_dim"]) * int(torch.tensor(c["patch_size"]).prod())
    audio, teh = int(c["audio_latents_dim"]), int(c["time_embed_hidden_size"])
    shapes: dict[str, tuple[int, ...]] = {
        "video_patch_proj.weight": (hidden, video),
        "video_patch_proj.bias": (hidden,),
        "audio_patch_proj.weight": (hidden, audio),
        "audio_patch_proj.bias": (hidden,),
        "condition_proj.weight": (hidden, int(c["text_dim"])),
        "condition_proj.bias": (hidden,),
        "time_embedder.proj_in.weight": (teh, int(c["timestep_input_dim"])),
        "time_embedder.proj_in.bias": (teh,),
        "time_embedder.proj_out.weight": (temb, teh),
        "time_embedder.proj_out.bias": (temb,),
        "rope.inv_freq": (int(c["rope_inv_freq_len"]),),
        "token_refiner.final_norm.weight": (hidden,),
        "final_layer.norm.weight": (hidden,),
        "final_layer.adaln_proj.linear.weight": (int(c["final_adaln_out_features"]), temb),
        "final_layer.adaln_proj.linear.bias": (int(c["final_adaln_out_features"]),),
        "final_layer.video_out.weight": (video, hidden),
        "final_layer.video_out.bias": (video,),
        "final_layer.audio_out.weight": (audio, hidden),
        "final_layer.audio_out.bias": (audio,),
    }
    block = {
        "norm1.weight": (hidden,),
        "attn.qkv_proj.weight": (3 * inner, hidden),
        "attn.q_norm.weight": (head_dim,),
        "attn.k_norm.weight": (head_dim,),
        "attn.out_proj.weight": (hidden, inner),
        "norm2.weight": (hidden,),
        "mlp.fc1.weight": (2 * ffn, hidden),
        "mlp.fc2.weight": (hidden, ffn),
    }
    for i in range(int(c["token_refiner_num_layers"])):
        shapes.update({f"token_refiner.blocks.{i}.{name}": shape for name, shape in block.items()})
    adaln = int(c["adaln_out_features"])
    for i in range(int(c["num_layers"])):
        shapes.update({f"blocks.{i}.{name}": shape for name, shape in block.items()})
        shapes[f"blocks.{i}.adaln_proj.linear.weight"] = (adaln, temb)
        shapes[f"blocks.{i}.adaln_proj.linear.bias"] = (adaln,)
    return shapes
