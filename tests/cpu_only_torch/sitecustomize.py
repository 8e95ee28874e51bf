"""Makes the installed torch look like a CPU-only build in the one respect that broke forked
ranks: torch._C has no `_cuda_isInBadFork` (torch's CPU wheels do not compile it). Put this
folder first on PYTHONPATH (tests/test_gpu_fork.py does): every Python process started with it,
and every process forked from one, imports torch without the attribute.

torch.cuda, imported while torch is, has already bound its `_is_in_bad_fork` to the real probe
by then, so a rank that reads the flag the way torch does still learns the truth."""

import importlib.abc
import importlib.machinery
import sys


class _DropBadForkProbe(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            if hasattr(module._C, "_cuda_isInBadFork"):
                delattr(module._C, "_cuda_isInBadFork")

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _DropBadForkProbe())
