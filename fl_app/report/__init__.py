"""Reports on runs and sweeps, experiment trackers and the privacy budget calculator."""
