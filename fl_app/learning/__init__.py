"""Models, local training and what a client's training returns (the core: no Flower app)."""
