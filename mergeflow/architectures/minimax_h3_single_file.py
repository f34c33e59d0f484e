"""MiniMax H3: the original single-file layout is the native `MiniMaxH3DiTModel` state dict, stacked QKV.

The exact inverse of Diffusers' `convert_minimax_h3_transformer_checkpoint_to_diffusers`
(`single_file_utils.py`), which `MiniMaxH3Transformer3DModel.from_single_file` runs:

- its key renames are those of the native package (`minimax_h3.native_name`), so the names are
  reused from there rather than restated;
- with `qkv_layout="stacked"` (its default, and the row order of every published single file:
  Comfy-Org/MiniMax-H3 and the GGUFs made from it) it splits `attn.qkv_proj.weight` with
  `torch.chunk(3)`, so the fused tensor is a plain row `cat` of to_q, to_k, to_v;
- it swaps the GEGLU `ff.net.0.proj.weight` halves ([gate; value] -> [value; gate]), so the file
  holds `mlp.fc1.weight` with the halves exchanged back (`swap_halves`, its own inverse);
- it drops `rope.inv_freq` when present (`pop(..., None)`) because the Diffusers model recomputes
  that non-persistent buffer from the config: the file need not carry it, and this map leaves it out.

Detection: `infer_diffusers_model_type` calls a file "minimax-h3" when it holds
`token_refiner.blocks.0.attn.qkv_proj.weight`, which this map writes whenever the model has a
token refiner (every released H3 has one).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mergeflow.architectures.minimax_h3 import native_plan
from mergeflow.architectures.quantization import FP8Rule
from mergeflow.architectures.original_layout import (
    Op,
    OriginalLayout,
    OriginalTensor,
    Shape,
)
from mergeflow.errors import SchemaMismatchError

# The native conversion's op -> this protocol's op. The native `fuse_qkv` is a plain row `cat` in
# the stacked layout (the interleaved one is not a row concatenation, hence never used here).
_OPS: dict[str, Op] = {"rename": "rename", "swap_halves": "swap_halves", "fuse_qkv": "cat"}
# Which QKV row order the file holds; passed to the loader so its reading never rests on a default.
QKV_LAYOUT = "stacked"


def plan(shapes: Mapping[str, Shape], params: Mapping[str, Any]) -> list[OriginalTensor]:
    """Every Diffusers tensor -> its native key (layer counts come from the names, never assumed)."""
    out: list[OriginalTensor] = []
    for name, (op, sources) in sorted(native_plan(list(shapes)).items()):
        if op == "fuse_qkv" and len({tuple(shapes[s])[:1] for s in sources}) != 1:
            # The loader splits the fused rows into three equal chunks: unequal parts would be misread.
            raise SchemaMismatchError(f"{name}: {', '.join(sources)} have different row counts; "
                                      "the loader splits it into three equal parts")
        out.append(OriginalTensor(name, tuple(sources), _OPS[op]))
    return out


ORIGINAL = OriginalLayout(
    name="minimax_h3",
    transformer_classes=("MiniMaxH3Transformer3DModel",),
    plan=plan,
    # ModelSpec has no registered H3 identifier; "minimax-h3" is the model type Diffusers' own
    # single-file detection gives these files (CHECKPOINT_KEY_NAMES / DIFFUSERS_DEFAULT_PIPELINE_PATHS).
    architecture=lambda config: "minimax-h3",
    implementation="https://github.com/MiniMax-AI/MiniMax-H3",
    # No native resolution: H3 generates many aspect ratios at a 768-pixel short side.
    loader_kwargs=lambda config: {"qkv_layout": QKV_LAYOUT},
    # --quantize fp8: the blocks' linear weights; modulation and norms stay bf16 (see quantization.py).
    fp8=FP8Rule(blocks=r"blocks\.\d+\.", keep=r"modulation|adaLN|norm"),
)
