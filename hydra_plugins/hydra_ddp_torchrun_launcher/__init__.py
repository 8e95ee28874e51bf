"""Hydra launcher plugin `hydra/launcher=torchrun`: every job of a sweep is a torchrun job.

Hydra discovers launchers only inside the `hydra_plugins` namespace package (and instantiates
only classes defined there), so this shim holds the Launcher class and nothing else; the schema
(`TorchrunLauncherConf`, registered as `hydra/launcher=torchrun`) and the work are in
launch/torchrun.py.
"""
