"""Tiny, deterministic Diffusers transformers: the real classes at toy sizes.

Every fixture model in the test suite and the `demo` command comes from here. Dimensions
are odd where a class allows it so that sharding over 3 or 4 ranks produces uneven and
empty `torch.chunk` pieces, the cases a merger most easily gets wrong.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from accelerate import init_empty_weights
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from mergeflow.errors import UsageError

# A Diffusers class's constructor keyword arguments: sizes, flags, names and tuples of sizes.
ModelKwargs = dict[str, int | float | bool | str | tuple[int, ...]]
# The keyword arguments of one forward pass: tensors, and the few plain sizes or shapes a model takes.
ForwardInputs = dict[str, torch.Tensor | int | float | list[list[tuple[int, int, int]]]]

# Constructor kwargs per Diffusers class. Every model has a tensor with 1 or 2 rows (an
# output projection or modulation table), so 3 and 4 ranks both get an empty shard, and
# several 5-, 7-, 10-, 13-, 20-, 25- or 30-row tensors, so shards are uneven.
TINY_TRANSFORMER_CONFIGS: dict[str, ModelKwargs] = {
    "FluxTransformer2DModel": {
        "patch_size": 1,
        "in_channels": 5,
        "out_channels": 2,
        "num_layers": 1,
        "num_single_layers": 1,
        "attention_head_dim": 10,
        "num_attention_heads": 3,
        "joint_attention_dim": 7,
        "pooled_projection_dim": 5,
        "guidance_embeds": True,
        "axes_dims_rope": (2, 4, 4),
    },
    # Dual attention in block 0 and RMS qk-norm: the SD3.5 variant of the class. The sincos
    # positional table needs a width divisible by 4.
    "SD3Transformer2DModel": {
        "sample_size": 8,
        "patch_size": 1,
        "in_channels": 5,
        "num_layers": 2,
        "attention_head_dim": 10,
        "num_attention_heads": 2,
        "joint_attention_dim": 7,
        "caption_projection_dim": 20,
        "pooled_projection_dim": 5,
        "out_channels": 2,
        "pos_embed_max_size": 8,
        "dual_attention_layers": (0,),
        "qk_norm": "rms_norm",
    },
    "QwenImageTransformer2DModel": {
        "patch_size": 1,
        "in_channels": 5,
        "out_channels": 2,
        "num_layers": 2,
        "attention_head_dim": 10,
        "num_attention_heads": 3,
        "joint_attention_dim": 7,
        "axes_dims_rope": (2, 4, 4),
    },
    "WanTransformer3DModel": {
        "patch_size": (1, 1, 1),
        "num_attention_heads": 3,
        "attention_head_dim": 12,
        "in_channels": 5,
        "out_channels": 3,
        "text_dim": 7,
        "freq_dim": 6,
        "ffn_dim": 13,
        "num_layers": 2,
        "rope_max_seq_len": 32,
    },
    "LTX2VideoTransformer3DModel": {
        "in_channels": 5,
        "out_channels": 3,
        "patch_size": 1,
        "patch_size_t": 1,
        "num_attention_heads": 3,
        "attention_head_dim": 8,
        "cross_attention_dim": 24,
        "audio_in_channels": 5,
        "audio_out_channels": 3,
        "audio_num_attention_heads": 3,
        "audio_attention_head_dim": 4,
        "audio_cross_attention_dim": 12,
        "num_layers": 1,
        "caption_channels": 7,
        "rope_double_precision": False,
    },
    # heads * head_dim (48) != hidden_size (25), as in the released model.
    "MiniMaxH3Transformer3DModel": {
        "num_attention_heads": 3,
        "attention_head_dim": 16,
        "hidden_size": 25,
        "num_layers": 1,
        "num_refiner_layers": 1,
        "ffn_dim": 13,
        "in_channels": 5,
        "audio_in_channels": 2,
        "patch_size": (1, 1, 1),
        "text_dim": 7,
        "freq_dim": 6,
        "time_embed_hidden_dim": 11,
        "time_embed_dim": 9,
        "rope_freq_dim": 2,
    },
}


def transformer_class(class_name: str) -> type[ModelMixin]:
    """Return the Diffusers transformer class named `class_name` (one of the tiny configs)."""
    if class_name not in TINY_TRANSFORMER_CONFIGS:
        known = ", ".join(sorted(TINY_TRANSFORMER_CONFIGS))
        raise UsageError(f"no synthetic transformer for {class_name!r}; choose one of: {known}")
    import diffusers

    return getattr(diffusers, class_name)


def keeps_fp32(model: nn.Module, name: str) -> bool:
    """True when `name` stays float32 under a cast, by Diffusers' `from_pretrained` rule."""
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    parts = name.split(".")
    return any(module in parts for module in keep)


def build_transformer(
    class_name: str,
    *,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    config_overrides: Mapping[str, Any] | None = None,
) -> ModelMixin:
    """Build a tiny transformer with every floating parameter drawn from a seeded generator."""
    cls = transformer_class(class_name)
    config = copy.deepcopy(TINY_TRANSFORMER_CONFIGS[class_name])
    config.update(config_overrides or {})
    # Parameters start on the meta device: no default init to pay for (it dominates at GB
    # sizes) and no draw from the global RNG. Buffers are computed for real (rope tables,
    # SD3's positional table) because nothing could re-create them later.
    with torch.random.fork_rng(devices=[]), init_empty_weights(include_buffers=False):
        model = cls(**config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        _materialise_parameters(model, dtype, generator)
        if dtype is not None:
            _cast_persistent_buffers(model, dtype)
    return model.eval()


def _materialise_parameters(
    model: nn.Module, dtype: torch.dtype | None, generator: torch.Generator
) -> None:
    """Replace every meta parameter with a CPU one filled from `generator` (tied ones stay tied)."""
    fresh: dict[int, nn.Parameter] = {}
    for name, param in model.named_parameters():  # deduplicates tied parameters
        target = param.dtype
        if dtype is not None and param.is_floating_point() and not keeps_fp32(model, name):
            target = dtype
        data = torch.empty(param.shape, dtype=target)
        if data.is_floating_point():
            _fill_(data, name, generator)
        fresh[id(param)] = nn.Parameter(data, requires_grad=param.requires_grad)
    for module in model.modules():
        for key, param in module._parameters.items():
            if param is not None:
                module._parameters[key] = fresh[id(param)]


# A parameter up to this many elements is drawn element by element from the generator: every tiny
# fixture and the demo, whose bytes therefore stay what they were. A larger one (the FLUX.1-width tests, the
# benches' models of real depth) is filled from a drawn pool instead (_fill_from_pool_).
_DRAWN_IN_FULL = 1 << 22
# Prime, so that the pool's rotations never line up with a power-of-two row width.
_POOL = 1_048_573


def _fill_(data: torch.Tensor, name: str, generator: torch.Generator) -> None:
    """Fill one parameter with scaled normal noise; norm scales sit near 1, never exactly 0."""
    if data.numel() > _DRAWN_IN_FULL:
        _fill_from_pool_(data, name, generator)
        return
    torch.randn(data.shape, generator=generator, dtype=data.dtype, out=data)
    _scale_(data, data.ndim, data[0].numel() if data.ndim >= 2 else 0, name)


def _scale_(values: torch.Tensor, ndim: int, fan_in: int, name: str) -> None:
    """Scale drawn values for a parameter of `ndim` dimensions whose rows hold `fan_in` elements."""
    if ndim >= 2:
        values.mul_(float(fan_in) ** -0.5)  # fan-in scaling keeps activations bounded
    elif name.endswith("weight"):
        values.mul_(0.1).add_(1.0)
    else:
        values.mul_(0.05)


def _fill_from_pool_(data: torch.Tensor, name: str, generator: torch.Generator) -> None:
    """Fill a large parameter with rotations of a pool of `_POOL` drawn values, each chunk of `_POOL`
    elements rotated by its own drawn offset.

    Drawing every element costs ~4.4 ns each on a CPU core (~7 s for the 1.5 G parameters of the two
    FLUX.1-width single-file tests), copying a rotation ~0.2 ns. The values stay noise-like where it
    matters: two rows, blocks or parameters alike would let a misplaced one read back equal, and rows
    here come from different pool offsets, parameters from different pools.
    """
    pool = torch.randn(_POOL, generator=generator, dtype=torch.float32)
    _scale_(pool, data.ndim, data[0].numel() if data.ndim >= 2 else 0, name)
    pool = pool.to(data.dtype)
    flat = data.view(-1)
    chunks = -(-flat.numel() // _POOL)
    offsets = torch.randint(0, _POOL, (chunks,), generator=generator).tolist()
    for index, offset in enumerate(offsets):
        start = index * _POOL
        length = min(_POOL, flat.numel() - start)
        head = min(length, _POOL - offset)
        flat[start:start + head].copy_(pool[offset:offset + head])
        if length > head:
            flat[start + head:start + length].copy_(pool[:length - head])


def _cast_persistent_buffers(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast floating persistent buffers as `from_pretrained(torch_dtype=...)` would."""
    for module_name, module in model.named_modules():
        for key, buffer in module._buffers.items():
            if buffer is None or not buffer.is_floating_point():
                continue
            if key in module._non_persistent_buffers_set:
                continue
            full_name = f"{module_name}.{key}" if module_name else key
            if not keeps_fp32(model, full_name):
                module._buffers[key] = buffer.to(dtype)


def perturb_(model: nn.Module, *, seed: int, scale: float = 1e-2) -> None:
    """Add seeded noise of std `scale` to every floating parameter, in place (the 'trained' actor)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():  # deduplicates tied parameters
            if param.is_floating_point():
                noise = torch.randn(param.shape, generator=generator, dtype=param.dtype)
                param.add_(noise, alpha=scale)


def tiny_forward_inputs(class_name: str, config: Mapping[str, Any], *, seed: int = 0) -> ForwardInputs:
    """Fixed tiny keyword inputs (batch 1) for one forward pass of a model built from `config`."""
    gen = torch.Generator().manual_seed(seed)

    def noise(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    text = 3
    if class_name == "FluxTransformer2DModel":
        img_ids = torch.zeros(4, 3)
        img_ids[:, 1] = torch.tensor([0.0, 0.0, 1.0, 1.0])
        img_ids[:, 2] = torch.tensor([0.0, 1.0, 0.0, 1.0])
        return {
            "hidden_states": noise(1, 4, config["in_channels"]),
            "encoder_hidden_states": noise(1, text, config["joint_attention_dim"]),
            "pooled_projections": noise(1, config["pooled_projection_dim"]),
            "timestep": torch.tensor([0.5]),
            "img_ids": img_ids,
            "txt_ids": torch.zeros(text, 3),
            "guidance": torch.tensor([3.5]),
        }
    if class_name == "SD3Transformer2DModel":
        return {
            "hidden_states": noise(1, config["in_channels"], 4, 4),
            "encoder_hidden_states": noise(1, text, config["joint_attention_dim"]),
            "pooled_projections": noise(1, config["pooled_projection_dim"]),
            "timestep": torch.tensor([500.0]),
        }
    if class_name == "QwenImageTransformer2DModel":
        return {
            "hidden_states": noise(1, 4, config["in_channels"]),
            "encoder_hidden_states": noise(1, text, config["joint_attention_dim"]),
            "encoder_hidden_states_mask": torch.ones(1, text, dtype=torch.long),
            "timestep": torch.tensor([0.5]),
            "img_shapes": [[(1, 2, 2)]],
        }
    if class_name == "WanTransformer3DModel":
        return {
            "hidden_states": noise(1, config["in_channels"], 2, 2, 2),
            "timestep": torch.tensor([500]),
            "encoder_hidden_states": noise(1, text, config["text_dim"]),
        }
    if class_name == "LTX2VideoTransformer3DModel":
        frames, height, width, audio_frames = 2, 2, 2, 3
        return {
            "hidden_states": noise(1, frames * height * width, config["in_channels"]),
            "audio_hidden_states": noise(1, audio_frames, config["audio_in_channels"]),
            "encoder_hidden_states": noise(1, text, config["caption_channels"]),
            "audio_encoder_hidden_states": noise(1, text, config["caption_channels"]),
            "timestep": torch.tensor([500.0]),
            "encoder_attention_mask": torch.ones(1, text, dtype=torch.bool),
            "num_frames": frames,
            "height": height,
            "width": width,
            "audio_num_frames": audio_frames,
            "fps": 25.0,
        }
    if class_name == "MiniMaxH3Transformer3DModel":
        return _minimax_h3_inputs(config, noise)
    raise UsageError(f"no tiny forward inputs for {class_name!r}")


def _minimax_h3_inputs(config: Mapping[str, Any], noise: Any) -> ForwardInputs:
    """One packed sequence: 2 text rows, 2 audio rows, 3 video rows, two noise levels."""
    n_text, n_audio, n_video = 2, 2, 3
    length = n_text + n_audio + n_video
    text_idx = torch.arange(n_text)
    audio_idx = torch.arange(n_text, n_text + n_audio)
    video_idx = torch.arange(n_text + n_audio, length)
    tags = torch.zeros(length, dtype=torch.long)  # 0 video, 1 text, 2 audio
    tags[text_idx] = 1
    tags[audio_idx] = 2
    timestep_idx = torch.zeros(length, dtype=torch.long)
    timestep_idx[audio_idx] = 1
    positions = torch.zeros(length, 3)
    positions[:, 0] = torch.arange(length, dtype=torch.float32)
    pt, ph, pw = config["patch_size"]
    return {
        "hidden_states": noise(1, n_video, config["in_channels"] * pt * ph * pw),
        "audio_hidden_states": noise(1, n_audio, config["audio_in_channels"]),
        "encoder_hidden_states": noise(1, n_text, config["text_dim"]),
        "timestep": torch.tensor([0.7, 0.3]),
        "timestep_indices": timestep_idx,
        "token_tags": tags,
        "position_ids": positions,
        "video_indices": video_idx,
        "audio_indices": audio_idx,
        "text_indices": text_idx,
    }


def run_tiny_forward(model: ModelMixin) -> tuple[torch.Tensor, ...]:
    """Run one no-grad forward pass of a tiny model on its fixed inputs; return the output tensors."""
    inputs = tiny_forward_inputs(type(model).__name__, dict(model.config))
    # A cast model (bf16, fp32-kept modules aside) wants its activations in its own dtype.
    inputs = {
        key: value.to(model.dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value
        for key, value in inputs.items()
    }
    with torch.no_grad():
        outputs = model(**inputs, return_dict=False)
    return tuple(out for out in outputs if isinstance(out, torch.Tensor))
