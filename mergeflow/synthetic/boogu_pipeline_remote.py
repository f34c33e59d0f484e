"""Remote code of tiny Boogu-Image bases: the root ``pipeline.py`` Diffusers' ``custom_pipeline`` loads.

``DiffusionPipeline.from_pretrained(root, custom_pipeline=str(root), trust_remote_code=True)``
finds ``BooguImagePipeline`` here; its components (remote-code transformer and scheduler, FLUX
style VAE, Qwen3-VL MLLM and processor) come from ``model_index.json``. Text-to-image only: the
prompt is rendered with the processor's chat template, the MLLM's last hidden state conditions
the transformer, and the scheduler integrates the velocity from noise (t = 0) to data (t = 1).
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import DiffusionPipeline
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.pipeline_utils import ImagePipelineOutput
from diffusers.utils.torch_utils import randn_tensor

SYSTEM_PROMPT = (
    "You are a helpful assistant that generates high-quality images based on user instructions. "
    "The instructions are as follows."
)


class BooguImagePipeline(DiffusionPipeline):
    """Text-to-image with a Boogu-Image transformer conditioned on Qwen3-VL features."""

    model_cpu_offload_seq = "mllm->transformer->vae"

    def __init__(self, transformer: Any, vae: Any, scheduler: Any, mllm: Any, processor: Any) -> None:
        super().__init__()
        self.register_modules(transformer=transformer, vae=vae, scheduler=scheduler, mllm=mllm, processor=processor)
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        # Latents are patchified by the transformer, so images align to both factors.
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor * 2)

    def encode_prompt(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        """MLLM features [1, L, D] and mask [1, L] of ``prompt`` in the T2I chat format."""
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": [{"type": "text", "text": prompt}]},
        ]
        text = self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        inputs = self.processor(text=[text], return_tensors="pt").to(self.mllm.device)
        hidden = self.mllm(
            input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], output_hidden_states=True
        ).hidden_states[-1]
        return hidden, inputs["attention_mask"].bool()

    @torch.no_grad()
    def __call__(
        self,
        prompt: str,
        height: int = 64,
        width: int = 64,
        num_inference_steps: int = 28,
        generator: torch.Generator | None = None,
        output_type: str = "pil",
        return_dict: bool = True,
    ) -> ImagePipelineOutput | tuple[Any]:
        features, mask = self.encode_prompt(prompt)
        channels = self.transformer.config.in_channels
        shape = (1, channels, height // self.vae_scale_factor, width // self.vae_scale_factor)
        latents = randn_tensor(shape, generator=generator, device=self._execution_device, dtype=torch.float32)
        num_tokens = (shape[2] // self.transformer.config.patch_size) * (shape[3] // self.transformer.config.patch_size)
        self.scheduler.set_timesteps(num_inference_steps, device=self._execution_device, num_tokens=num_tokens)
        for t in self.progress_bar(self.scheduler.timesteps):
            velocity = self.transformer(
                hidden_states=latents.to(self.transformer.dtype),
                timestep=t.expand(1),
                instruction_hidden_states=features.to(self.transformer.dtype),
                instruction_attention_mask=mask,
            ).sample
            latents = self.scheduler.step(velocity, t, latents).prev_sample
        if output_type == "latent":
            image = latents
        else:
            latents = latents / self.vae.config.scaling_factor + (self.vae.config.shift_factor or 0.0)
            decoded = self.vae.decode(latents.to(self.vae.dtype)).sample
            image = self.image_processor.postprocess(decoded, output_type=output_type)
        self.maybe_free_model_hooks()
        return ImagePipelineOutput(images=image) if return_dict else (image,)
