"""What the absorbing programs share (mdlm, idlm, hybrid): dllm-flow's [MASK] filling at temperature 0, the most
confident proposals first, window by window (dllm-flow's docs/strategies.md §11.2). The model card inlines it into
each program (`tasks.commands.snippets.program`)."""

import math

import torch


def fill_window(logits_of, x, lo, hi, steps, settings, generator, ended=None):
    """The canvas `x` [1, T] with every [MASK] among columns [lo, hi) filled in at most `steps` forwards of
    `logits_of(x)` → [1, T, V]. Per forward: the argmax proposal at each [MASK] of the window, ranked by its
    probability (`dllm_remasking: low_confidence`; `random`: by a uniform draw), ties to the leftmost; the
    scheduled number of them is revealed (the window's masks spread evenly, the first steps one more), or with
    `dllm_threshold` the top one plus every one at least that probable, until the window is full. `ended(x)`
    true stops early (EOS)."""
    mask_id, remasking = settings["mask_token_id"], settings["dllm_remasking"]
    threshold = settings.get("dllm_threshold")
    if remasking not in ("low_confidence", "random"):
        raise SystemExit(f"dllm_remasking {remasking!r}: use low_confidence or random (generation_config.json)")
    count = int((x[0, lo:hi] == mask_id).sum())
    if threshold is not None:
        steps = max(1, count)
    schedule = [count // steps + (s < count % steps) for s in range(steps)]
    for s in range(steps):
        masked = torch.zeros_like(x, dtype=torch.bool)
        masked[0, lo:hi] = x[0, lo:hi] == mask_id
        if not masked.any():
            break
        logits = logits_of(x).clone()
        logits[..., mask_id] = -math.inf  # a position is never revealed as [MASK]
        proposal = logits.argmax(-1)
        if remasking == "random":
            confidence = torch.rand(x.shape, generator=generator, device=x.device)
        else:  # the probability in float32, whatever the model's dtype
            confidence = torch.softmax(logits.float(), -1).gather(-1, proposal[..., None])[..., 0]
        confidence = torch.where(masked, confidence, -math.inf)
        order = torch.argsort(confidence[0], descending=True, stable=True)
        if threshold is None:
            n = min(schedule[s], int(masked.sum()))
        else:
            n = max(1, int((confidence[0] >= threshold).sum()))
        reveal = torch.zeros_like(masked)
        reveal[0, order[:n]] = True
        x = torch.where(reveal & masked, proposal, x)
        if ended is not None and ended(x):
            break
    return x


def absorbing_sample(logits_of, prompt, settings, generator):
    """dllm-flow's absorbing sampler for one prompt: the prompt then `max_new_tokens` [MASK]s, filled block by
    block (`dllm_block_size`), `dllm_steps` spread over the blocks. Once an EOS has no [MASK] before it the rest
    is moot: decoding stops and the remaining [MASK]s become EOS. Returns the generated ids."""
    mask_id, eos_id, new = settings["mask_token_id"], settings.get("eos_token_id"), settings["max_new_tokens"]
    size = min(settings["dllm_block_size"], new)
    blocks = math.ceil(new / size)
    steps = max(1, math.ceil(settings["dllm_steps"] / blocks))
    start = len(prompt)
    x = torch.tensor([prompt + [mask_id] * new], device=generator.device)  # the generator lives with the model

    def ended(x):
        generated = x[0, start:].tolist()
        return eos_id in generated and mask_id not in generated[: generated.index(eos_id)]

    for b in range(blocks):
        x = fill_window(
            logits_of, x, start + b * size, start + min((b + 1) * size, new), steps, settings, generator, ended
        )
        if ended(x):
            x = torch.where(x == mask_id, eos_id, x)
            break
    return x[0, start:].tolist()
