"""GGUF for city96's ComfyUI-GGUF: each architecture's `general.architecture` and which tensors stay unquantized.

The reference is ComfyUI-GGUF's own converter (`tools/convert.py`, which writes the BF16 file) and its
llama.cpp patch (`tools/lcpp.patch`, `img_tensor_get_type` / the per-architecture `quantize &=` lists,
which decide what a Q8_0 file keeps in BF16):

- keys are the original single-file layout's, with the `model.diffusion_model.` prefix stripped (convert.py's
  `strip_prefix`; the patch refuses a key that still holds it);
- F32: 1-D tensors, tensors of at most 1,024 values (`QUANTIZATION_THRESHOLD`) and each architecture's
  `keys_hiprec` (nn.Parameters its loader cannot take from BF16);
- Q8_0 writes every other tensor in Q8_0 except the patch's per-architecture exclusions (embedders, final
  layer, modulation), which stay BF16, as does a tensor whose rows are not whole 32-value blocks;
- a tensor of more than 4 dims (Wan's Conv3d patch embedding) is beyond GGML's GGML_MAX_DIMS: convert.py sets
  it aside and `fix_5d_tensors.py` adds it back in F32; here it is written in F32 as 2-D (out channels, rest)
  with its shape in `comfy.gguf.orig_shape.<key>`, which ComfyUI-GGUF's loader reads back (`get_orig_shape`).

Qwen-Image: ComfyUI-GGUF's loader knows `qwen_image`, its convert.py has no template for it; its keys are
Diffusers' own and its exclusions follow Flux's (the input, text and time embedders and the final layer).
Boogu-Image and MiniMax H3 are refused: no GGUF loader knows them.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from mergeflow.formats.gguf_quant import Q8_0_BLOCK, GgufType

QUANTIZATION_THRESHOLD = 1024  # convert.py: tensors of at most this many values stay F32
MAX_TENSOR_DIMS = 4  # GGML_MAX_DIMS
MAX_TENSOR_NAME_LENGTH = 127  # convert.py: GGML_MAX_NAME - 1
STRIPPED_PREFIX = "model.diffusion_model."


@dataclass(frozen=True)
class GgufArchitecture:
    """One architecture's GGUF rules (the substrings are matched as convert.py and lcpp.patch match them)."""

    name: str  # general.architecture: a ComfyUI-GGUF IMG_ARCH_LIST value
    keys_hiprec: tuple[str, ...] = ()  # convert.py: kept F32
    keys_excluded: tuple[str, ...] = ()  # lcpp.patch: never quantized (substring)
    names_excluded: tuple[str, ...] = ()  # lcpp.patch: never quantized (whole key)

    def excluded(self, key: str) -> bool:
        return key in self.names_excluded or any(s in key for s in self.keys_excluded)


_BY_CLASS: dict[str, GgufArchitecture] = {
    "FluxTransformer2DModel": GgufArchitecture(
        "flux", keys_excluded=("txt_in.", "img_in.", "time_in.", "vector_in.", "guidance_in.", "final_layer.")),
    "SD3Transformer2DModel": GgufArchitecture(
        "sd3", keys_excluded=("final_layer.", "time_text_embed.", "context_embedder.", "t_embedder.", "y_embedder.",
                              "x_embedder."),
        names_excluded=("proj_out.weight", "pos_embed")),
    "WanTransformer3DModel": GgufArchitecture(
        "wan", keys_hiprec=(".modulation",),
        keys_excluded=("modulation.", "patch_embedding.", "text_embedding.", "time_projection.", "time_embedding.",
                       "img_emb.", "head.")),
    # LTX-2's own modules carry LTX-Video's names inside longer ones (`av_ca_*_adaln_single.`,
    # `audio_patchify_proj.`, `scale_shift_table_a2v_ca_*`): the substrings cover them too.
    "LTX2VideoTransformer3DModel": GgufArchitecture(
        "ltxv", keys_hiprec=("scale_shift_table",),
        keys_excluded=("adaln_single.", "caption_projection.", "patchify_proj.", "proj_out.", "scale_shift_table")),
    "QwenImageTransformer2DModel": GgufArchitecture(
        "qwen_image", keys_excluded=("img_in.", "txt_in.", "txt_norm.", "time_text_embed.", "norm_out.", "proj_out.")),
}

NO_GGUF: dict[str, str] = {
    "BooguImageTransformer2DModel": "Boogu-Image has no GGUF loader (ComfyUI-GGUF knows no such architecture)",
    "MiniMaxH3Transformer3DModel": "MiniMax H3 has no GGUF loader (ComfyUI-GGUF knows no such architecture)",
}


def architecture_for(transformer_class: str) -> GgufArchitecture | None:
    return _BY_CLASS.get(transformer_class)


def architecture_named(name: str) -> GgufArchitecture | None:
    return next((a for a in _BY_CLASS.values() if a.name == name), None)


def supported_classes() -> tuple[str, ...]:
    return tuple(_BY_CLASS)


def gguf_key(key: str) -> str:
    """A single-file key as ComfyUI-GGUF's files hold it (convert.py's `strip_prefix`)."""
    return key.removeprefix(STRIPPED_PREFIX)


@dataclass(frozen=True)
class TensorEncoding:
    """How one tensor is stored: its GGUF type, the shape written (numpy order), why it is not quantized."""

    kind: GgufType
    stored_shape: tuple[int, ...]
    reason: str  # "quantized", or why not: "1-D", "small", "high precision", "excluded", "rows not whole blocks", ">4-D"


def encoding(arch: GgufArchitecture, key: str, shape: tuple[int, ...], method: str) -> TensorEncoding:
    """convert.py's choice for one tensor under --quantize `method` (bf16 or q8_0)."""
    if len(shape) > MAX_TENSOR_DIMS:
        return TensorEncoding("F32", (shape[0], prod(shape[1:])), ">4-D")
    if len(shape) <= 1:
        return TensorEncoding("F32", shape, "1-D")
    if prod(shape) <= QUANTIZATION_THRESHOLD:
        return TensorEncoding("F32", shape, "small")
    if any(s in key for s in arch.keys_hiprec):
        return TensorEncoding("F32", shape, "high precision")
    if method == "bf16":
        return TensorEncoding("BF16", shape, "quantized")
    if arch.excluded(key):
        return TensorEncoding("BF16", shape, "excluded")
    if shape[-1] % Q8_0_BLOCK:
        return TensorEncoding("BF16", shape, "rows not whole blocks")
    return TensorEncoding("Q8_0", shape, "quantized")
