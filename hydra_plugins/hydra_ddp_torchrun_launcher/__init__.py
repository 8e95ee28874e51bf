"""Hydra launcher plugin `hydra/launcher=torchrun`: every job of a sweep is a torchrun job.

Hydra discovers launchers only inside the `hydra_plugins` namespace package, so this thin shim
lives here; the work is done in launch/torchrun.py.
"""
