"""How the settings left to kvcompress (``auto``, and the paths left empty) become concrete.

``--kv-scoring auto`` is decided once, when the engine starts (``resolve_at_start``): the
score surrogate where finished caches are reused and the model has a valid one, else the
observation window. Before that it stands for window (``scoring_in_force``); a request's
``kv_scoring: auto`` asks for the engine's choice (``KVCompressionConfig.with_request_overrides``).
``--kv-budget-sharing auto`` follows the scoring in force (``budget_sharing_in_force``).
The surrogate's and the query profile's paths default to the user's cache or beside the
model (``model_store``: a model named by its hub id is found in the local hub cache), and
each is loaded at start so that a missing file, or one made for another model, stops the
start.

Not here: the budget a method without an amount keeps (``DEFAULT_BUDGET``, filled in by
``KVCompressionConfig.from_mapping``), the page size left open (the platform's:
engine/vllm_layout.py) and ``--kv-reuse`` following vLLM's prefix-caching switch
(engine/engine_args.py): those read the engine or the platform.

No vLLM imports. The rules take the config's values, not the config, so that the config's
properties can use them (this module sits below ``settings.config``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Protocol, TypeVar

from kvcompress.log import get_logger
from kvcompress.profile_model import store as model_store
from kvcompress.profile_model.profiles import ProfileError, load_profile
from kvcompress.profile_model.surrogates import SurrogateError, load_surrogate, quality_line
from kvcompress.settings.flags import QUERY_AGNOSTIC_SCORINGS

logger = get_logger(__name__)


def scoring_in_force(scoring: str) -> str:
    """The scoring a setting stands for: ``auto`` not resolved at start is window."""
    return "window" if scoring == "auto" else scoring


def budget_sharing_in_force(budget_sharing: str, method_scores: bool, scoring: str) -> str:
    """``auto``: model-wide where the prompt's scores compare across layers and heads (a
    reconstruction's or its surrogate's, under a method that scores), else per layer."""
    if budget_sharing != "auto":
        return budget_sharing
    return "model" if method_scores and scoring in QUERY_AGNOSTIC_SCORINGS else "layer"


class StartSettings(Protocol):
    """What the start-time resolution reads of a config (``KVCompressionConfig``)."""

    @property
    def scoring(self) -> str: ...
    @property
    def reuse(self) -> str: ...
    @property
    def surrogate(self) -> str: ...
    @property
    def profile(self) -> str: ...
    @property
    def enabled(self) -> bool: ...
    @property
    def loads_surrogate(self) -> bool: ...
    @property
    def loads_profile(self) -> bool: ...


Settings = TypeVar("Settings", bound=StartSettings)


def resolve_at_start(config: Settings, model: str) -> Settings:
    """The scoring and the model files it needs, once, when the engine starts: ``auto``
    chosen, the surrogate's and the profile's paths filled in and their files loaded."""
    if config.scoring == "auto":
        config = resolve_auto_scoring(config, model)  # loads what it picks
    elif config.loads_surrogate:
        config = _resolve_surrogate(config, model)
    if config.loads_profile:
        config = _resolve_profile(config, model)
    return config


def resolve_auto_scoring(config: Settings, model: str) -> Settings:
    """``--kv-scoring auto``: the score surrogate where finished caches are reused and the
    model has a valid one (query-agnostic scores inside the prefill; measured at least as
    good as its union with the window on single questions and better on later turns), else
    the observation window (question-aware, free). Never a reconstruction pass: it costs a
    second prefill of every long prompt (docs/methods.md, "Scores without a second
    prefill")."""
    if config.scoring != "auto" or not config.enabled:
        return config
    if config.reuse == "off":
        return dataclasses.replace(config, scoring="window")
    surrogate = dataclasses.replace(config, scoring="surrogate")
    if config.surrogate:  # named by the user: a wrong one stops the start
        return _resolve_surrogate(surrogate, model)
    try:
        return _resolve_surrogate(surrogate, model)
    except SurrogateError as error:
        logger.warning("kvcompress: --kv-scoring auto: %s. Prompts are scored by their "
                       "observation window (question-aware), so later turns that reuse a "
                       "compressed cache may miss what the first question did not ask for.",
                       error)
        return dataclasses.replace(config, scoring="window")


def _resolve_surrogate(config: Settings, model: str) -> Settings:
    """--kv-scoring surrogate: the surrogate's path (``model_store``: the flag's, the user's
    cache, beside the model), loaded once here so that a missing surrogate or one made for
    another model stops the start."""
    path, folder = _find("surrogate", config.surrogate, model, SurrogateError,
                         "--kv-surrogate")
    surrogate = load_surrogate(path, folder)
    # What it predicts is said at every start: a poor fit would quietly weaken later turns.
    figures = quality_line(surrogate.quality)
    logger.info("kvcompress: score surrogate %s, fitted on %d prompt tokens; held out: %s",
                path, surrogate.num_tokens, figures or "not recorded")
    return dataclasses.replace(config, surrogate=str(path))


def _resolve_profile(config: Settings, model: str) -> Settings:
    """--kv-scoring expected: the query profile's path, found as the surrogate's."""
    path, folder = _find("profile", config.profile, model, ProfileError, "--kv-profile")
    load_profile(path, folder)
    return dataclasses.replace(config, profile=str(path))


def _find(kind: str, given: str | None, model: str, error: type[ValueError],
          flag: str) -> tuple[Path, Path | None]:
    """The file the flag names, else the first of ``model_store.candidates`` that exists,
    with the model's folder (None: not found, so not checked against it); the error says
    where it looked and the command that makes one."""
    folder = model_store.model_folder(model)
    if given:
        return Path(given), folder
    if folder is None:
        raise error(f"{flag}: {model} is neither a model folder nor in the local Hugging "
                    "Face cache, so its " + kind + " cannot be looked for; name the file")
    looked = model_store.candidates(kind, folder)
    for path in looked:
        if path.is_file():
            return path, folder
    raise error(f"{flag}: no {'score surrogate' if kind == 'surrogate' else 'query profile'} "
                f"for {model} (looked at {', '.join(map(str, looked))}); make one with: "
                f"{model_store.make_command(model)}")
