"""The errors a person fixes in the config: `ConfigError`, and `TrainingDiverged` (a training that met a NaN or
infinite value, raised at run time: a setting to change)."""


class ConfigError(ValueError):
    """A config problem a person can fix; the message lists every offending key."""


class TrainingDiverged(ConfigError):
    """A NaN or infinite loss, gradient norm or weight: the training stopped at that step and nothing was
    published. A user error: a setting (most often the learning rate) is what to change (docs/operations.md)."""
