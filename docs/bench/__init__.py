"""The benchmark behind the numbers of docs/performance.md and the README, an offline tool beside
the pages it measures for: `python -m docs.bench` runs train.py, the plain DDP recipe
(reference.py) and a raw loop side by side and prints their ratios. Nothing imports it."""
