"""The settings each registered sampler declares (`SamplerInfo.decoding`, `SamplerInfo.settings`) against those it
reads when `dllm-flow generate` runs it, and the settings line `generate` echoes (only what the sampler reads: no
cache for a sampler that caches nothing)."""

import sys

import pytest
import torch
from test_loss_contract import _denoiser_step, _draft_step

from strategies import strategy_class
from strategies.registration import DECODING_SETTINGS, USER_SETTINGS, SamplerInfo
from strategies.registry import REGISTRY, SAMPLERS
from strategies.sampling import SamplerConfig
from tasks.commands.generate import Request, generate, settings_line
from tasks.evaluation.trained_model import Loaded

WATCHED = {*USER_SETTINGS, *DECODING_SETTINGS}
# reads that are not decoding: the dataclass's own machinery, generate's flag check and its settings line
NOT_DECODING = {
    *("__post_init__", "__init__", "__repr__", "__eq__", "__hash__"),
    *("check_request", "check_speculative_flags", "settings_line"),
}
READS: set[str] = set()


class RecordingConfig(SamplerConfig):
    """A `SamplerConfig` that notes which user and decoding settings are read while a sampler decodes."""

    def __getattribute__(self, name):
        if name in WATCHED:
            caller = sys._getframe(1)
            if caller.f_code.co_name not in NOT_DECODING and caller.f_globals.get("__name__") != "dataclasses":
                READS.add(name)
        return object.__getattribute__(self, name)


class CharTokenizer:
    """Characters as ids 2…: enough tokenizer for `generate` (no special tokens but EOS = 1 and PAD = 0)."""

    eos_token_id, pad_token_id = 1, 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [2 + ord(c) % 40 for c in text]}

    def decode(self, ids):
        return "".join(chr(ord("a") + int(i) % 26) for i in ids)


def _loaded(name: str) -> Loaded:
    built, model, _ = (_draft_step if strategy_class(name).trains == "draft" else _denoiser_step)(name)
    return Loaded(model.eval(), CharTokenizer(), built.strategy, built.mask_token_id, {"strategy": name})


def _cases():
    return [(strategy, sampler) for strategy, reg in sorted(REGISTRY.items()) for sampler in reg.samplers]


@pytest.mark.parametrize("strategy, sampler", _cases())
def test_each_sampler_reads_exactly_the_decoding_settings_it_declares(strategy, sampler):
    """Run through `generate` as `dllm-flow generate --sampler <name>` runs it, at temperature 1 with a top-p
    cut (so the cuts are read): the steps, block size and cache it reads are the ones it declares, and it reads no
    user setting it does not declare."""
    loaded = _loaded(strategy)
    config = RecordingConfig(
        steps=4, max_new_tokens=8, block_size=4, temperature=1.0, top_k=5, top_p=0.9, sampler=sampler
    )
    READS.clear()
    with torch.no_grad():
        generate(loaded, Request("abc", sampler, config, seed=0), "cpu")
    info = SAMPLERS[sampler]
    assert READS & set(DECODING_SETTINGS) == set(info.decoding), f"{sampler} reads {sorted(READS)}"
    assert READS & set(USER_SETTINGS) <= set(info.settings), f"{sampler} reads {sorted(READS)}"


def test_the_cacheless_samplers_declare_it():
    """SCDD's ancestral sampler and DFlash's speculative decoder cache nothing (docs/decoding.md §2), and the
    speculative decoder has no step budget or sampler block either; the absorbing sampler reads all three."""
    assert "cache" not in SAMPLERS["scdd"].decoding and SAMPLERS["speculative"].decoding == ()
    assert SAMPLERS["llada"].decoding == DECODING_SETTINGS
    with pytest.raises(ValueError, match=r"SamplerInfo.decoding: unknown setting\(s\) \['kv'\]"):
        SamplerInfo("x", decoding=("kv",))


def test_generate_echoes_only_the_settings_the_sampler_reads():
    config = SamplerConfig(steps=16, temperature=0.8, top_p=0.95, top_k=3, cache="dual")
    assert settings_line("llada", config, 7) == (
        "sampler llada, steps 16, temperature 0.8, top-p 0.95, top-k 3, cache dual, seed 7"
    )
    assert settings_line("scdd", config, 7) == "sampler scdd, steps 16, temperature 0.8, top-p 0.95, top-k 3, seed 7"
    assert settings_line("speculative", config, 0) == "sampler speculative, temperature 0.8, seed 0"
    for name, info in SAMPLERS.items():
        line = settings_line(name, config, 0)
        assert ("cache dual" in line) == ("cache" in info.decoding)
        assert ("steps 16" in line) == ("steps" in info.decoding)
