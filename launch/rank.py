"""TEMPORARY (replaced by the launcher restructure): the entry point of train.py."""

import sys

from launch import rundir


def entry_point(hydra_main) -> None:
    sys.argv = rundir.prepare_argv(sys.argv)
    hydra_main()
