"""Sample from a hybrid export of dllm-flow with torch and transformers alone: `python hybrid.py EXPORT_DIR "PROMPT"`
prints what `dllm-flow generate --checkpoint EXPORT_DIR --prompt "PROMPT" --temperature 0` prints, token for token, for
the same sampler settings (the program names the command on stderr): dllm-flow's default hybrid sampler (`hybrid`: each
block seeded by the causal branch, completed by the diffusion branch) at temperature 0.

Its settings are the export's generation_config.json (`dllm_steps`, `dllm_block_size`, `max_new_tokens`,
`mask_token_id`, `eos_token_id`, `dllm_remasking`, `dllm_threshold`); the flags override the first three. `--seed`
matters only with `dllm_remasking: random`. On stderr it names the `dllm-flow generate` command, every setting spelled
out, that prints the same tokens. The top level of a hybrid export is the plain backbone, which is both branches: the
causal one under its own attention, the diffusion one under the all-visible mask.
"""

import math

import torch
from absorbing import fill_window
from common import denoiser_logits, main


def sample(model, prompt, settings, generator):
    """The generated ids, block by block: the block's first token is the causal branch's next-token prediction
    after the context; the diffusion branch then fills the block's other positions, over the context and the
    block only (no [MASK]s beyond it). Decoding stops after a block that holds an EOS."""
    mask_id, eos_id, new = settings["mask_token_id"], settings.get("eos_token_id"), settings["max_new_tokens"]
    size = min(settings["dllm_block_size"], new)
    blocks = math.ceil(new / size)
    steps = max(1, math.ceil(settings["dllm_steps"] / blocks))
    context = torch.tensor([prompt], device=generator.device)  # the generator lives with the model

    def diffusion(x):
        return denoiser_logits(model, x, settings)

    for b in range(blocks):
        width = min(size, new - b * size)
        seed_logits = model(input_ids=context, use_cache=False).logits[:, -1:].clone()
        seed_logits[..., mask_id] = -math.inf
        masks = torch.full((1, width - 1), mask_id, device=context.device)
        x = torch.cat([context, seed_logits.argmax(-1), masks], dim=1)
        context = fill_window(diffusion, x, context.shape[1], x.shape[1], steps, settings, generator)
        if eos_id in context[0, len(prompt) :].tolist():
            break
    return context[0, len(prompt) :].tolist()


if __name__ == "__main__":
    main(sample)
