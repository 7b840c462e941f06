"""The one config system: every verb's YAML composes (``compose``) and validates (``structured``) the same way."""

from pretrain.config.compose import CONFIG_DIR, RECIPE_DIR, apply_overrides, compose, structured
from pretrain.config.run import (
    CheckpointConfig,
    DataConfig,
    ObjectiveConfig,
    OptimConfig,
    RunConfig,
    SourceConfig,
    TokenizerConfig,
    TrainerConfig,
    load,
    to_dict,
    validate,
)

__all__ = [
    "CONFIG_DIR",
    "RECIPE_DIR",
    "CheckpointConfig",
    "DataConfig",
    "ObjectiveConfig",
    "OptimConfig",
    "RunConfig",
    "SourceConfig",
    "TokenizerConfig",
    "TrainerConfig",
    "apply_overrides",
    "compose",
    "load",
    "structured",
    "to_dict",
    "validate",
]
