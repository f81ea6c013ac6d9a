"""Sample from an idlm export of dllm-flow with torch and transformers alone: `python idlm.py EXPORT_DIR "PROMPT"`
prints what `dllm-flow generate --checkpoint EXPORT_DIR --prompt "PROMPT" --temperature 0` prints, token for token, for
the same sampler settings (the program names the command on stderr): dllm-flow's default idlm sampler (`idlm`, the
absorbing sampler reading the logits shifted by one) at temperature 0.

Its settings are the export's generation_config.json (`dllm_steps`, `dllm_block_size`, `max_new_tokens`,
`mask_token_id`, `eos_token_id`, `dllm_logit_shift`, `dllm_remasking`, `dllm_threshold`); the flags override the first
three. `--seed` matters only with `dllm_remasking: random`. On stderr it names the `dllm-flow generate` command, every
setting spelled out, that prints the same tokens.
"""

import torch
from absorbing import absorbing_sample
from common import main


def shifted_causal_logits(model, x, shift):
    """An idlm model denoises under its plain causal attention, and the logits of a position predict the next
    token: position p reads the model's row p - shift (`dllm_logit_shift`, 1); the first rows read zeros."""
    logits = model(input_ids=x, use_cache=False).logits
    if shift == 0:
        return logits
    shifted = torch.zeros_like(logits)
    shifted[:, shift:] = logits[:, :-shift]
    return shifted


def sample(model, prompt, settings, generator):
    """The generated ids: the absorbing sampler over the shifted causal logits."""
    shift = settings["dllm_logit_shift"]
    return absorbing_sample(lambda x: shifted_causal_logits(model, x, shift), prompt, settings, generator)


if __name__ == "__main__":
    main(sample)
