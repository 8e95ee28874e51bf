"""Hyperparameter search, in the sweeper (the launcher's process): `hydra/sweeper=optuna`.
sweeper.py (the Sweeper), space.py (override grammar -> Optuna distributions), study.py (storage,
resume), usage.py (slot utilisation); the in-rank half of pruning is
ddp_launcher/ranks/pruning.py.
"""
