"""Hyperparameter search, in the sweeper (the launcher's process): `hydra/sweeper=optuna`.

* space.py: Hydra's override grammar (interval, choice, range, tag(log, ...)) to Optuna
  distributions;
* study.py: the study's storage (SQLite / journal file / a database URL) and how a resumed
  sweep continues it (its pruner: core/trials.py);
* sweeper.py: the Sweeper: trials asked one at a time and started whenever a slot frees,
  told complete / pruned / failed;
* usage.py: the sweep's slot utilisation.

The in-rank half of pruning is components/pruning.py. Imports flow one way:
hydra_plugins -> launch/sweeper/ -> launch/ -> core/.
"""
