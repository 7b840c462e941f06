"""The one config system: every verb's YAML composes (``compose``) and validates (``structured``) the same way."""

from pretrain.config.compose import CONFIG_DIR, RECIPE_DIR, compose, structured
from pretrain.config.run import (
    CheckpointConfig,
    DataConfig,
    ObjectiveConfig,
    OptimConfig,
    RunConfig,
    SourceConfig,
    TokenizerConfig,
    TrainerConfig,
    global_batch_size,
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
    "compose",
    "global_batch_size",
    "load",
    "structured",
    "to_dict",
    "validate",
]
