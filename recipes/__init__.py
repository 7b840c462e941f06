"""Ready recipes (YAML) and the shipped corpus, shipped as package data so an installed wheel can run them."""
