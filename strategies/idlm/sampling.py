"""Introspective strided decoding (ISD) for I-DLM (docs/strategies.md §8.4, §11.3).

After Yu et al. 2026, "Introspective Diffusion Language Models" (I-DLM): one causal forward over

    [committed tokens | s_1 … s_n (the previous forward's proposals) | [MASK] × k]

does two jobs at once. The causal rows at the last committed token and at s_1 … s_n give the verify
distributions `p` (the clean half: next token given everything before it); the k [MASK] rows give the decode
distributions `q` of the next proposals (the noisy half: row i predicts token i + 1 through placeholders, as
I-DLM trains it). Each proposal s_j, drawn from its `q_j`, stands with probability `min(1, p_j(s_j)/q_j(s_j))`
(speculative sampling, Leviathan et al. 2023); at the first rejection the next token is drawn from
`max(0, p_j − q_j)` normalized and the forward's new proposals are dropped (they were conditioned on the
rejected token); when every proposal stands, a bonus token is drawn from `p` after s_n and the k mask rows
become the next forward's proposals. So a forward commits between 1 and k + 1 tokens (the stride), and every
committed token is distributed as the causal half's own sample at that temperature, whatever the noisy half
proposes; at temperature 0 a proposal stands iff it is the causal argmax and the output is greedy causal
decoding. The noisy half's quality only decides how many tokens a forward commits.

The masks sit where the next clean token and the following proposals will go: the first mask row sees the
committed context and predicts two tokens ahead, the j-th one j + 1 ahead, which is what a noisy block of
I-DLM's training sees; hence `k` should not exceed the block length the model was trained with.

Differences from the paper's engine: proposals are *sampled* from `q` at temperature > 0 (the released
engine takes the argmax of the mask rows and verifies it against `q` as if it had been sampled, which is not
exact), the [MASK] token is never generated (its column is removed from `p` and `q`), and one prompt is decoded
at a time. The top-k / nucleus cut of the sampler settings (docs/strategies.md §11.7) is applied to both `p` and
`q`, so the output then follows the truncated causal distribution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from strategies.decoding_cache import CausalPrefix, cacheable
from strategies.sampling import SamplerConfig, SampleResult, per_row_result, truncate


@dataclass
class ISDStats:
    """What ISD did, summed over the prompts: forwards, committed tokens, proposals made and accepted."""

    forwards: int = 0
    tokens: int = 0
    proposed: int = 0
    accepted: int = 0
    per_forward: list[int] = field(default_factory=list)  # tokens committed by each forward

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else float("nan")


class _CausalRows:
    """Logits of rows `[r0, T)` of a plain causal pass over `x [1, T]`. With a cacheable model and a cache
    mode other than "none", the K/V of the committed prefix are kept and reused exactly (docs/decoding.md §1)."""

    def __init__(self, model: nn.Module, cache: str):
        self.model = model
        self.prefix = CausalPrefix(model) if cache != "none" and cacheable(model) else None

    def __call__(self, x: Tensor, r0: int, committed: int) -> Tensor:
        if self.prefix is not None:
            return self.prefix.logits(x, r0, x.shape[1], committed)
        return self.model(input_ids=x, use_cache=False).logits[:, r0:]


def _distribution(logits: Tensor, config: SamplerConfig) -> Tensor:
    """float64 probabilities at `config.temperature` (> 0) after the top-k / top-p cut (docs/strategies.md §11.7)."""
    return torch.softmax(truncate(logits.double() / config.temperature, config.top_k, config.top_p), dim=-1)


def _draw(probs: Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def _uniform(generator: torch.Generator | None, device) -> float:
    return float(torch.rand((), generator=generator, device=device, dtype=torch.float64))


@dataclass
class _Step:
    """One forward's outcome: the committed tokens, how many proposals stood, the next proposals."""

    committed: list[int]
    accepted: int
    proposals: list[int] | None
    proposal_probs: Tensor | None  # [k, V] the q each next proposal was drawn from (None at temperature 0)


def _greedy_step(verify: Tensor, draft: Tensor, proposals: list[int]) -> _Step:
    """Temperature 0: a proposal stands iff it is the causal argmax; the first miss is replaced by the argmax."""
    best = verify.argmax(dim=-1).tolist()
    committed = []
    for j, s in enumerate(proposals):
        committed.append(best[j])
        if s != best[j]:
            return _Step(committed, j, None, None)
    committed.append(best[len(proposals)])  # the bonus token after the last proposal
    return _Step(committed, len(proposals), draft.argmax(dim=-1).tolist(), None)


def _sampled_step(
    verify: Tensor, draft: Tensor, proposals: list[int], q: Tensor | None, config: SamplerConfig, generator
) -> _Step:
    """Temperature > 0: speculative sampling's rejection step against the causal `p`, then a bonus draw and
    the next proposals. The draws run where the generator lives (the CPU without one)."""
    where = generator.device if generator is not None else torch.device("cpu")
    p = _distribution(verify, config).to(where)
    committed = []
    for j, s in enumerate(proposals):
        if _uniform(generator, where) * float(q[j, s]) < float(p[j, s]):  # stands with probability min(1, p/q)
            committed.append(s)
            continue
        residual = (p[j] - q[j]).clamp_min(0)
        total = float(residual.sum())
        committed.append(_draw(residual / total if total > 0 else p[j], generator))
        return _Step(committed, j, None, None)
    committed.append(_draw(p[len(proposals)], generator))
    q_next = _distribution(draft, config).to(where)
    return _Step(committed, len(proposals), [_draw(row, generator) for row in q_next], q_next)


def _isd_row(
    rows: _CausalRows,
    prompt: list[int],
    *,
    mask_token_id: int,
    k: int,
    config: SamplerConfig,
    generator: torch.Generator | None,
    device,
    stats: ISDStats,
    on_block=None,
) -> list[int]:
    """Decode one prompt; returns its generated tokens (cut after the first EOS and at `max_new_tokens`)."""
    budget, eos = config.max_new_tokens, config.eos_token_id
    if not prompt:
        raise ValueError("ISD needs a non-empty prompt (its first forward reads the last prompt token's row)")
    committed = torch.tensor(prompt, dtype=torch.long, device=device)
    out: list[int] = []
    proposals: list[int] = []
    q: Tensor | None = None
    masks = torch.full((k,), mask_token_id, dtype=torch.long, device=device)
    while len(out) < budget:
        n = committed.numel()
        spec = torch.tensor(proposals, dtype=torch.long, device=device)
        x = torch.cat([committed, spec, masks])[None]
        logits = rows(x, n - 1, n)[0].float().clone()  # rows n − 1 … : verify (len(proposals) + 1), then k drafts
        logits[:, mask_token_id] = -math.inf
        verify, draft = logits[: len(proposals) + 1], logits[len(proposals) + 1 :]
        if config.temperature == 0:
            step = _greedy_step(verify, draft, proposals)
        else:
            step = _sampled_step(verify, draft, proposals, q, config, generator)
        new = step.committed[: budget - len(out)]
        if eos is not None and eos in new:
            new = new[: new.index(eos) + 1]
        stats.forwards += 1
        stats.proposed += len(proposals)
        stats.accepted += step.accepted
        stats.per_forward.append(len(new))
        out += new
        committed = torch.cat([committed, torch.tensor(new, dtype=torch.long, device=device)])
        if on_block is not None:
            on_block(committed[None])
        if eos is not None and out and out[-1] == eos:
            break
        proposals, q = (step.proposals or []), step.proposal_probs
    stats.tokens += len(out)
    return out


@torch.no_grad()
def isd_sample(
    model: nn.Module,
    prompts: list[list[int]],
    *,
    mask_token_id: int,
    pad_token_id: int,
    config: SamplerConfig,
    proposals: int,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    on_block=None,
    stats: ISDStats | None = None,
) -> SampleResult:
    """ISD over an I-DLM model (plain causal attention): `proposals` (k) masks per forward, so each forward
    commits 1 … k + 1 tokens. One prompt at a time; `SampleResult.nfe` is the forwards per prompt (every
    forward, the first one over the prompt included). `stats` (optional) receives the acceptance counts."""
    if proposals < 1:
        raise ValueError(f"ISD needs at least one proposal per forward, got {proposals}")
    stats = stats if stats is not None else ISDStats()
    first = stats.forwards
    generated = []
    for prompt in prompts:
        rows = _CausalRows(model, config.cache)  # a fresh K/V cache per prompt
        generated.append(
            torch.tensor(
                _isd_row(
                    rows,
                    list(prompt),
                    mask_token_id=mask_token_id,
                    k=proposals,
                    config=config,
                    generator=generator,
                    device=device,
                    stats=stats,
                    on_block=on_block,
                ),
                dtype=torch.long,
            )
        )
    return per_row_result(prompts, generated, config, pad_token_id, device, stats.forwards - first)
