"""The throughput benchmark, an offline tool: `python -m docs.bench` runs train.py, the plain DDP
recipe (docs/bench/reference.py) and a raw loop side by side and prints their ratios."""
