"""Config pieces (YAML), installed as package data ``pretrain.configs``: ``pretrain.config.compose`` finds them."""
