"""The context of the model that draws a strategy's evaluation samples (the trained model, or the frozen target a
speculative strategy decodes with): what `tasks.evaluate.check_samples_fit` holds every eval prompt plus
`eval.sample_length` to, before any training."""

from __future__ import annotations

import functools

import transformers

from dllm_common.config import PipelineSpec
from strategies import strategy_class
from strategies.model_files import resolve_model_path


def sampling_context(spec: PipelineSpec, strategy: str) -> tuple[int | None, str]:
    """(positions, what they are) of the model that draws `strategy`'s evaluation samples: the trained model, or
    the frozen target a speculative strategy decodes with. None where the config of a pretrained model cannot be
    read here (its own stage then says why)."""
    m, d = spec.model, spec.dflash
    if strategy_class(strategy).evaluation == "speculative":
        if d.target_model_id is None:
            return spec.data.seq_len, "the embedded target's context (data.seq_len)"
        path, gguf, remote, what = (
            d.target_model_id,
            d.target_gguf_file,
            d.target_trust_remote_code,
            "dflash.target_model_id",
        )
    elif m.kind == "tiny":
        return spec.data.seq_len, "the model's context (data.seq_len, a tiny model's max_position_embeddings)"
    else:
        path, gguf, remote, what = m.path, m.gguf_file, m.trust_remote_code, "model.path"
    context = _max_positions(path, gguf, remote)
    return context, f"the context of {what} {path!r} (max_position_embeddings)" if context else ""


@functools.lru_cache(maxsize=8)
def _max_positions(path: str, gguf: str | None, trust_remote_code: bool) -> int | None:
    """A pretrained model's `max_position_embeddings`, from its config alone (a GGUF's header: seconds, once)."""
    try:
        kwargs = {"gguf_file": gguf} if gguf else {}
        config = transformers.AutoConfig.from_pretrained(
            resolve_model_path(path), trust_remote_code=trust_remote_code, **kwargs
        )
    except Exception:  # not readable here (no hub access, a typo): the stage that loads it names the problem
        return None
    context = getattr(config, "max_position_embeddings", None)
    return context if isinstance(context, int) and not isinstance(context, bool) else None
