"""A dataset of your own, end to end, as a user writes one (docs/own-dataset.md): it imports data/,
nothing imports it; its YAML comes in with `--config-dir data/example/conf`."""
