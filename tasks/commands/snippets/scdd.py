"""Sample from an scdd export of dllm-flow with torch and transformers alone: `python scdd.py EXPORT_DIR "PROMPT"`
prints what `dllm-flow generate --checkpoint EXPORT_DIR --prompt "PROMPT" --temperature 0` prints, token for token, for
the same sampler settings and `--seed` (default 42 in both; the program names the command on stderr): dllm-flow's
default scdd sampler (`scdd`, ancestral posterior steps then a noise-removal pass) at temperature 0. It draws random
numbers even at temperature 0 (whether a visible token is revised, how many [MASK]s a step reveals), so the seed
matters.

Its settings are the export's generation_config.json (`dllm_steps`, `max_new_tokens`, `mask_token_id`, `eos_token_id`,
`dllm_remasking`, and the strategy's options `dllm_options`: the noise schedule `uniform_ratio`, `schedule_shape`,
`schedule_peak`, `eps`, and `noise_removal`, `tempering`, `vocab_size`); the flags override the first two. The sampler
decodes the whole continuation at once: `dllm_block_size` is not read. On stderr it names the `dllm-flow generate`
command, every setting spelled out, that prints the same tokens. A time-conditioned model (`dllm_time_conditioning` in
config.json) also reads the noise level through a time embedding that transformers does not know: it leaves those
weights out when it loads the model (and says so), this program reads them from the weight files itself.
"""

import json
import math
from pathlib import Path

import torch
from common import denoiser_logits, main
from transformers.modeling_utils import load_state_dict

TIME_EMBEDDING = "dllm_time_embedding."  # the time embedding's weights: <prefix>mlp.{0,2}.{weight,bias}


def noise_schedule(t, options):
    """The masses of SCDD's channels at time t (float64 [1]): `clean` (the token itself), `uniform` (a random
    token), `absorbed` ([MASK]) and `gamma` = clean + uniform, under a beta-shaped uniform bump that peaks at
    `uniform_ratio` (dllm-flow's docs/strategies.md §5.8). Computed in the order dllm-flow computes them: the
    sampler compares them with random draws, so the last bit matters."""
    ratio, shape, peak = options["uniform_ratio"], options["schedule_shape"], options["schedule_peak"]
    t = t.clamp(0, 1)
    a, b = shape * peak, shape * (1 - peak)
    top = peak**a * (1 - peak) ** b
    bump = (ratio / (1 - ratio)) / top * t.pow(a) * (1 - t).pow(b)
    clean = (1 - t) / (1 + bump)
    uniform = bump / (1 + bump)
    masses = {"clean": clean, "uniform": uniform, "absorbed": 1 - clean - uniform, "gamma": clean + uniform}
    return {name: float(mass) for name, mass in masses.items()}


def read_time_embedding(folder):
    """The time embedding's weights ({"mlp.0.weight": ..., ...}) from the folder's safetensors files, read with
    transformers' own safetensors loader."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = {f for k, f in json.loads(index.read_text())["weight_map"].items() if TIME_EMBEDDING in k}
    else:
        files = {"model.safetensors"}
    weights = {}
    for name in sorted(files):
        state = load_state_dict(str(folder / name))
        weights.update({k.split(TIME_EMBEDDING, 1)[1]: v for k, v in state.items() if TIME_EMBEDDING in k})
    if not weights:
        raise SystemExit(f"{folder}: config.json says dllm_time_conditioning but no {TIME_EMBEDDING}* weights")
    return weights


def time_vector(weights, t):
    """dllm-flow's time embedding of the rows' times t (float32 [1]) → [1, hidden]: sinusoidal features of
    1000·t, then Linear → SiLU → Linear."""
    w0, b0, w2, b2 = (weights[f"mlp.{i}.{p}"].to(t.device) for i in (0, 2) for p in ("weight", "bias"))
    half = w0.shape[1] // 2
    freqs = torch.exp(-math.log(10_000.0) * torch.arange(half, dtype=torch.float32) / half)
    angles = (1000.0 * t.float())[:, None] * freqs.to(t.device, w0.dtype)[None, :]  # dllm-flow keeps them in w0's dtype
    features = torch.cat([angles.cos(), angles.sin()], dim=-1).to(w0.dtype)
    hidden = torch.nn.functional.silu(torch.nn.functional.linear(features, w0, b0))
    return torch.nn.functional.linear(hidden, w2, b2)


def denoise(model, x, t, settings, time_weights):
    """float32 logits [1, T, V] at noise level t with the [MASK] column at -inf (p lives on the other tokens); a
    time-conditioned model gets the time embedding added to every token embedding."""
    if time_weights is None:
        logits = denoiser_logits(model, x, settings)
    else:
        embeds = model.get_input_embeddings()(x)
        time = time_vector(time_weights, torch.full((1,), t, dtype=torch.float32, device=x.device))
        logits = denoiser_logits(model, x, settings, embeds=embeds + time.to(embeds.dtype)[:, None, :])
    logits = logits.float().clone()
    logits[..., settings["mask_token_id"]] = -math.inf
    return logits


def ancestral_step(logits, x, now, then, k, settings, window, generator):
    """One step from time t (masses `now`) to s < t (`then`), `tempering: draws`, temperature 0. Whether a position
    moves comes from the exact posterior under the model's p: a [MASK] is revealed with probability
    1 - absorbed_s/absorbed_t, a visible token c revised with Υ/K·(clean_s·(1 - p(c)) + uniform_s·(K-1)/K) over
    uniform_t/K + clean_t·p(c), Υ = γ_t/γ_s - clean_t/clean_s; where to is the argmax of p over the other tokens.
    `dllm_remasking: low_confidence` (the default) reveals instead the most probable proposals at [MASK]s, as many
    as the posterior reveals on average (rounded up or down at random); `random` keeps the posterior's draws."""
    mask_id = settings["mask_token_id"]
    p = torch.softmax(logits.double(), dim=-1)
    is_mask = x == mask_id
    p_here = p.gather(-1, x[..., None])[..., 0]  # 0 at a [MASK]
    ups = now["gamma"] / then["gamma"] - now["clean"] / then["clean"]
    revise = (ups / k) * (then["clean"] * (1 - p_here) + then["uniform"] * (k - 1) / k)
    revise = revise / (now["uniform"] / k + now["clean"] * p_here).clamp_min(1e-300)
    reveal = 1 - then["absorbed"] / max(now["absorbed"], 1e-300)
    moves = torch.where(is_mask, torch.full_like(revise, reveal), revise).clamp(0, 1)
    u = torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float64)
    dest = logits.scatter(-1, x[..., None], -math.inf).argmax(-1)  # never the token already there
    if settings["dllm_remasking"] == "random":
        return torch.where(u < moves, dest, x)
    candidates = is_mask & window
    expected = candidates.sum(dim=1).double() * reveal
    count = torch.floor(
        expected + torch.rand(expected.shape, generator=generator, device=x.device, dtype=torch.float64)
    )
    confidence = torch.where(candidates, p.gather(-1, dest[..., None])[..., 0], -math.inf)
    order = torch.argsort(confidence[0], descending=True, stable=True)  # ties: leftmost first
    chosen = torch.zeros_like(candidates)
    chosen[0, order[: min(int(count[0]), int(candidates.sum()))]] = True
    return torch.where((chosen & candidates) | (~is_mask & (u < moves)), dest, x)


def weighted_step(logits, x, now, then, k, settings, generator):
    """One step with `tempering: weights` at temperature 0: p is one-hot on the argmax, and each position is drawn
    from the exact posterior's weights under that p (a [MASK] stays with absorbed_s/absorbed_t)."""
    mask_id = settings["mask_token_id"]
    p = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).double()
    here = x[..., None]
    p_here = p.gather(-1, here)
    c = now["clean"] / then["clean"]
    ups = now["gamma"] / then["gamma"] - c
    visible = (then["clean"] * ups / k) * p + then["uniform"] * ups / k**2
    visible.scatter_add_(-1, here, then["clean"] * c * p_here + c * then["uniform"] / k)
    visible[..., mask_id] = 0
    visible = visible / (now["uniform"] / k + now["clean"] * p_here).clamp_min(1e-300)
    masked = (
        (1 - now["gamma"] / then["gamma"]) / max(now["absorbed"], 1e-300) * (then["uniform"] / k + then["clean"] * p)
    )
    masked[..., mask_id] = then["absorbed"] / max(now["absorbed"], 1e-300)
    weights = torch.where((x == mask_id)[..., None], masked, visible).clamp_min(0).reshape(-1, p.shape[-1])
    alive = weights.sum(-1) > 0
    drawn = x.reshape(-1).clone()
    if alive.any():
        drawn[alive] = torch.multinomial(weights[alive], 1, generator=generator).squeeze(-1)
    return drawn.view_as(x)


def remove_noise(logits, x, at, k, settings):
    """The final pass at t = eps. `noise_removal: posterior`: the most probable clean token given the canvas,
    argmax_v p(v)·q(z = c | x = v): at a [MASK] the argmax of p, at a visible c the weight clean + uniform/K for
    v = c against uniform/K for any other v. `argmax`: the argmax of p everywhere."""
    if settings["dllm_options"]["noise_removal"] == "argmax":
        return logits.argmax(-1)
    log_p = torch.log_softmax(logits.double(), dim=-1)
    other = math.log(max(at["uniform"] / k, 1e-300))
    own = math.log(max(at["clean"] + at["uniform"] / k, 1e-300))
    visible = (x != settings["mask_token_id"])[..., None].double()
    return (log_p + other * visible).scatter_add(-1, x[..., None], (own - other) * visible).argmax(-1)


def sample(model, prompt, settings, generator):
    """The generated ids: the prompt then `max_new_tokens` [MASK]s, `dllm_steps` ancestral steps from t = 1 down to
    eps, then the noise-removal pass; prompt positions never change."""
    options = settings["dllm_options"]
    if options["tempering"] not in ("draws", "weights") or settings["dllm_remasking"] not in (
        "low_confidence",
        "random",
    ):
        raise SystemExit("this program samples with tempering draws or weights, remasking low_confidence or random")
    k = (options.get("vocab_size") or model.config.vocab_size) - 1  # the tokens other than [MASK]
    start, steps = len(prompt), settings["dllm_steps"]
    x = torch.tensor([prompt + [settings["mask_token_id"]] * settings["max_new_tokens"]], device=generator.device)
    window = torch.zeros_like(x, dtype=torch.bool)
    window[0, start:] = True
    time_weights = read_time_embedding(settings["folder"]) if settings["dllm_time_conditioning"] else None
    times = torch.linspace(1.0, options["eps"], steps + 1, dtype=torch.float64)
    for i in range(steps):
        now, then = noise_schedule(times[i : i + 1], options), noise_schedule(times[i + 1 : i + 2], options)
        logits = denoise(model, x, float(times[i]), settings, time_weights)
        if options["tempering"] == "draws":
            new = ancestral_step(logits, x, now, then, k, settings, window, generator)
        else:
            new = weighted_step(logits, x, now, then, k, settings, generator)
        x = torch.where(window, new, x)
    last = denoise(model, x, float(times[-1]), settings, time_weights)
    x = torch.where(window, remove_noise(last, x, noise_schedule(times[-1:], options), k, settings), x)
    return x[0, start:].tolist()


if __name__ == "__main__":
    main(sample)
