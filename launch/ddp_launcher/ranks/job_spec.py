"""What a launcher hands a job's ranks (:class:`JobSpec`, a task function of the app's script as
:class:`ScriptTask`) and the torchrun launcher a job's agent (:class:`AgentSpec`), and what comes
back when no rank returned one (:func:`job_return`)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any

from hydra.errors import CompactHydraException
from omegaconf import DictConfig


@dataclass
class JobSpec:
    """What every rank of one job needs to run it (pickled to the ranks)."""

    task_function: Any
    config: DictConfig  # the job's composed config, hydra node included, output dirs resolved
    singleton_state: Any
    hydra_context: Any = None  # None: the job dir and .hydra/ already exist (`python app.py`)
    job_dir_key: str = "hydra.sweep.dir"
    job_subdir_key: str | None = "hydra.sweep.subdir"
    # Without a hydra_context: the app's `_target_` whitelist its ranks run under (Hydra 1.4:
    # the one the handing-off process ran under; None: Hydra 1.3's, none)
    execution_whitelist: Any = None


@dataclass
class ScriptTask:
    """A task function defined in the app's script (the launcher's `__main__`, e.g. an
    unmodified `@hydra.main` app), handed to the ranks by name: each rank imports the script
    as `__mp_main__` after it is forked, as multiprocessing's spawn does and as every rank of
    plain torchrun runs it, and calls the function Hydra was given (hydra.main's decorator
    unwrapped). Not cloudpickled by value: then the script's top level (torch.backends flags,
    OmegaConf resolvers, set_float32_matmul_precision, its imports) would run in no rank, and a
    global that does not pickle would fail the job; nor imported in the agent that forks the
    ranks (multiprocessing's default, ddp_launcher/warm.py): a CUDA call at the script's top,
    even torch.cuda.is_available(), would make every rank a CUDA bad fork."""

    script: str | None  # `python app.py`: its path
    module: str | None  # `python -m pkg.app`: its name
    qualname: str
    code: tuple[str, int]  # the function's (co_name, co_firstlineno): which of its wrappers

    def __call__(self, cfg: Any) -> Any:
        return self.function()(cfg)

    def function(self) -> Any:
        import cloudpickle

        main = sys.modules.get("__mp_main__")
        if main is None or getattr(main, "__ddp_script__", None) != (self.script, self.module):
            main = import_script(self.script, self.module)
            main.__ddp_script__ = (self.script, self.module)
            # Rank 0's return value (or error) may be of the script's classes: by value, as the
            # launcher has no __mp_main__ to find them in.
            cloudpickle.register_pickle_by_value(main)
        found: Any = main
        for part in self.qualname.split("."):
            found = getattr(found, part, None)
        while found is not None and code_key(found) != self.code:
            found = getattr(found, "__wrapped__", None)  # hydra.main's decorated_main
        if found is None:
            where = self.script or self.module
            raise RuntimeError(f"{where} defines no {self.qualname} at its top level any more")
        return found


def code_key(function: Any) -> tuple[str, int] | None:
    code = getattr(function, "__code__", None)
    return (code.co_name, code.co_firstlineno) if code is not None else None


def by_reference(task_function: Any) -> Any:
    """`task_function` as the ranks should get it: a :class:`ScriptTask` for a function of the
    app's script (reachable by name at its top level), else itself (cloudpickle pickles a
    module's function by reference; one of an interactive `__main__`, by value)."""
    main = sys.modules.get("__main__")
    module = getattr(getattr(main, "__spec__", None), "name", None)
    script = getattr(main, "__file__", None)
    key = code_key(task_function)
    if (
        getattr(task_function, "__module__", None) != "__main__"
        or key is None
        or "<locals>" in task_function.__qualname__
        or not (module or script)
    ):
        return task_function
    script = None if module else os.path.abspath(script)
    return ScriptTask(script, module, task_function.__qualname__, key)


def import_script(script: str | None, module: str | None) -> Any:
    """The app's script (by path or module name) as module `__mp_main__`, also this process's
    `__main__`, as multiprocessing's spawn makes it (its spawned children, e.g. DataLoader
    workers, import it again from there)."""
    import importlib.util

    if module is not None:
        found = importlib.util.find_spec(module)
        spec = importlib.util.spec_from_file_location("__mp_main__", found.origin)
    else:
        spec = importlib.util.spec_from_file_location("__mp_main__", script)
    main = importlib.util.module_from_spec(spec)
    if module is not None:
        main.__package__ = module.rpartition(".")[0]
    sys.modules["__mp_main__"] = main
    spec.loader.exec_module(main)
    main.__spec__ = found if module is not None else None  # as `python -m` / `python app.py`
    sys.modules["__main__"] = main
    return main


@dataclass
class AgentSpec:
    """One job's torchrun agent (agent.py): torch's LaunchConfig in plain values, and the process
    the agent becomes (its environment, working dir, output, CPUs)."""

    payload: str  # the pickled JobSpec each rank runs (<job dir>/.torchrun/job.pkl)
    failures: str  # where the agent writes which ranks failed and how (failures.json)
    nproc: int
    nnodes: int
    max_restarts: int
    monitor_interval: float
    log_dir: str  # per-rank stdout/stderr files (torchrun --log-dir, --redirects=3)
    tee: str  # ranks whose output also reaches the agent's own (torchrun --tee)
    line_prefix: str  # before each line a rank prints (torchrun --log-line-prefix-template)
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str = "localhost:0"  # single node: the OS picks a free port per job
    rdzv_id: str | None = None  # None: a new id per job (torchrun --standalone)
    node_rank: int | None = None  # this node's rank, for the static rendezvous only
    rdzv_conf: dict[str, str] = field(default_factory=dict)  # torchrun --rdzv-conf
    env: dict[str, str] = field(default_factory=dict)  # the agent's whole environment
    cwd: str = "."
    log: str | None = None  # the agent's own output file (None: the launcher's stdout/stderr)
    cpus: list[int] | None = None  # the CPUs the job may use (None: the launcher's)


class Stopped(CompactHydraException):
    """A rank stopped from outside (a signal) before it could finish: not its own error; the
    cause is in the record of the ranks that died, when there is one."""


class NotStarted(Stopped):
    """A SLURM job that SLURM started after a job of its sweep failed for good under
    hydra.launcher.fail_fast (SLURM starts a queued job the moment a CPU frees, before the
    launcher's next poll): it ran nothing; the launcher stops and records it with the running
    ones (ddp_launcher/lifecycle.py)."""


FENCE_FILE = ".failed_fast"  # in the sweep dir: Job.fence (ddp_launcher/jobs.py)


def fails_for_good(job: Any, ret: Any) -> bool:
    """Whether `job`'s failed attempt (JobReturn `ret`) is its last in this launch: no
    hydra.launcher.retries left, or a user error, which fails the same way every time."""
    from ddp_launcher.core.errors import find_user_error, job_value

    return job.retries_left <= 0 or find_user_error(job_value(ret)) is not None


def job_return(job: Any, status: Any, value: Any) -> Any:
    """A JobReturn made by the launcher, or by a SLURM task stopped before its task ran (rank 0
    returned none), for `job`, a ddp_launcher.jobs.Job."""
    from hydra.core.utils import JobReturn

    ret = JobReturn(overrides=job.overrides, cfg=job.spec.config, hydra_cfg=job.spec.config)
    ret.working_dir = str(job.job_dir)
    ret.return_value, ret.status = value, status
    return ret
