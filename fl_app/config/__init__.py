"""Configuration: Hydra composition, one-line validation, the typed settings, the registries."""
