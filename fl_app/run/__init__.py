"""A run: the ServerApp's body, its rounds, checkpoints, resume and sweeps, and its records."""
