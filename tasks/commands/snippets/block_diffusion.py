"""Greedy block diffusion from an exported block_diffusion folder with transformers alone: DiffusionGemma's own
`generate`, one canvas (block) at a time, one denoising step per block. Each canvas starts from the uniform random
tokens dllm-flow's canvas sampler draws from the same seed, so the tokens equal
`dllm-flow generate --temperature 0 --steps <blocks> --block-size <canvas_length>` (docs/strategies.md §9.5)."""

import torch
from transformers import AutoTokenizer, DiffusionGemmaForBlockDiffusion

MODEL_TYPE = "diffusion_gemma"  # the checkpoints this snippet samples from
FOLDER = "."  # the exported folder
PROMPT = "To be, or not to be"
MAX_NEW_TOKENS = 48
SEED = 0

tokenizer = AutoTokenizer.from_pretrained(FOLDER)
model = DiffusionGemmaForBlockDiffusion.from_pretrained(FOLDER).eval()
block, vocab = model.config.canvas_length, model.config.text_config.vocab_size
generator = torch.Generator().manual_seed(SEED)
uncached = tokenizer(PROMPT, add_special_tokens=False, return_tensors="pt").input_ids
cache, new = None, []
with torch.no_grad():
    for _ in range(-(-MAX_NEW_TOKENS // block)):
        canvas = torch.randint(0, vocab, (1, block), generator=generator)  # the block's starting noise
        out = model.generate(
            uncached, cache=cache, decoder_input_ids=canvas, max_new_tokens=block, max_denoising_steps=1
        )
        cache, uncached = out.cache, out.sequences[:, -block:]  # the encoder cache, and the block to encode next
        new += uncached[0].tolist()
        if tokenizer.eos_token_id in new:
            break
new = new[:MAX_NEW_TOKENS]
if tokenizer.eos_token_id in new:
    new = new[: new.index(tokenizer.eos_token_id)]
print(new)
print(tokenizer.decode(new))
