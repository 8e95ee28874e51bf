"""First on the PYTHONPATH of a process a test starts with HYDRA_DDP_FAULT or HYDRA_DDP_OS_FAULT
(tests/helpers.py's run_env): installs the suite's fault injection (tests/faults.py: faults in
a training step; tests/os_faults.py: OS errors where a path is written), then runs the next
sitecustomize on the path, if any (e.g. tests/cpu_only_torch/'s), as Python would have."""

import importlib.machinery
import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

if os.environ.get("HYDRA_DDP_FAULT"):
    from tests import faults

    faults.install()
if os.environ.get("HYDRA_DDP_OS_FAULT"):
    from tests import os_faults

    os_faults.install()


def _run_next() -> None:
    entries = [os.path.abspath(p or ".") for p in sys.path]
    later = sys.path[entries.index(HERE) + 1 :] if HERE in entries else []
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", later)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_run_next()
