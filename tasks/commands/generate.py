"""`dllm-flow generate`: load any dllm-flow checkpoint (a directory or `models:/NAME@ALIAS` from the
MLflow registry), rebuild its strategy from the checkpoint's own record, and stream text.

Samplers (`--sampler`): `auto` runs the strategy's own; the others are accepted where the strategy's
registration lists them (`DLLMStrategy.samplers`); `strategies.registry.SAMPLERS`, derived from the
registrations, says what each one does and which settings it reads (`settings_line` echoes only those).
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import mlflow
import torch

from dllm_common.checkpoint import read_meta
from dllm_common.config import EvalConfig, context_overflow
from dllm_common.config.dflash import tree_branches_problem
from dllm_common.tracking import check_tracking_server, default_tracking_uri, quiet_environment
from strategies import strategy_class
from strategies.absorbing import infill_sample
from strategies.base_evaluation import SampleRequest
from strategies.dflash.decoding import check_threshold, speculative_generate
from strategies.dflash.options import SPECULATIVE
from strategies.dflash.tree import DraftTree
from strategies.registry import SAMPLERS
from strategies.sampling import SamplerConfig, trim_at_eos
from tasks.evaluation.likelihood import encode_prompts
from tasks.evaluation.trained_model import Loaded, load_trained_model

INFILL_SPAN = 20  # each [MASK] in an --infill prompt becomes this many mask tokens


@dataclass
class Generated:
    text: str
    nfe: float
    tokens: int
    seconds: float


def resolve_checkpoint(
    ref: str, workdir: Path, tracking_uri: str | None = None, scratch: Path | None = None, flag: str = "--checkpoint"
) -> Path:
    """A checkpoint directory from a path (a checkpoint, or a train store entry holding `model/`) or an
    MLflow model URI (`models:/NAME@ALIAS`, `models:/NAME/VERSION`, `runs:/ID/model`); errors name `flag`."""
    if ref.startswith(("models:/", "runs:/")):
        quiet_environment()
        check_tracking_server(tracking_uri, "--tracking-uri")
        uri = tracking_uri or default_tracking_uri(workdir)
        mlflow.set_tracking_uri(uri)
        mlflow.set_registry_uri(uri)
        dest = scratch or Path(tempfile.mkdtemp(prefix="dllm-generate-"))
        try:
            local = mlflow.artifacts.download_artifacts(artifact_uri=ref, dst_path=str(dest))
        except Exception as exc:  # MlflowException for an unknown name/alias/version
            raise FileNotFoundError(
                f"{flag} {ref}: not found in the MLflow registry at {uri} ({exc}); "
                "check the name and alias (dllm-flow registers <pipeline>-<strategy> with alias "
                "'latest'), or pass --workdir / --tracking-uri"
            ) from None
        ref = local
    path = Path(ref)
    if not path.exists():
        raise FileNotFoundError(
            f"{flag} {ref}: the path does not exist; give a checkpoint directory (a train run's model/ "
            "folder or an exported one) or a models:/NAME@ALIAS URI"
        )
    for candidate in (path, path / "model"):
        has_config = (candidate / "config.json").is_file() or (candidate / "dflash_draft.json").is_file()
        if has_config and (candidate / "dllm.json").is_file():
            return candidate
    raise FileNotFoundError(
        f"{flag} {ref}: not a dllm-flow checkpoint (expected config.json and dllm.json "
        "in it or in its model/ folder), nor a models:/NAME@ALIAS URI"
    )


def check_sampler(strategy_name: str, sampler: str, infill: bool) -> str:
    """The sampler `--sampler` names (`auto`: the strategy's own), refused where it does not fit."""
    fits = strategy_class(strategy_name).samplers
    chosen = fits[0] if sampler == "auto" else sampler
    if chosen not in fits:
        raise ValueError(
            f"--sampler {sampler} does not fit a {strategy_name} checkpoint; use one of: auto, {', '.join(fits)}"
        )
    if infill and not SAMPLERS[chosen].infills:
        infilling = [name for name, info in SAMPLERS.items() if info.infills]
        raise ValueError(
            f"--infill needs a [MASK]-filling sampler ({', '.join(infilling)}); the {chosen} sampler cannot infill"
        )
    return chosen


def default_temperature(sampler: str) -> float:
    """The sampler's own default, else evaluation's open-ended one (docs/strategies.md §11.7)."""
    own = SAMPLERS[sampler].default_temperature
    return EvalConfig().temperature if own is None else own


def default_top_p(temperature: float) -> float:
    """Evaluation's nucleus when sampling; irrelevant (1.0) at temperature 0."""
    return EvalConfig().top_p if temperature > 0 else 1.0


def settings_line(sampler: str, config: SamplerConfig, seed: int) -> str:
    """The settings `dllm-flow generate` echoes before it decodes: only those the sampler reads (its
    `SamplerInfo.decoding` and `.settings`), so a setting it ignores is not shown as if it applied (no cache for
    a sampler that caches nothing, no steps or cuts for the speculative decoder); the sampler and seed always."""
    info = SAMPLERS[sampler]
    shown = {
        "steps": ("steps" in info.decoding, config.steps),
        "temperature": ("temperature" in info.settings, config.temperature),
        "top-p": ("top_p" in info.settings, config.top_p),
        "top-k": ("top_k" in info.settings, config.top_k),
        "cache": ("cache" in info.decoding, config.cache),
        "tree-branches": (config.tree_branches > 0, config.tree_branches),  # speculative only (check_request)
        "confidence-threshold": (config.confidence_threshold > 0, config.confidence_threshold),
        "confidence-rule": (config.confidence_threshold > 0, config.confidence_rule),
    }
    return ", ".join([f"sampler {sampler}", *(f"{k} {v}" for k, (read, v) in shown.items() if read), f"seed {seed}"])


@dataclass(frozen=True)
class Request:
    """One prompt to continue (or, with `infill`, whose [MASK] spans to fill) with a sampler."""

    prompt: str
    sampler: str
    config: SamplerConfig
    seed: int = 0
    chat: bool = False
    infill: bool = False
    redraft: torch.nn.Module | None = None  # the tree's second draft (`--redraft`, docs/strategies.md §10.16)


def check_request(loaded: Loaded, request: Request) -> list[int]:
    """The ids the request decodes from (the prompt's, or with `infill` the prompt with its [MASK] spans),
    refused before any decoding where they are empty or, with the `--max-new-tokens` continuation, do not fit
    the model's context. Cheap (tokenization only): `dllm-flow generate` calls it before echoing the prompt."""
    if request.infill:
        ids = _infill_ids(loaded, request.prompt)
        new = 0
    else:
        ids = encode_prompts(loaded.tokenizer, [request.prompt], request.chat)[0]
        new = request.config.max_new_tokens
    if not ids:
        raise ValueError("--prompt is empty after tokenization; give some text")
    check_speculative_flags(request.sampler, request.config, request.redraft is not None)
    check_tree_branches(loaded.model, request.config.tree_branches)
    if request.config.tree_branches:  # the second draft must read what the first reads (refused before any decoding)
        speculation_tree(request).check(loaded.model.config, request.config.temperature)
    if request.config.confidence_threshold:  # a DSpark draft's confidence head cuts the blocks (§10.17)
        config = request.config
        check_threshold(
            loaded.model.config, config.confidence_threshold, speculation_tree(request), config.confidence_rule
        )
    context = model_context(loaded.model)
    if context is None:
        return ids
    spans = f" with its [MASK] spans ({INFILL_SPAN} tokens each)" if request.infill else ""
    problem = context_overflow(len(ids), new, context, spans=spans)
    if problem:
        raise ValueError(problem)
    return ids


def check_speculative_flags(sampler: str, config: SamplerConfig, redraft: bool) -> None:
    """Refuse a flag only the speculative sampler reads given for another sampler, and `--redraft` (`redraft`:
    given) without tree branches to re-draft."""
    readers = [name for name, info in SAMPLERS.items() if "lookup_ngram" in info.settings]  # the speculative one
    for flag, given in (
        ("--lookup-ngram", config.lookup_ngram),
        ("--sampled-proposals", config.sampled_proposals),
        ("--tree-branches", config.tree_branches),
        ("--confidence-threshold", config.confidence_threshold),
        ("--redraft", redraft),
    ):
        if given and sampler not in readers:
            raise ValueError(
                f"{flag} applies to the {', '.join(readers)} sampler; this checkpoint decodes with {sampler!r}: "
                "drop the flag"
            )
    if redraft and not config.tree_branches:
        raise ValueError("--redraft re-drafts tree branches: give --tree-branches K (K > 0) too, or drop --redraft")


def check_tree_branches(draft, branches: int) -> None:
    """Refuse `--tree-branches` past the bound of `dflash.eval_tree_branches` or the positions the draft's block
    proposes (`tree_branches_problem`, docs/strategies.md §10.16); a model without a block size (not a draft) is held
    to the first only."""
    size = getattr(getattr(draft, "config", None), "block_size", None)
    problem = tree_branches_problem(branches, size if isinstance(size, int) else None, "--tree-branches", "the draft's")
    if problem:
        raise ValueError(problem)


def model_context(model) -> int | None:
    """The positions a model was built for (`max_position_embeddings`; a tiny model's is `data.seq_len`), or None
    where its config does not say."""
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return context if isinstance(context, int) and not isinstance(context, bool) else None


def generate(loaded: Loaded, request: Request, device: str, stream=None) -> Generated:
    """One prompt: sample, calling `stream(new_text)` as blocks finish; returns the text and its cost."""
    prompt_ids = check_request(loaded, request)
    config = dataclasses.replace(request.config, logit_shift=loaded.strategy.logit_shift)
    request = dataclasses.replace(request, config=config)
    gen = torch.Generator(device=device).manual_seed(request.seed)
    if request.infill:
        return _infill(loaded, request, prompt_ids, gen, device, stream)
    if request.sampler == SPECULATIVE:
        return _speculative(loaded, prompt_ids, config, stream, request.seed, speculation_tree(request))
    return _denoise(loaded, request, prompt_ids, gen, device, stream)


def _emit(stream, text: str) -> None:
    if stream:
        stream(text)


def _infill_ids(loaded: Loaded, prompt: str) -> list[int]:
    """Each [MASK] of the prompt becomes `INFILL_SPAN` mask tokens."""
    pieces = prompt.split("[MASK]")
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        ids += loaded.tokenizer(piece, add_special_tokens=False)["input_ids"] if piece else []
        if i < len(pieces) - 1:
            ids += [loaded.mask_id] * INFILL_SPAN
    return ids


def _infill(loaded: Loaded, request: Request, ids: list[int], gen, device: str, stream) -> Generated:
    """The prompt's [MASK] spans (`_infill_ids`) filled by the absorbing sampler."""
    tokenizer, mask_id = loaded.tokenizer, loaded.mask_id
    t0 = time.perf_counter()
    res = infill_sample(
        loaded.strategy.denoiser(loaded.model),
        [ids],
        mask_token_id=mask_id,
        pad_token_id=tokenizer.pad_token_id or 0,
        config=request.config,
        generator=gen,
        device=device,
    )
    seconds = time.perf_counter() - t0
    text = tokenizer.decode(res.tokens[0].tolist())
    _emit(stream, text)
    return Generated(text, res.nfe, ids.count(mask_id), seconds)


def load_redraft(ref: str, loaded: Loaded, sampler: str, config: SamplerConfig, workdir: Path, tracking_uri, device):
    """The tree's second draft (`--redraft`): refused before it is loaded unless the speculative sampler verifies tree
    branches (`check_speculative_flags`), refused unless it is a DFlash draft for the same target (the weights'
    digest), loaded with a warning when it was not trained with `loss_type: variable_prefix` (such a draft re-drafts
    no better than the marginal tree, docs/strategies.md §10.16). Its shape against the first draft is checked by
    `check_request`."""
    check_speculative_flags(sampler, config, redraft=True)
    check_tree_branches(loaded.model, config.tree_branches)  # before the second draft loads
    ckpt = resolve_checkpoint(ref, workdir, tracking_uri, flag="--redraft")
    meta = read_meta(ckpt)
    if not trains_a_draft(meta.get("strategy")):
        raise ValueError(f"--redraft {ref}: a {meta.get('strategy')} checkpoint; give a DFlash draft's")
    ours, theirs = loaded.meta["target"], meta.get("target", {})
    if ours.get("weights_digest") != theirs.get("weights_digest"):
        raise ValueError(
            f"--redraft {ref}: a draft for the target at {theirs.get('path')}, not for --checkpoint's target at "
            f"{ours.get('path')} (their weights differ); give a draft trained for the same target"
        )
    loss = meta.get("options", {}).get("loss_type")
    if loss != "variable_prefix":
        print(
            f"[dllm-flow] warning: --redraft {ref} was trained with dflash.loss_type {loss}, not variable_prefix: a "
            "draft never shown a prefix re-drafts no better than the marginal tree (docs/strategies.md §10.16)",
            file=sys.stderr,
        )
    return load_trained_model(ckpt, device, where="--redraft")


def trains_a_draft(strategy: str | None) -> bool:
    """Whether checkpoints of `strategy` are drafts trained against a frozen target (its class's `trains`); an
    unknown or missing strategy name is not."""
    try:
        return strategy_class(strategy).trains == "draft"
    except (TypeError, ValueError):
        return False


def speculation_tree(request: Request) -> DraftTree | None:
    """The tree the speculative decoder verifies (`--tree-branches`, `--redraft`), or None for one path."""
    return DraftTree(request.config.tree_branches, request.redraft) if request.config.tree_branches else None


def _speculative(loaded: Loaded, prompt_ids: list[int], config: SamplerConfig, stream, seed: int, tree) -> Generated:
    """The draft proposes, the frozen target verifies: the target's own text (greedy, or sampled at the
    temperature) in fewer target forwards."""
    t0 = time.perf_counter()
    res = speculative_generate(
        loaded.strategy.target,
        loaded.model,
        prompt_ids,
        config.max_new_tokens,
        loaded.tokenizer.eos_token_id,
        temperature=config.temperature,
        generator=torch.Generator().manual_seed(seed),  # the rejection step draws on the CPU
        lookup_ngram=config.lookup_ngram,
        sampled_proposals=config.sampled_proposals,
        tree=tree,
        confidence_threshold=config.confidence_threshold,
        confidence_rule=config.confidence_rule,
    )
    seconds = time.perf_counter() - t0
    text = loaded.tokenizer.decode(res.tokens)
    _emit(stream, text)
    return Generated(text, res.target_forwards, len(res.tokens), seconds)


def _denoise(loaded: Loaded, request: Request, prompt_ids: list[int], gen, device: str, stream) -> Generated:
    """A denoising sampler over the continuation, streaming each finished block's new text."""
    tokenizer, mask_id, eos = loaded.tokenizer, loaded.mask_id, loaded.tokenizer.eos_token_id
    shown = [""]

    def on_block(canvas):
        row = canvas[0, len(prompt_ids) :].tolist()
        if mask_id in row:
            row = row[: row.index(mask_id)]
        text = tokenizer.decode(trim_at_eos(torch.tensor(row), eos))
        if stream and text.startswith(shown[0]) and len(text) > len(shown[0]):
            stream(text[len(shown[0]) :])
            shown[0] = text

    # `config.sampler` names the sampler (`check_sampler`): the strategy's own, or the absorbing one over its denoiser
    config = dataclasses.replace(request.config, eos_token_id=eos, sampler=request.sampler)
    sample = SampleRequest([prompt_ids], mask_id, tokenizer.pad_token_id or 0, config, gen, device, on_block)
    t0 = time.perf_counter()
    res = loaded.strategy.sample(loaded.model, sample)
    seconds = time.perf_counter() - t0
    ids = trim_at_eos(res.generated(0), eos)
    text = tokenizer.decode(ids)
    if stream and text != shown[0]:
        stream(text[len(shown[0]) :] if text.startswith(shown[0]) else "\n" + text)
    return Generated(text, res.nfe, len(ids), seconds)
