"""Ready recipes (YAML) and the shipped corpus, installed as package data ``pretrain.recipes`` so an installed
wheel can run them."""
