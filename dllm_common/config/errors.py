"""The errors a person fixes in the config: `ConfigError`, and `TrainingDiverged` (a training that met a NaN or
infinite value, raised at run time: a setting to change)."""


class ConfigError(ValueError):
    """A config problem a person can fix; the message lists every offending key."""


class TrainingDiverged(ConfigError):
    """A NaN or infinite loss, gradient norm or weight: the training stopped at that step and nothing was
    published. A user error: a setting (most often the learning rate) is what to change (docs/operations.md)."""


def cut(text: str, limit: int = 60) -> str:
    """`text` (a key, a dotted path) for an error line, cut to `limit` characters with its full length named."""
    return text if len(text) <= limit else f"{text[: limit - 1]}… ({len(text)} characters)"


def shown(value: object, limit: int = 60) -> str:
    """`repr(value)` for an error line, cut to `limit` characters with the full length named: a 100,000-character
    strategy name is echoed as its start, not whole."""
    text = repr(value)
    if len(text) <= limit:
        return text
    length = f" ({len(value)} characters)" if isinstance(value, str) else ""
    return f"{text[: limit - 1]}…{length}"
