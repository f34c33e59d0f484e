"""Scale a tiny transformer config so that its weights total a requested number of bytes."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from mergeflow.demo.tiny_transformers import (
    TINY_TRANSFORMER_CONFIGS,
    ModelKwargs,
    keeps_fp32,
    transformer_class,
)
from mergeflow.errors import UsageError

SIZE_TOLERANCE = 0.15
# Width grows in whole heads of this size, depth fills in the rest; about this many layers
# keeps both the per-layer step (~1/8 of the total) and the tensor count realistic.
_TARGET_LAYERS = 8
_MIN_LAYERS = 2  # SD3's first (dual) and last (context-pre-only) blocks differ from the rest


def _flux(heads: int, layers: int) -> ModelKwargs:
    return {
        "num_attention_heads": heads,
        "attention_head_dim": 128,
        "axes_dims_rope": (16, 56, 56),
        "num_layers": layers,
        "num_single_layers": 2 * layers,
    }


def _sd3(heads: int, layers: int) -> ModelKwargs:
    return {
        "num_attention_heads": heads,
        "attention_head_dim": 64,
        "caption_projection_dim": 64 * heads,
        "num_layers": layers,
    }


def _qwen(heads: int, layers: int) -> ModelKwargs:
    return {
        "num_attention_heads": heads,
        "attention_head_dim": 128,
        "axes_dims_rope": (16, 56, 56),
        "num_layers": layers,
    }


def _wan(heads: int, layers: int) -> ModelKwargs:
    return {"num_attention_heads": heads, "attention_head_dim": 128, "ffn_dim": 512 * heads, "num_layers": layers}


def _ltx2(heads: int, layers: int) -> ModelKwargs:
    return {
        "num_attention_heads": heads,
        "attention_head_dim": 128,
        "cross_attention_dim": 128 * heads,
        "num_layers": layers,
    }


def _minimax_h3(heads: int, layers: int) -> ModelKwargs:
    return {
        "num_attention_heads": heads,
        "attention_head_dim": 128,
        "hidden_size": 128 * heads,
        "ffn_dim": 512 * heads,
        "time_embed_hidden_dim": 128 * heads,
        "time_embed_dim": 64 * heads,
        "num_layers": layers,
    }


_SCALERS: dict[str, Callable[[int, int], ModelKwargs]] = {
    "FluxTransformer2DModel": _flux,
    "SD3Transformer2DModel": _sd3,
    "QwenImageTransformer2DModel": _qwen,
    "WanTransformer3DModel": _wan,
    "LTX2VideoTransformer3DModel": _ltx2,
    "MiniMaxH3Transformer3DModel": _minimax_h3,
}


def state_dict_bytes(class_name: str, overrides: ModelKwargs, dtype: torch.dtype) -> int:
    """Bytes of the model's state dict after a cast to `dtype` (fp32-kept modules at 4 bytes)."""
    config = copy.deepcopy(TINY_TRANSFORMER_CONFIGS[class_name])
    config.update(overrides)
    with torch.device("meta"):
        model = transformer_class(class_name)(**config)
    total = 0
    for name, tensor in model.state_dict().items():
        kept = not tensor.is_floating_point() or keeps_fp32(model, name)
        itemsize = tensor.element_size() if kept else torch.empty((), dtype=dtype).element_size()
        total += tensor.numel() * itemsize
    return total


def scaled_overrides(class_name: str, size_bytes: int, dtype: torch.dtype) -> ModelKwargs:
    """Config overrides (heads, head size, layers) whose weights total `size_bytes` within 15%."""
    transformer_class(class_name)  # clear error for an unknown class
    scale = _SCALERS[class_name]

    def size(heads: int, layers: int) -> int:
        return state_dict_bytes(class_name, scale(heads, layers), dtype)

    # Smallest head count whose ~_TARGET_LAYERS-deep model reaches the target (size grows
    # monotonically with heads): exponential search, then bisection.
    high = 1
    while size(high, _TARGET_LAYERS) < size_bytes and high < 4096:
        high *= 2
    low = max(1, high // 2)
    while low < high:
        mid = (low + high) // 2
        if size(mid, _TARGET_LAYERS) < size_bytes:
            low = mid + 1
        else:
            high = mid
    best: tuple[float, ModelKwargs] | None = None
    for heads in sorted({max(1, low - 1), low}):
        fixed = size(heads, _MIN_LAYERS)
        per_layer = size(heads, _MIN_LAYERS + 1) - fixed  # size is linear in depth past the minimum
        layers = max(_MIN_LAYERS, _MIN_LAYERS + round((size_bytes - fixed) / per_layer))
        error = abs(size(heads, layers) - size_bytes) / size_bytes
        if best is None or error < best[0]:
            best = (error, scale(heads, layers))
    assert best is not None
    if best[0] > SIZE_TOLERANCE:
        raise UsageError(
            f"cannot scale {class_name} to {size_bytes} bytes within {SIZE_TOLERANCE:.0%} "
            f"(closest is {best[0]:.0%} off); ask for a larger size"
        )
    return best[1]
