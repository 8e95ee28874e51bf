"""How a run is started, supervised and recorded: distributed setup, run directory,
checkpoints, metrics/W&B, the torchrun job runner behind the Hydra launcher, sweep summary."""
