"""`dllm-flow generate`: load any dllm-flow checkpoint (a directory or `models:/NAME@ALIAS` from the
MLflow registry), rebuild its strategy from the checkpoint's own record, and stream text.

Samplers (`--sampler`): `auto` runs the strategy's own; the others are accepted where they fit:
  llada   absorbing [MASK] sampler (mdlm; also scdd and the hybrid's diffusion branch)
  idlm    absorbing sampler with logit shift 1 (idlm)
  scdd    ancestral posterior sampler with the final noise-removal pass (scdd)
  hybrid  blocks seeded by the causal branch, completed by diffusion (hybrid)
  canvas  uniform-noise canvas decoding (block_diffusion)
  speculative  DFlash: the draft proposes a block, the frozen target verifies it (dflash); the text is
          the target's own greedy decoding, produced in fewer target forwards
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SAMPLERS = {  # strategy → samplers that fit it, its own first
    "mdlm": ("llada",),
    "scdd": ("scdd", "llada"),
    "idlm": ("idlm",),
    "hybrid": ("hybrid", "llada"),
    "block_diffusion": ("canvas",),
    "dflash": ("speculative",),
}
INFILL_SAMPLERS = ("llada", "idlm")
INFILL_SPAN = 20  # each [MASK] in an --infill prompt becomes this many mask tokens


@dataclass
class Generated:
    text: str
    nfe: float
    tokens: int
    seconds: float


def resolve_checkpoint(ref: str, workdir: Path, tracking_uri: str | None = None, scratch: Path | None = None) -> Path:
    """A checkpoint directory from a path (a checkpoint, or a train store entry holding `model/`) or an
    MLflow model URI (`models:/NAME@ALIAS`, `models:/NAME/VERSION`, `runs:/ID/model`)."""
    if ref.startswith(("models:/", "runs:/")):
        import mlflow

        from dllm_common.tracking import default_tracking_uri, quiet_environment

        quiet_environment()
        uri = tracking_uri or default_tracking_uri(workdir)
        mlflow.set_tracking_uri(uri)
        mlflow.set_registry_uri(uri)
        dest = scratch or Path(tempfile.mkdtemp(prefix="dllm-generate-"))
        try:
            local = mlflow.artifacts.download_artifacts(artifact_uri=ref, dst_path=str(dest))
        except Exception as exc:  # MlflowException for an unknown name/alias/version
            raise FileNotFoundError(
                f"--checkpoint {ref}: not found in the MLflow registry at {uri} ({exc}); "
                "check the name and alias (dllm-flow registers <pipeline>-<strategy> with alias "
                "'latest'), or pass --workdir / --tracking-uri"
            ) from None
        ref = local
    path = Path(ref)
    for candidate in (path, path / "model"):
        has_config = (candidate / "config.json").is_file() or (candidate / "dflash_draft.json").is_file()
        if has_config and (candidate / "dllm.json").is_file():
            return candidate
    raise FileNotFoundError(
        f"--checkpoint {ref}: not a dllm-flow checkpoint (expected config.json and dllm.json "
        "in it or in its model/ folder), nor a models:/NAME@ALIAS URI"
    )


def load_for_generation(ckpt: Path, device: str, adapter: str | None = None):
    """(model, tokenizer, strategy, mask id, meta) — the strategy rebuilt from the checkpoint's record."""
    from dllm_common.checkpoint import read_meta
    from dllm_common.config import DLLMConfig
    from strategies.models import apply_adapter
    from tasks.evaluate import _load_model
    from tasks.prepare_data import load_tokenizer
    from tasks.train import prepare_strategy_with

    meta = read_meta(ckpt)
    model = _load_model(ckpt, device)
    if adapter:
        apply_adapter(model, adapter)
    tokenizer = load_tokenizer(str(ckpt))
    dllm = DLLMConfig(**{**meta.get("dllm", {}), "mode": meta["strategy"]})
    options = extras = None
    if meta["strategy"] == "dflash":  # the draft decodes for the frozen target its checkpoint names
        from tasks.target import load_target

        options = meta["dflash"]
        extras = {
            "target": load_target(
                meta["target"]["path"], options["target_torch_dtype"], device, options["target_trust_remote_code"]
            )
        }
    strategy, _, mask_id = prepare_strategy_with(
        meta["strategy"], dllm, model, tokenizer, meta["mask_token_id"], options=options, extras=extras
    )
    return model, tokenizer, strategy, mask_id, meta


def check_sampler(strategy_name: str, sampler: str, infill: bool) -> str:
    fits = SAMPLERS.get(strategy_name, ("llada",))
    chosen = fits[0] if sampler == "auto" else sampler
    if chosen not in fits:
        raise ValueError(
            f"--sampler {sampler} does not fit a {strategy_name} checkpoint; use one of: auto, {', '.join(fits)}"
        )
    if infill and chosen not in INFILL_SAMPLERS:
        raise ValueError(
            f"--infill needs a [MASK]-filling sampler ({', '.join(INFILL_SAMPLERS)}); "
            f"the {chosen} sampler cannot infill"
        )
    return chosen


def generate(
    model,
    tokenizer,
    strategy,
    mask_id: int,
    prompt: str,
    sampler: str,
    config,
    *,
    seed: int,
    device: str,
    chat: bool,
    infill: bool = False,
    stream=None,
) -> Generated:
    """One prompt: sample, calling `stream(new_text)` as blocks finish; returns the text and its cost."""
    import torch

    from strategies.sampling import absorbing_sample, infill_sample, trim_at_eos
    from tasks.evaluate import encode_prompts

    gen = torch.Generator(device=device).manual_seed(seed)
    eos = tokenizer.eos_token_id
    if sampler == "idlm":
        config = dataclasses.replace(config, logit_shift=1)
    if infill:
        pieces = prompt.split("[MASK]")
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            ids += tokenizer(piece, add_special_tokens=False)["input_ids"] if piece else []
            if i < len(pieces) - 1:
                ids += [mask_id] * INFILL_SPAN
        t0 = time.perf_counter()
        res = infill_sample(
            strategy.denoiser(model),
            [ids],
            mask_token_id=mask_id,
            pad_token_id=tokenizer.pad_token_id or 0,
            config=config,
            generator=gen,
            device=device,
        )
        seconds = time.perf_counter() - t0
        text = tokenizer.decode(res.tokens[0].tolist())
        if stream:
            stream(text)
        return Generated(text, res.nfe, ids.count(mask_id), seconds)
    prompt_ids = encode_prompts(tokenizer, [prompt], chat)[0]
    if not prompt_ids:
        raise ValueError("--prompt is empty after tokenization; give some text")
    if sampler == "speculative":
        from strategies.dflash import speculative_generate

        t0 = time.perf_counter()
        res = speculative_generate(strategy.target, model, prompt_ids, config.max_new_tokens, eos)
        seconds = time.perf_counter() - t0
        text = tokenizer.decode(res.tokens)
        if stream:
            stream(text)
        return Generated(text, res.target_forwards, len(res.tokens), seconds)
    shown = [""]

    def on_block(canvas):
        row = canvas[0, len(prompt_ids) :].tolist()
        if mask_id in row:
            row = row[: row.index(mask_id)]
        text = tokenizer.decode(trim_at_eos(torch.tensor(row), eos))
        if stream and text.startswith(shown[0]) and len(text) > len(shown[0]):
            stream(text[len(shown[0]) :])
            shown[0] = text

    config = dataclasses.replace(config, eos_token_id=eos)
    t0 = time.perf_counter()
    kwargs = dict(
        mask_token_id=mask_id,
        pad_token_id=tokenizer.pad_token_id or 0,
        config=config,
        generator=gen,
        device=device,
        on_block=on_block,
    )
    if sampler in ("llada", "idlm"):
        res = absorbing_sample(strategy.denoiser(model), [prompt_ids], **kwargs)
    else:
        res = strategy.sample(model, [prompt_ids], **kwargs)
    seconds = time.perf_counter() - t0
    ids = trim_at_eos(res.generated(0), eos)
    text = tokenizer.decode(ids)
    if stream and text != shown[0]:
        stream(text[len(shown[0]) :] if text.startswith(shown[0]) else "\n" + text)
    return Generated(text, res.nfe, len(ids), seconds)
