"""Tiny, offline, real base pipeline directories for the video architectures (Wan, Wan2.2, LTX-2).

The caller passes a ready tiny Diffusers transformer; every other component is built tiny and
random (seeded, so two builds are identical) with its dimensions taken from
``transformer.config``. Tokenizers are written once by their own builders (never re-serialised),
``model_index.json`` is written by the pipeline class itself (``save_config``), every model is
saved with ``save_pretrained`` (safetensors), and LICENSE and README.md sit at the root, so
``DiffusionPipeline.from_pretrained(root, local_files_only=True)`` loads the right class.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mergeflow.synthetic.components import seeded, t5_encoder, write_extras
from mergeflow.synthetic.tokenizers import save_gemma_tokenizer, save_t5_tokenizer

# Wan2.1 T2V ships UniPC in flow mode; only the class and these knobs matter here.
_WAN_SCHEDULER: dict[str, Any] = {
    "flow_shift": 3.0,
    "num_train_timesteps": 1000,
    "prediction_type": "flow_prediction",
    "use_flow_sigmas": True,
}
# LTX-2 encodes audio as mel spectrograms; the latent mel axis is 4x shorter than the input's.
_LTX2_MEL_COMPRESSION = 4
_LTX2_SAMPLE_RATE = 16000


def write_pipeline(pipe: Any, root: Path, *, written: frozenset[str] = frozenset()) -> Path:
    """Save ``pipe``'s model_index.json and every component not in ``written`` under ``root``, plus extras."""
    root.mkdir(parents=True, exist_ok=True)
    # save_config writes exactly the model_index.json that save_pretrained would.
    pipe.save_config(root)
    for name, component in pipe.components.items():
        if component is not None and name not in written:
            component.save_pretrained(root / name)
    write_extras(root, type(pipe).__name__)
    return root


def wan_vae(z_dim: int, *, seed: int = 4) -> Any:
    """Build a tiny AutoencoderKLWan with ``z_dim`` latent channels (Wan's 4x temporal, 8x spatial)."""
    from diffusers import AutoencoderKLWan

    with seeded(seed):
        return AutoencoderKLWan(
            base_dim=4,
            z_dim=z_dim,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
            latents_mean=[0.0] * z_dim,
            latents_std=[1.0] * z_dim,
        ).eval()


def build_wan_pipeline(
    root: Path,
    transformer: Any,
    *,
    transformer_2: Any | None = None,
    boundary_ratio: float | None = None,
    expand_timesteps: bool = False,
) -> Path:
    """Write a tiny WanPipeline (Wan2.2 layout with ``transformer_2`` + ``boundary_ratio``) around ``transformer``."""
    from diffusers import UniPCMultistepScheduler, WanPipeline
    from transformers import T5Tokenizer, UMT5EncoderModel

    if (transformer_2 is None) != (boundary_ratio is None):
        raise ValueError("Wan2.2 needs transformer_2 and boundary_ratio together (or neither for Wan2.1)")
    config = transformer.config
    root = Path(root)
    tokenizer = T5Tokenizer.from_pretrained(save_t5_tokenizer(root / "tokenizer"), local_files_only=True)
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=t5_encoder(config.text_dim, tokenizer, cls=UMT5EncoderModel),
        # WanPipeline draws latents with the transformer's in_channels.
        vae=wan_vae(config.in_channels),
        scheduler=UniPCMultistepScheduler(**_WAN_SCHEDULER),
        transformer=transformer,
        transformer_2=transformer_2,
        boundary_ratio=boundary_ratio,
        expand_timesteps=expand_timesteps,
    )
    return write_pipeline(pipe, root, written=frozenset({"tokenizer"}))


def gemma3_text_encoder(hidden: int, tokenizer: Any, *, seed: int = 1) -> Any:
    """Build a tiny Gemma3ForConditionalGeneration whose text hidden size is ``hidden``."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    # Gemma 3 validates hidden_size % heads even though head_dim is set on its own.
    heads = 2 if hidden % 2 == 0 else 1
    start, end, soft = tokenizer.convert_tokens_to_ids(["<start_of_image>", "<end_of_image>", "<image_soft_token>"])
    config = Gemma3Config(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": hidden,
            "intermediate_size": 16,
            "num_hidden_layers": 2,
            "num_attention_heads": heads,
            "num_key_value_heads": 1,
            "head_dim": 8,  # independent of hidden_size in Gemma 3, so any width works
            "max_position_embeddings": 1024,
            "sliding_window": 16,
            "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
        },
        vision_config={
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 16,
            "patch_size": 8,
        },
        # (16 / 8)^2 patches pooled to 2x2 soft tokens per image.
        mm_tokens_per_image=4,
        boi_token_index=start,
        eoi_token_index=end,
        image_token_index=soft,
    )
    with seeded(seed):
        return Gemma3ForConditionalGeneration(config).eval()


def ltx2_connectors(caption_channels: int, text_layers: int, transformer_config: Any, *, seed: int = 5) -> Any:
    """Build tiny LTX2TextConnectors mapping stacked Gemma states to ``caption_channels``."""
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    # Without per-modality projections each connector runs at the caption width itself.
    heads = 2 if caption_channels % 4 == 0 else 1
    with seeded(seed):
        return LTX2TextConnectors(
            caption_channels=caption_channels,
            text_proj_in_factor=text_layers + 1,  # every hidden state, embeddings included
            video_connector_num_attention_heads=heads,
            video_connector_attention_head_dim=caption_channels // heads,
            video_connector_num_layers=1,
            video_connector_num_learnable_registers=None,
            audio_connector_num_attention_heads=heads,
            audio_connector_attention_head_dim=caption_channels // heads,
            audio_connector_num_layers=1,
            audio_connector_num_learnable_registers=None,
            connector_rope_base_seq_len=32,
            rope_double_precision=transformer_config.rope_double_precision,
            rope_type=transformer_config.rope_type,
        ).eval()


def ltx2_video_vae(latent_channels: int, *, seed: int = 4) -> Any:
    """Build a tiny AutoencoderKLLTX2Video (one spatial down/up stage)."""
    from diffusers import AutoencoderKLLTX2Video

    with seeded(seed):
        return AutoencoderKLLTX2Video(
            latent_channels=latent_channels,
            block_out_channels=(8,),
            decoder_block_out_channels=(8,),
            layers_per_block=(1,),
            decoder_layers_per_block=(1, 1),
            spatio_temporal_scaling=(True,),
            decoder_spatio_temporal_scaling=(True,),
            decoder_inject_noise=(False, False),
            downsample_type=("spatial",),
            upsample_residual=(False,),
            upsample_factor=(1,),
            patch_size=1,
            patch_size_t=1,
            decoder_causal=False,
        ).eval()


def ltx2_audio_geometry(audio_in_channels: int) -> tuple[int, int]:
    """Return (latent_channels, mel_bins) whose packed audio rows have ``audio_in_channels`` values."""
    # The pipeline packs (channels x latent mel bins) into one row of the audio stream.
    latent_mel = 2 if audio_in_channels % 2 == 0 else 1
    return audio_in_channels // latent_mel, latent_mel * _LTX2_MEL_COMPRESSION


def ltx2_audio_vae(latent_channels: int, mel_bins: int, *, seed: int = 6) -> Any:
    """Build a tiny AutoencoderKLLTX2Audio (stereo mel in and out)."""
    from diffusers import AutoencoderKLLTX2Audio

    with seeded(seed):
        return AutoencoderKLLTX2Audio(
            base_channels=4,
            output_channels=2,
            ch_mult=(1,),
            num_res_blocks=1,
            in_channels=2,
            resolution=32,
            latent_channels=latent_channels,
            sample_rate=_LTX2_SAMPLE_RATE,
            mel_bins=mel_bins,
        ).eval()


def ltx2_vocoder(mel_channels: int, *, seed: int = 7) -> Any:
    """Build a tiny LTX2Vocoder turning ``mel_channels`` (stereo x mel bins) into stereo audio."""
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    with seeded(seed):
        return LTX2Vocoder(
            in_channels=mel_channels,
            hidden_channels=16,
            out_channels=2,
            upsample_kernel_sizes=[4, 4],
            upsample_factors=[2, 2],
            resnet_kernel_sizes=[3],
            resnet_dilations=[[1, 3, 5]],
            output_sampling_rate=_LTX2_SAMPLE_RATE,
        ).eval()


def build_ltx2_pipeline(root: Path, transformer: Any) -> Path:
    """Write a tiny LTX2Pipeline (Gemma 3, connectors, video + audio VAEs, vocoder) around ``transformer``."""
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2Pipeline
    from transformers import GemmaTokenizer

    config = transformer.config
    root = Path(root)
    tokenizer = GemmaTokenizer.from_pretrained(save_gemma_tokenizer(root / "tokenizer"), local_files_only=True)
    text_encoder = gemma3_text_encoder(config.caption_channels, tokenizer)
    latent_channels, mel_bins = ltx2_audio_geometry(config.audio_in_channels)
    audio_vae = ltx2_audio_vae(latent_channels, mel_bins)
    pipe = LTX2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=ltx2_video_vae(config.in_channels),
        audio_vae=audio_vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        connectors=ltx2_connectors(
            config.caption_channels, text_encoder.config.text_config.num_hidden_layers, config
        ),
        transformer=transformer,
        vocoder=ltx2_vocoder(audio_vae.config.output_channels * mel_bins),
    )
    return write_pipeline(pipe, root, written=frozenset({"tokenizer"}))


def tiny_wan_transformer(*, seed: int = 0) -> Any:
    """Return a seeded tiny WanTransformer3DModel with which build_wan_pipeline's pipeline runs end to end."""
    from diffusers import WanTransformer3DModel

    with seeded(seed):
        return WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
            out_channels=4, text_dim=16, freq_dim=32, ffn_dim=32, num_layers=2, rope_max_seq_len=32,
        ).eval()


def tiny_ltx2_transformer(*, seed: int = 0) -> Any:
    """Return a seeded tiny LTX2VideoTransformer3DModel with which build_ltx2_pipeline's pipeline runs."""
    from diffusers import LTX2VideoTransformer3DModel

    with seeded(seed):
        return LTX2VideoTransformer3DModel(
            in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2,
            attention_head_dim=8, cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4,
            audio_num_attention_heads=2, audio_attention_head_dim=4, audio_cross_attention_dim=8,
            num_layers=2, caption_channels=16, rope_double_precision=False, rope_type="split",
        ).eval()
