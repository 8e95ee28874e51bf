"""Hydra sweeper plugin `hydra/sweeper=optuna`: the project's Optuna sweeper on current Optuna,
with pruning across DDP jobs and no idle slots (launch/sweeper/sweeper.py)."""
