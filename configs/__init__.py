"""Config pieces (YAML), shipped as package data: ``pretrain.config.compose`` finds them here."""
