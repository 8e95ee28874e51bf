"""Fixtures shared by every test module, the experiment's (tests/) and the launcher package's
(launch/tests/); helpers live in tests/helpers.py. Also how the
suite shares the machine's cores (pytest-xdist, pyproject.toml's `-n auto --dist loadgroup`),
how it stays on the CPU on a GPU host (pin_to_the_cpu; `gpu` tests), and the run's last word on
SLURM tests that could not run."""

import inspect
import os
from pathlib import Path

import pytest
from hydra.version import VersionBase

ROOT = Path(__file__).resolve().parents[1]
TESTS = (ROOT / "tests", ROOT / "launch" / "tests")  # where this suite's fixtures are written
# Plugin modules that test modules also import from: rewritten on that first import, before
# pytest loads them as plugins (else pytest warns that it cannot rewrite them)
pytest.register_assert_rewrite("tests.hosts")
FRESH_VERSION_BASE = VersionBase.instance().getbase()  # before any test composed a config


def pytest_configure(config) -> None:
    """The plugins (hydra/launcher=torchrun, slurm; hydra/sweeper=optuna, and the config source
    their configs come from) are registered when Hydra first discovers them. Hydra's launcher
    suites (hydra_restore_singletons) put back the singletons a test started with (the
    ConfigStore, the config sources' registry): were the first discovery inside one of them,
    what it registered would be gone for the rest of the process. Discover them first.

    Workers share the cores: torch's default of one intra-op thread per core in every worker
    oversubscribes them (on 2 cores, `-m "not slow"` took 78 s with two workers this way
    against 65 s with one thread each), so a worker of several keeps one. The processes tests
    start set their own (tests/helpers.py: run_env)."""
    from hydra.core.plugins import Plugins

    pin_to_the_cpu()
    Plugins.instance()
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        import torch

        torch.set_num_threads(1)


def pin_to_the_cpu() -> None:
    """The suite's tests expect a machine without GPUs: on a GPU host, `auto` world sizes
    would take every GPU and runs would train on CUDA. So this process, and every process a
    test starts (they inherit the environment), sees none: CUDA_VISIBLE_DEVICES="" before any
    test imports torch. The machine's own value and GPU count are kept (tests/gpu.py:
    MACHINE_CUDA_ENV, MACHINE_GPUS_ENV) for the tests marked `gpu`, which run their GPU work
    in a process that sees them (tests/gpu.py). xdist's workers inherit both from the
    controller, whose hook ran first."""
    from ddp_launcher.core.world import visible_gpus

    from tests.gpu import MACHINE_CUDA_ENV, MACHINE_GPUS_ENV, UNSET

    if MACHINE_CUDA_ENV not in os.environ:
        os.environ[MACHINE_GPUS_ENV] = str(visible_gpus())  # no torch import without a driver
        os.environ[MACHINE_CUDA_ENV] = os.environ.get("CUDA_VISIBLE_DEVICES", UNSET)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


@pytest.fixture(autouse=True)
def fresh_hydra_version_base():
    """initialize()/compose(version_base="1.3") sets Hydra's version base for the whole
    process, also from a module- or session-scoped fixture (outside any test); in-process
    sweeps (Hydra's launcher suites) expect a fresh process's. So every test starts and ends
    with the version base of a fresh process."""
    VersionBase.instance().version_base = FRESH_VERSION_BASE
    yield
    VersionBase.instance().version_base = FRESH_VERSION_BASE


@pytest.fixture
def train_config():
    """train.py's config as a launcher composes it (tests/helpers.py: train_composer)."""
    from tests.helpers import train_composer

    with train_composer() as composer:
        yield composer


@pytest.fixture(scope="session")
def two_ranks(wandb_data_dir):
    """Two ranks for the whole run (tests/rank_pool.py): a gloo group of two processes
    without starting them for each test."""
    from tests.rank_pool import RankPool

    pool = RankPool(world_size=2)
    yield pool
    pool.close(wait=30)


@pytest.fixture(scope="session")
def sweep_2x2(tmp_path_factory):
    """One finished 2x2 train.py sweep through the torchrun launcher, read by many tests
    (test_launcher: job dirs, W&B runs, world sizes, parallel jobs, summary, job files;
    test_eval: test columns, evaluating its 1- and 2-rank runs): dist.nproc_per_node=2,1 x
    optim.lr (SWEEP_LRS), two jobs at a time, offline W&B."""
    from tests.helpers import OFFLINE, SWEEP_LRS, SWEEP_SECRET, sweep

    result = sweep(
        tmp_path_factory.mktemp("sweep_2x2") / "sweep",
        "dist.nproc_per_node=2,1",
        f"optim.lr={','.join(SWEEP_LRS)}",
        "hydra.launcher.max_parallel=2",
        # (two jobs at a time share the cores: on 2 of them, a 2-rank job's ranks share one,
        # as intended here; test_one_line has the warning's own tests)
        "hydra.launcher.oversubscribe=true",
        OFFLINE,  # the jobs' and the sweep summary's W&B runs are read back
        TEST_LAUNCHER_SECRET=SWEEP_SECRET,  # must not end up in the job files (test_job_files)
    )
    assert result.proc.returncode == 0, result.out[-5000:]
    return result


@pytest.fixture(autouse=True, scope="session")
def wandb_data_dir(tmp_path_factory):
    """W&B's staging copies of logged artifacts (checkpoints, tables' images), which offline
    runs keep until `wandb sync`, go to a temporary dir, not the user's ~/.local/share/wandb
    (tests/helpers.py's run_env passes WANDB_DATA_DIR on to processes)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WANDB_DATA_DIR", str(tmp_path_factory.mktemp("wandb_data")))
        yield


@pytest.fixture(autouse=True, scope="session")
def wandb_off_by_default():
    """W&B's service costs every run seconds: runs in this process are disabled unless a test
    asks for wandb.mode=offline (tests/helpers.py's OFFLINE), as run_env makes them in the
    processes tests start. (conf/wandb/default.yaml: mode ${oc.env:WANDB_MODE,auto}.)"""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WANDB_MODE", "disabled")
        yield


# Module- and session-scoped fixtures cheap enough to build once per xdist worker; every other
# such fixture (a trained run, a sweep, the SLURM cluster) is built once per run: the tests
# that share one go to the same worker (below).
PER_WORKER = frozenset({"two_ranks", "wandb_data_dir", "wandb_off_by_default", "rng", "digits"})


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: one worker per core. The tests' processes are what loads the cores (a
    2-rank job is two of them), so more workers than cores only queue."""
    return max(1, len(os.sched_getaffinity(0)))


def skip_gpu_tests_without_gpus(items) -> None:
    """Tests marked `gpu` run where the machine has a CUDA GPU, and are skipped elsewhere."""
    from tests.gpu import machine_gpus

    if machine_gpus() == 0:
        skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the xdist_group marks
def pytest_collection_modifyitems(config, items) -> None:
    """Tests that share an expensive module- or session-scoped fixture of this suite, directly
    or through another test, get one xdist_group: `--dist loadgroup` runs each group on one
    worker, so the fixture is built once (the SLURM cluster, one per machine, included).
    pytest's and plugins' own session fixtures (tmp_path_factory) would join every test into
    one group: only fixtures written under tests/ count. Also: `gpu` tests skip without GPUs."""
    skip_gpu_tests_without_gpus(items)
    parent: dict[str, str] = {}

    def find(key: str) -> str:
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    shared: dict[int, list[str]] = {}
    for i, item in enumerate(items):
        info = getattr(item, "_fixtureinfo", None)
        keys = []
        for name, defs in info.name2fixturedefs.items() if info else ():
            scope = defs[-1].scope
            if name in PER_WORKER or scope not in ("module", "session"):
                continue
            written = Path(inspect.getfile(defs[-1].func))
            if not any(written.is_relative_to(folder) for folder in TESTS):
                continue
            keys.append(f"{item.module.__name__}::{name}" if scope == "module" else name)
        for key in keys[1:]:
            parent[find(key)] = find(keys[0])
        shared[i] = keys
    for i, keys in shared.items():
        if keys:
            items[i].add_marker(pytest.mark.xdist_group(find(keys[0]).replace("::", ".")))


def pytest_terminal_summary(terminalreporter) -> None:
    """One line at the end when SLURM tests skipped, and one when tests on several hosts
    (tests/hosts.py) did: how many, why, how to run them."""
    from tests.hosts import SKIP_REASON as HOSTS_SKIP_REASON
    from tests.slurm_cluster import INSTALL_ENV, SKIP_REASON

    def skipped(why: str) -> list[str]:
        reasons = []
        for report in terminalreporter.stats.get("skipped", []):
            longrepr = report.longrepr
            reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
            if why in reason:
                reasons.append(reason.split(why, 1)[1].lstrip(": "))
        return reasons

    if reasons := skipped(SKIP_REASON):
        terminalreporter.write_line(
            f"{len(reasons)} SLURM tests skipped ({reasons[0]}): run `python -m pytest` as "
            f"root on a machine with apt-get (and without {INSTALL_ENV}=0), or install "
            "slurm-wlm and munge, to run them",
            yellow=True,
            bold=True,
        )
    if reasons := skipped(HOSTS_SKIP_REASON):
        terminalreporter.write_line(
            f"{len(reasons)} tests on several hosts skipped ({reasons[0]}): run `python -m "
            "pytest` as root (network namespaces: iproute2 and util-linux) to run them",
            yellow=True,
            bold=True,
        )
