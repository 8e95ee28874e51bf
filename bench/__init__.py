"""The throughput benchmark, an offline tool: `python -m bench` runs train.py, the plain DDP
recipe (bench/reference.py) and a raw loop side by side and prints their ratios."""
