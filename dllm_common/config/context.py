"""Context lengths read without loading a model: the longest row accepted (`MAX_SEQ_LEN`), the characters a
prompt may hold per position (`MAX_CHARS_PER_TOKEN`), a local model's `max_position_embeddings`
(`local_max_positions`) and whether a prompt and what is generated after it fit a context (`context_overflow`)."""

from __future__ import annotations

import json
from pathlib import Path

# the longest training row dllm-flow accepts (2^20 positions): a tiny model is built with data.seq_len positions, so
# without a bound `data.seq_len: 10000000` would validate and only fail once a stage allocates its rows
MAX_SEQ_LEN = 1 << 20
# a generous bound on a prompt's characters per token, whatever the tokenizer (English text averages about 4): a
# prompt with more characters than its model's positions × this cannot fit, and is refused before it is tokenized
MAX_CHARS_PER_TOKEN = 32


def local_max_positions(path: str | None) -> int | None:
    """`max_position_embeddings` from a local model folder's config.json (`package:NAME` is an installed package's
    folder), read as JSON without importing anything; None for a hub id, a GGUF file or a config that has none."""
    if not path:
        return None
    folder = Path(path).expanduser()
    if path.startswith("package:"):
        import importlib.util

        try:
            found = importlib.util.find_spec(path.split(":", 1)[1])
        except (ImportError, ValueError):
            return None
        if found is None or found.origin is None:
            return None
        folder = Path(found.origin).parent
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for section in (config, config.get("text_config") if isinstance(config, dict) else None):
        positions = section.get("max_position_embeddings") if isinstance(section, dict) else None
        if isinstance(positions, int) and not isinstance(positions, bool) and positions > 0:
            return positions
    return None


def context_overflow(
    prompt_tokens: int,
    new_tokens: int,
    context: int,
    *,
    prompt: str = "--prompt",
    new: str = "--max-new-tokens",
    context_of: str = "the model's context",
    spans: str = "",
) -> str | None:
    """What is wrong when a prompt of `prompt_tokens` and `new_tokens` generated after it do not fit a model's
    `context` of positions (None: they fit), naming the settings to change: `dllm-flow generate`'s flags, or
    `eval.prompts` and `eval.sample_length` for the evaluation's samples (one rule, one wording for both)."""
    if prompt_tokens > context:
        return f"{prompt} is {prompt_tokens} tokens{spans}, longer than {context_of} of {context} positions; shorten it"
    if prompt_tokens + new_tokens <= context:
        return None
    room = context - prompt_tokens
    fix = f"lower {new} to at most {room}" if room >= 1 else f"shorten {prompt} to leave room"
    tokens = f"{prompt_tokens} token{'s' if prompt_tokens != 1 else ''}"
    return (
        f"{prompt} ({tokens}) + {new} ({new_tokens}) = {prompt_tokens + new_tokens} positions, more than {context_of} "
        f"of {context}; {fix}"
    )
