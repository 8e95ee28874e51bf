"""Hydra sweeper plugin `hydra/sweeper=ddp_optuna`: hydra-optuna-sweeper's Optuna sweeper, able
to resume a sweep's study (launch/optuna_sweeper.py)."""
