"""Sample from an mdlm export of dllm-flow with torch and transformers alone: `python mdlm.py EXPORT_DIR "PROMPT"`
prints what `dllm-flow generate --checkpoint EXPORT_DIR --prompt "PROMPT" --temperature 0` prints, token for token, for
the same sampler settings (the program names the command on stderr): dllm-flow's default mdlm sampler (`llada`, the
absorbing sampler) at temperature 0.

Its settings are the export's generation_config.json (`dllm_steps`, `dllm_block_size`, `max_new_tokens`,
`mask_token_id`, `eos_token_id`, `dllm_remasking`, `dllm_threshold`); the flags override the first three. `--seed`
matters only with `dllm_remasking: random`. On stderr it names the `dllm-flow generate` command, every setting spelled
out, that prints the same tokens.
"""

from absorbing import absorbing_sample
from common import denoiser_logits, main


def sample(model, prompt, settings, generator):
    """The generated ids: the absorbing sampler over the bidirectional denoiser."""
    return absorbing_sample(lambda x: denoiser_logits(model, x, settings), prompt, settings, generator)


if __name__ == "__main__":
    main(sample)
