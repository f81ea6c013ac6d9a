"""lm-evaluation-harness adapter: any dllm-flow checkpoint as the harness model `dllm-flow`
(docs/evaluation.md §4.10). Needs the `lmeval` extra (`pip install 'dllm-flow[lmeval]'`).

Every request goes through what the strategy declares: `loglikelihood` through its exact causal path
("ar_nll": hybrid, idlm; a DFlash draft's frozen target) or else a Monte-Carlo ELBO over its `nelbo_rows`
with only the continuation masked; `loglikelihood_rolling` through the same estimator after the BOS (or
EOS) token; `generate_until` through its own sampler. Texts longer than the checkpoint's `seq_len` are
scored in left-truncated pieces whose log-likelihoods add up.

From Python: `simple_evaluate(model=DLLMFlowLM(checkpoint=DIR), ...)`, or `DLLMFlowLM(loaded=...)` with a
`tasks.commands.generate.Loaded`. From a shell, the harness CLI with the model registered:
`python -m tasks.evaluation.lm_eval_model run --model dllm-flow --model_args checkpoint=DIR,mc_samples=16 --tasks ...`.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lm_eval import simple_evaluate
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import handle_non_serializable

from dllm_common.config import LMEvalConfig
from dllm_common.harness_tasks import task_manager
from strategies import speculative_generate
from strategies.base_evaluation import SampleRequest
from strategies.losses import causal_nll_rows
from strategies.sampling import SamplerConfig, trim_at_eos
from strategies.seeding import seeded_generator
from tasks.evaluation.trained_model import Loaded, load_for_generation

NELBO, EXACT = "nelbo", "ar_nll"  # the names of `DLLMStrategy.likelihoods`


Checkpoint = Loaded  # what the harness model runs on: a checkpoint with its strategy rebuilt


def load_checkpoint(path: str | Path, device: str) -> Loaded:
    """A checkpoint directory (or a train store entry holding `model/`), its strategy rebuilt from its record."""
    ckpt = Path(path)
    if not (ckpt / "dllm.json").is_file() and (ckpt / "model" / "dllm.json").is_file():
        ckpt = ckpt / "model"
    return load_for_generation(ckpt, device)


def pieces(context: list[int], continuation: list[int], max_length: int) -> list[tuple[list[int], list[int]]]:
    """`continuation` cut into (text before, piece) pairs that fit `max_length` tokens with at least one
    token before each piece; each piece keeps as much of the text before it as fits."""
    out, start = [], 0
    while start < len(continuation):
        piece = continuation[start : start + max_length - 1]
        out.append(((context + continuation[:start])[-(max_length - len(piece)) :], piece))
        start += len(piece)
    return out


def request_seed(seed: int, context: list[int]) -> int:
    """The noise seed of a request: a function of the seed and its context alone, so every continuation of
    one context sees the same stratified times (common random numbers across multiple-choice answers)."""
    digest = hashlib.sha256(json.dumps(context).encode()).digest()
    return (seed * 1_000_003 + int.from_bytes(digest[:7], "big")) % 2**63


@dataclass(frozen=True)
class HarnessSettings:
    """The `dllm-flow` model arguments besides the checkpoint and device (docs/evaluation.md §4.10)."""

    mc_samples: int = 32  # Monte-Carlo ELBO samples per request
    batch_size: int = 8  # rows per forward
    seed: int = 1234
    likelihood: str = "auto"  # "auto" (exact where the strategy has it, else the ELBO), "nelbo" or "ar_nll"
    block_size: int = 32  # generation: the sampler's block size
    tokens_per_step: float = 1.0  # generation: steps = ⌈new tokens / tokens_per_step⌉
    threshold: float | None = None  # generation: confidence-threshold decoding
    max_length: int | None = None  # None: the checkpoint's seq_len
    max_gen_toks: int = 256  # generation length when a task does not say

    @classmethod
    def of(cls, args: dict) -> HarnessSettings:
        """From the harness's model arguments (`batch_size="auto"` keeps the default; `max_batch_size`,
        which the harness always passes, is not used: batches here have a fixed size)."""
        args = {k: v for k, v in args.items() if k != "max_batch_size"}
        if "batch_size" in args:
            args["batch_size"] = int(args["batch_size"]) if str(args["batch_size"]).isdigit() else cls.batch_size
        return cls(**args)


@register_model("dllm-flow")
class DLLMFlowLM(LM):
    """A dllm-flow checkpoint as an lm-evaluation-harness model (docs/evaluation.md §4.10): built from
    `checkpoint=` (a directory) or `loaded=` (a `tasks.evaluation.trained_model.Loaded`), with the
    `HarnessSettings` as keyword arguments."""

    def __init__(self, checkpoint: str | None = None, loaded: Any = None, device: str | None = None, **settings):
        super().__init__()
        if (checkpoint is None) == (loaded is None):
            raise ValueError("DLLMFlowLM needs exactly one of checkpoint= (a directory) or loaded=")
        self.settings = HarnessSettings.of(settings)
        if loaded is None:
            loaded = load_checkpoint(checkpoint, device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model, self.tokenizer, self.strategy = loaded.model, loaded.tokenizer, loaded.strategy
        self.mask_id, meta = None if loaded.mask_id is None else int(loaded.mask_id), dict(loaded.meta)
        self._device = torch.device(device) if device else next(self.model.parameters()).device
        self.max_length = int(
            self.settings.max_length or meta.get("seq_len") or self.model.config.max_position_embeddings
        )
        self.likelihood = self._choose_likelihood(self.settings.likelihood)
        self.prefix_token_id = next(
            t
            for t in (self.tokenizer.bos_token_id, self.tokenizer.eos_token_id, self.tokenizer.pad_token_id, 0)
            if t is not None
        )
        self._causal_path_checked = False

    def _choose_likelihood(self, wanted: str) -> str:
        has = tuple(self.strategy.likelihoods)
        chosen = (EXACT if EXACT in has else NELBO) if wanted == "auto" else wanted
        if chosen not in has:
            raise ValueError(f"likelihood={wanted!r}: the {self.strategy.name} strategy offers {list(has) or 'none'}")
        return chosen

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "dllm-flow")).replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    # ------------------------------------------------------------------ requests

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        pairs = [self._encode_pair(*r.args) for r in requests]
        results = self._score(pairs)
        for r, res in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", r.args, res)
        return results

    def loglikelihood_rolling(self, requests) -> list[float]:
        pairs = [([self.prefix_token_id], self._encode(r.args[0])) for r in requests]
        results = [ll for ll, _ in self._score(pairs)]
        for r, res in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood_rolling", r.args, res)
        return results

    def generate_until(self, requests) -> list[str]:
        out = []
        for r in requests:
            context, kwargs = r.args
            text = self._generate(context, dict(kwargs or {}))
            self.cache_hook.add_partial("generate_until", r.args, text)
            out.append(text)
        return out

    # ------------------------------------------------------------------ tokens

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Context and continuation ids, split on the ids of the whole text (trailing context spaces
        belong to the continuation); an empty context is the prefix token."""
        if not context:
            return [self.prefix_token_id], self._encode(continuation)
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole, ctx = self._encode(context + continuation), self._encode(context)
        return ctx, whole[len(ctx) :]

    # ------------------------------------------------------------------ likelihoods

    @torch.no_grad()
    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(log p(continuation | context), greedy?) per pair, summed (and-ed) over the pieces that fit."""
        split = [pieces(ctx, cont, self.max_length) for ctx, cont in pairs]
        flat = [p for parts in split for p in parts]
        scored = self._exact(flat) if self.likelihood == EXACT else [self._elbo(*p) for p in flat]
        out, at = [], 0
        for parts in split:
            mine = scored[at : at + len(parts)]
            at += len(parts)
            out.append((float(sum(ll for ll, _ in mine)), all(g for _, g in mine)))
        return out

    def _causal_logits(self, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The strategy's causal path: a DFlash draft's frozen target, a hybrid model's causal branch, or
        the converted causal LM itself (idlm's clean half); checked once against `ar_nll_rows`."""
        if self.strategy.trains == "draft":
            return self.strategy.target(input_ids=ids, attention_mask=attn).logits
        if hasattr(self.model, "causal_logits"):
            return self.model.causal_logits(ids, attn)
        return self.model(input_ids=ids, attention_mask=attn, use_cache=False).logits

    def _exact(self, flat: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Exact log-likelihood of each piece given the text before it (docs/evaluation.md §4.3), and
        whether every piece token is the argmax of its logit row; rows batched longest first."""
        out: list[tuple[float, bool]] = [(0.0, True)] * len(flat)
        order = sorted(range(len(flat)), key=lambda i: -(len(flat[i][0]) + len(flat[i][1])))
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.prefix_token_id
        for start in range(0, len(order), self.settings.batch_size):
            rows = order[start : start + self.settings.batch_size]
            width = max(len(flat[i][0]) + len(flat[i][1]) for i in rows)
            ids = torch.full((len(rows), width), pad, dtype=torch.long, device=self.device)
            attn, loss_mask = torch.zeros_like(ids), torch.zeros_like(ids)
            for r, i in enumerate(rows):
                before, piece = flat[i]
                ids[r, : len(before) + len(piece)] = torch.tensor(before + piece, device=self.device)
                attn[r, : len(before) + len(piece)] = 1
                loss_mask[r, len(before) : len(before) + len(piece)] = 1
            logits = self._causal_logits(ids, attn).float()
            nll, _ = causal_nll_rows(logits, ids, loss_mask, attn)
            self._check_causal_path(ids, loss_mask, attn, nll)
            hit = (logits[:, :-1].argmax(-1) == ids[:, 1:]) | ~loss_mask[:, 1:].bool()
            for r, i in enumerate(rows):
                out[i] = (-float(nll[r]), bool(hit[r].all()))
        return out

    def _check_causal_path(self, ids, loss_mask, attn, nll) -> None:
        """On the first batch: the causal path above must give the strategy's own `ar_nll_rows`."""
        if self._causal_path_checked or self.strategy.trains == "draft":  # a draft's causal path: the target's own
            return
        ref, _ = self.strategy.ar_nll_rows(self.model, ids, loss_mask, attn)
        if not torch.allclose(ref.float(), nll, rtol=1e-3, atol=1e-3):
            raise RuntimeError(
                f"the {self.strategy.name} strategy's ar_nll_rows differs from the causal path the lm-eval "
                "adapter uses (tasks/evaluation/lm_eval_model.py: _causal_logits); teach it that strategy's causal "
                "forward"
            )
        self._causal_path_checked = True

    def _elbo(self, before: list[int], piece: list[int]) -> tuple[float, bool]:
        """Monte-Carlo ELBO of `piece` given the clean `before` (docs/evaluation.md §4.10): the strategy's
        `nelbo_rows` at K stratified times over K copies of the row, loss mask on the piece only;
        log p ≈ −(1/K) Σ_k nelbo_k. Greedy: temperature-0 decoding of the piece by the strategy's own
        sampler, one denoising step per block, the piece one block (for masked strategies: the argmax of
        one pass over the fully masked piece)."""
        k = self.settings.mc_samples
        row = torch.tensor(before + piece, dtype=torch.long, device=self.device)
        ids = row[None].repeat(k, 1)
        loss_mask = torch.zeros_like(ids)
        loss_mask[:, len(before) :] = 1
        gen = seeded_generator(request_seed(self.settings.seed, before), self.device)
        u = torch.rand(1, generator=gen, device=self.device)
        t = ((torch.arange(k, device=self.device) + u) / k).clamp_min(1e-6)
        total = 0.0
        for s in range(0, k, self.settings.batch_size):
            sl = slice(s, s + self.settings.batch_size)
            total += float(self.strategy.nelbo_rows(self.model, ids[sl], loss_mask[sl], self.mask_id, t[sl], gen).sum())
        config = SamplerConfig(
            steps=1, max_new_tokens=len(piece), block_size=len(piece), logit_shift=self.strategy.logit_shift
        )
        greedy = self._sample(before, config, gen).tolist() == piece
        return -total / k, greedy

    # ------------------------------------------------------------------ generation

    def _sample(self, prompt: list[int], config: SamplerConfig, gen: torch.Generator) -> torch.Tensor:
        request = SampleRequest([prompt], self.mask_id, self.tokenizer.pad_token_id or 0, config, gen, str(self.device))
        result = self.strategy.sample(self.model, request)
        return result.generated(0)

    @torch.no_grad()
    def _generate(self, context: str, kwargs: dict) -> str:
        """The strategy's own sampler (a DFlash draft: speculative decoding, the target's greedy text)
        continues the left-truncated context; the text is cut at EOS and at the first `until` string."""
        until = kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        new = max(1, min(int(kwargs.pop("max_gen_toks", self.settings.max_gen_toks)), self.max_length - 1))
        temperature = float(kwargs.get("temperature", 0.0) or 0.0)
        if kwargs.get("do_sample") is False:
            temperature = 0.0
        prompt = (self._encode(context) if context else [self.prefix_token_id])[-(self.max_length - new) :]
        eos = self.tokenizer.eos_token_id
        if self.strategy.trains == "draft":
            ids = speculative_generate(self.strategy.target, self.model, prompt, new, eos).tokens[:new]
        else:
            config = SamplerConfig(
                steps=math.ceil(new / self.settings.tokens_per_step),
                max_new_tokens=new,
                block_size=min(self.settings.block_size, new),
                temperature=temperature,
                threshold=self.settings.threshold,
                eos_token_id=eos,
                logit_shift=self.strategy.logit_shift,
            )
            gen = seeded_generator(request_seed(self.settings.seed, prompt), self.device)
            ids = self._sample(prompt, config, gen)
        text = self.tokenizer.decode(trim_at_eos(torch.as_tensor(ids), eos))
        for stop in until:
            if stop:
                text = text.split(stop)[0]
        return text


# ---------------------------------------------------------------------- running tasks (the evaluate stage)


def run_tasks(lm: DLLMFlowLM, settings: LMEvalConfig, seed: int, chat: bool = False) -> dict:
    """`lm_eval.simple_evaluate` over `settings.tasks` (through the tokenizer's chat template for a dialogue
    model); torch's global RNG is left alone (the adapter seeds every draw itself), Python's and numpy's
    are seeded with `seed` as the harness does."""
    return simple_evaluate(
        model=lm,
        tasks=list(settings.tasks),
        num_fewshot=settings.num_fewshot,
        limit=settings.limit,
        task_manager=task_manager(settings.tasks, settings.include_path),
        log_samples=False,
        apply_chat_template=chat,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=None,
        fewshot_random_seed=seed,
    )


def harness_metrics(results: dict) -> dict[str, float]:
    """The numbers of the harness's results as `lm_eval/<task>/<metric>` (`/<filter>` appended unless it
    is "none"), groups included; strings ("N/A" standard errors, aliases) are left out."""
    out = {}
    for section in ("results", "groups"):
        for task, values in (results.get(section) or {}).items():
            for key, value in values.items():
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                metric, _, filt = key.partition(",")
                name = f"lm_eval/{task}/{metric}" + ("" if filt in ("", "none") else f"/{filt}")
                out[re.sub(r"[^\w\-./ ]", "_", name)] = float(value)  # what MLflow accepts in a metric name
    return out


def results_json(results: dict) -> str:
    return json.dumps(results, indent=2, default=handle_non_serializable, sort_keys=True)


if __name__ == "__main__":  # the harness CLI with `dllm-flow` registered
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
