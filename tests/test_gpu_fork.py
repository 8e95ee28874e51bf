"""Every rank can use CUDA however it starts (on this CPU machine: torch's own "bad fork" flag,
which it sets with or without a GPU), every job gets the GPUs it was given, and jobs that run at
once share the CPU cores without overlap.

A rank forked after its parent called into the CUDA driver (even torch.cuda.is_available())
dies at its first CUDA call on a GPU node. The ranks of the torchrun launcher are forked (from
the warm start's server, through each job's agent), so each way a rank starts is run here with
tests/gpu_probe.py as the dataset: every rank writes down torch's bad-fork flag.

Every one of those runs is also a CPU-only torch's run: tests/cpu_only_torch/ (first on
PYTHONPATH) removes torch._C._cuda_isInBadFork in every process, as torch's CPU wheels lack it,
and each rank records that it was gone. torch's own reading of the flag still works there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ddp_launcher.core import world
from ddp_launcher.jobs import Job
from ddp_launcher.torchrun import TorchrunBackend, TorchrunLauncherConf, single_run_settings

import tests.helpers as fx
from data import loaders
from tests.gpu_probe import LOG_ENV

PROBE = "dataset._target_=tests.gpu_probe.digits"
# A CPU-only torch in every process started with it (and forked from one).
CPU_ONLY_TORCH = {
    "PYTHONPATH": os.pathsep.join([str(fx.REPO / "tests" / "cpu_only_torch"), fx.IMPORT_PATH])
}


def probed(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def run_probed(cmd: list[str], log: Path, **env: str) -> list[dict]:
    """Run `cmd` to success with a CPU-only torch; the probe's records of every rank, each
    checked to have run without torch._C's bad-fork probe."""
    proc = fx.run(cmd, timeout=300, **{LOG_ENV: str(log)}, **{**CPU_ONLY_TORCH, **env})
    assert proc.returncode == 0, fx.output(proc)[-4000:]
    ranks = probed(log)
    assert ranks and not any(r["probe_compiled"] for r in ranks), ranks
    return ranks


@pytest.mark.slow
def test_the_cpu_only_torch_of_these_tests_lacks_the_probe() -> None:
    """tests/cpu_only_torch/ removes what torch's CPU wheels do not compile, in a process and
    in its forks; torch as installed has it (else the faker would prove nothing)."""
    code = (
        "import os, torch\n"
        "print(hasattr(torch._C, '_cuda_isInBadFork'), flush=True)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    print(hasattr(torch._C, '_cuda_isInBadFork'), flush=True)\n"
        "    os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
    )
    cmd = [sys.executable, "-c", code]
    assert fx.run(cmd, timeout=120, **CPU_ONLY_TORCH).stdout.split() == ["False", "False"]
    assert fx.run(cmd, timeout=120).stdout.split() == ["True", "True"]


def assert_no_bad_fork(ranks: list[dict], expected: int) -> None:
    assert len(ranks) == expected, ranks
    bad = [r for r in ranks if r["bad_fork"]]
    assert not bad, f"{len(bad)} of {len(ranks)} ranks are CUDA bad forks: {bad}"


# How each way a rank starts is run, and how many ranks build a dataset there.
STARTS = {
    "python train.py dist.nproc_per_node=2": (["dist.nproc_per_node=2"], 2),
    "a sweep of a 1-rank and a 2-rank job": (["-m", "dist.nproc_per_node=1,2"], 3),
    "two sweep jobs at once": (["-m", "seed=1,2", "hydra.launcher.max_parallel=2"], 2),
    "Optuna trials": (["hparams_search=digits_optuna", "hydra.sweeper.n_trials=2"], 2),
}


@pytest.mark.slow
@pytest.mark.parametrize("start", list(STARTS))
def test_no_rank_is_a_cuda_bad_fork(start: str, tmp_path: Path) -> None:
    overrides, expected = STARTS[start]
    where = "hydra.sweep.dir" if "-m" in overrides or "Optuna" in start else "hydra.run.dir"
    cmd = fx.train_cmd(*overrides, PROBE, *fx.QUICK, f"{where}={tmp_path / 'out'}")
    assert_no_bad_fork(run_probed(cmd, tmp_path / "probe.jsonl"), expected)


@pytest.mark.slow
def test_no_rank_of_a_retried_job_is_a_cuda_bad_fork(tmp_path: Path) -> None:
    """The job's first attempt fails at step 1 (after its ranks built their data), the
    launcher starts it again: both attempts' ranks come from the warm start."""
    cmd = fx.train_cmd(
        "-m",
        "hydra.launcher.retries=1",
        "dist.nproc_per_node=2",
        PROBE,
        *fx.QUICK,
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    )
    ranks = run_probed(cmd, tmp_path / "probe.jsonl", HYDRA_DDP_FAULT="raise@1:1")
    assert_no_bad_fork(ranks, 4)
    assert sorted({r["attempt"] for r in ranks}) == ["1", "2"]


@pytest.mark.slow
def test_no_rank_of_eval_or_plain_torchrun_is_a_cuda_bad_fork(tmp_path: Path) -> None:
    """eval.py through the launcher (its ranks are forked as train.py's are), and plain
    torchrun (it starts every rank as a new process)."""
    log, run_dir = tmp_path / "probe.jsonl", tmp_path / "run"
    cmd = fx.train_cmd(PROBE, *fx.QUICK, f"hydra.run.dir={run_dir}", nproc=2)
    assert_no_bad_fork(run_probed(cmd, log), 2)
    cmd = fx.eval_cmd(f"run={run_dir}", "dist.nproc_per_node=2", f"hydra.run.dir={tmp_path}/e")
    assert_no_bad_fork(run_probed(cmd, log), 4)


@pytest.mark.slow
def test_a_server_that_called_cuda_forks_no_job(tmp_path: Path) -> None:
    """A task whose module asks CUDA something when imported (the warm start imports it once
    for every job) would make every job a bad fork: the server sees it, and the job stops with
    one line naming the cause instead of failing at its first CUDA call."""
    app = tmp_path / "cuda_at_import.py"
    app.write_text(
        "import torch\n"
        "torch.cuda.is_available()  # asks the CUDA driver: every later fork is a bad fork\n"
        "import conf.schema  # the typed config, as train.py registers it\n"
        "from ddp_launcher.ranks.entry import entry_point\n"
        "from ddp_launcher.torchrun import run_task_or_hand_off\n\n"
        "def main(cfg):\n    return 0\n\n"
        "if __name__ == '__main__':\n"
        f"    entry_point({str(fx.REPO / 'train.py')!r}, 'cuda_at_import:main', 'train',\n"
        "                hand_off=run_task_or_hand_off)\n"
    )
    proc = fx.run(
        [
            sys.executable,
            str(app),
            "dist.nproc_per_node=2",
            *fx.QUICK,
            f"hydra.run.dir={tmp_path}/r",
        ],
        PYTHONPATH=os.pathsep.join([str(tmp_path), CPU_ONLY_TORCH["PYTHONPATH"]]),
    )
    out = fx.output(proc)
    assert proc.returncode != 0, out
    assert "a call into the CUDA driver (every process it forks is a CUDA bad fork)" in out, out
    assert "Cannot re-initialize CUDA" not in out and "Traceback" not in out, out


@pytest.mark.slow
def test_a_rank_in_a_bad_fork_stops_with_one_line_before_any_cuda_call() -> None:
    """ddp_launcher/ranks/forked.py's check, in a process forked after its parent asked CUDA (with
    a CPU-only torch's torch._C)."""
    code = (
        "import os, sys, torch\n"
        "from ddp_launcher.ranks.forked import check_not_a_bad_fork\n"
        "check_not_a_bad_fork()  # a clean process: nothing to say\n"
        "torch.cuda.is_available()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    try:\n"
        "        check_not_a_bad_fork()\n"
        "    except Exception as e:\n"
        "        print(type(e).__name__, e, flush=True)\n"
        "        os._exit(2)\n"
        "    os._exit(0)\n"
        "sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n"
    )
    proc = fx.run([sys.executable, "-c", code], timeout=120, **CPU_ONLY_TORCH)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stdout.splitlines()
    assert line.startswith("BadFork ") and "called into the CUDA driver" in line, line


# ---------------------------------------------------------------------------------------------
# GPUs and CPU cores a job is given


def job(num: int, nproc: int, gpus: bool) -> Job:
    job = Job(num, [], Path(f"/tmp/{num}"), None, in_sweep=False)
    job.nproc, job.nnodes, job.uses_gpus = nproc, 1, gpus
    return job


def test_jobs_get_the_launchers_gpus_as_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """A faked node of 8 GPUs, the launcher given 4 of them, written as ids, a UUID and a MIG
    instance: each job's CUDA_VISIBLE_DEVICES is a disjoint subset of those entries, as
    written, and hydra.launcher.gpus indexes into that list."""
    # NVIDIA's device nodes, as a launcher that has not imported torch counts them
    monkeypatch.setattr(world.glob, "glob", lambda p: [f"/dev/nvidia{i}" for i in range(8)])
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,GPU-8d1b6e2a,MIG-3c4d5e6f")
    assert world.visible_gpu_ids() == ["4", "5", "GPU-8d1b6e2a", "MIG-3c4d5e6f"]
    backend = TorchrunBackend(TorchrunLauncherConf(), cores=[0, 1, 2, 3])
    first, second = job(0, 2, True), job(1, 2, True)
    visible = []
    for j in (first, second):
        gpus, cpus = backend.reserve(j)
        visible.append(backend.job_env(j, gpus, cpus)["CUDA_VISIBLE_DEVICES"])
    assert visible == ["4,5", "GPU-8d1b6e2a,MIG-3c4d5e6f"]

    backend = TorchrunBackend(TorchrunLauncherConf(gpus=[1, 3]), cores=[0, 1])
    gpus, cpus = backend.reserve(first)
    assert backend.job_env(first, gpus, cpus)["CUDA_VISIBLE_DEVICES"] == "5,MIG-3c4d5e6f"
    with pytest.raises(Exception, match=r"hydra.launcher.gpus=\[4\]: positions"):
        TorchrunBackend(TorchrunLauncherConf(gpus=[4]))


def test_jobs_that_run_at_once_share_the_cores_without_overlap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 112-core node with 8 GPUs, 8 one-GPU jobs at once: each job gets its own 14 cores,
    and the threads and DataLoader workers of all of them together stay within 112 (not
    8 x 112 threads and 8 x 111 workers)."""
    cores = list(range(112))
    backend = TorchrunBackend(
        TorchrunLauncherConf(), gpu_ids=[str(g) for g in range(8)], cores=cores
    )
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = workers = 0
    seen: set[int] = set()
    for num in range(8):
        j = job(num, 1, True)
        gpus, cpus = backend.reserve(j)
        assert len(cpus) == 14 and not seen & set(cpus)
        seen |= set(cpus)
        threads += int(backend.job_env(j, gpus, cpus)["OMP_NUM_THREADS"])
        monkeypatch.setattr(world, "usable_cores", lambda c=cpus: c)  # what the rank inherits
        workers += loaders.data_workers("auto", 1)
    assert backend.reserve(job(8, 1, True)) is None  # all 8 GPUs busy
    assert seen == set(cores) and threads <= 112 and workers <= 112
    # One job alone keeps the whole machine, and sets no affinity.
    alone = TorchrunBackend(TorchrunLauncherConf(), gpu_ids=[], cores=cores)
    gpus, cpus = alone.reserve(job(0, 2, False))
    assert cpus is None and alone.job_env(job(0, 2, False), gpus, cpus)["OMP_NUM_THREADS"] == "56"


def test_a_jobs_cores_follow_its_share_of_the_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """A faked 8-GPU, 112-core node. A job with every GPU (`python train.py` there: nproc auto)
    gets all 112 cores: OMP_NUM_THREADS=14 and 13 DataLoader workers per rank, not 14 cores
    for 8 ranks (1 thread, no worker). Two 4-GPU jobs get disjoint halves; when one ends, two
    2-GPU jobs split its half. CPU jobs, max_parallel at once, get 1/max_parallel each."""
    cores = list(range(112))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)

    def node(**settings: object) -> TorchrunBackend:
        conf = TorchrunLauncherConf(**settings)
        return TorchrunBackend(conf, gpu_ids=[str(g) for g in range(8)], cores=cores)

    def rank_share(backend: TorchrunBackend, j: Job, slot: tuple) -> tuple[int, int, int]:
        """(the job's cores, threads and DataLoader workers of each of its ranks), the ranks'
        affinity being the job's slice (ddp_launcher/ranks/agent.py sets it; they inherit it)."""
        gpus, cpus = slot
        threads = int(backend.job_env(j, gpus, cpus)["OMP_NUM_THREADS"])
        mine = cores if cpus is None else cpus
        monkeypatch.setattr(world, "usable_cores", lambda: list(mine))
        return len(mine), threads, loaders.data_workers("auto", j.nproc)

    backend = node()
    whole = job(0, 8, True)
    slot = backend.reserve(whole)
    assert rank_share(backend, whole, slot) == (112, 14, 13)
    backend.release(whole, slot)

    a, b = job(1, 4, True), job(2, 4, True)
    slot_a, slot_b = backend.reserve(a), backend.reserve(b)
    assert rank_share(backend, a, slot_a) == rank_share(backend, b, slot_b) == (56, 14, 13)
    assert not set(slot_a[1]) & set(slot_b[1])
    assert backend.reserve(job(3, 2, True)) is None  # no GPU free
    backend.release(a, slot_a)
    quarters = [backend.reserve(job(num, 2, True)) for num in (3, 4)]
    assert [len(cpus) for _, cpus in quarters] == [28, 28]
    assert set(quarters[0][1]) | set(quarters[1][1]) == set(slot_a[1])  # a's, b's untouched

    # `python train.py dist.nproc_per_node=2` there: the only job its process runs, every core
    alone = TorchrunBackend(
        single_run_settings({}), gpu_ids=[str(g) for g in range(8)], cores=cores
    )
    two = job(0, 2, True)
    assert rank_share(alone, two, alone.reserve(two)) == (112, 56, 55)

    cpu_jobs = node(max_parallel=4)
    slices = [cpu_jobs.reserve(job(num, 2, False))[1] for num in range(4)]
    assert [len(cpus) for cpus in slices] == [28] * 4 and len(set().union(*slices)) == 112
    assert cpu_jobs.job_env(job(0, 2, False), [], slices[0])["OMP_NUM_THREADS"] == "14"


@pytest.mark.slow
def test_two_jobs_at_once_run_on_their_own_cores(tmp_path: Path) -> None:
    """Real processes: two sweep jobs at once on this machine's cores, each rank on its job's
    slice (disjoint), its threads and workers sized from it."""
    log = tmp_path / "probe.jsonl"
    cmd = fx.train_cmd(
        "-m",
        "seed=1,2",
        "hydra.launcher.max_parallel=2",
        PROBE,
        *fx.QUICK,
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    )
    ranks = run_probed(cmd, log, OMP_NUM_THREADS="")
    cores = world.usable_cores()
    if len(cores) < 2:
        pytest.skip("one core: two jobs share it")
    a, b = (set(r["cores"]) for r in ranks)
    assert not a & b and a | b <= set(cores), ranks
    assert sum(r["threads"] for r in ranks) <= len(cores), ranks
    assert sum(r["workers"] for r in ranks) <= len(cores), ranks


def test_a_slurm_task_sizes_its_threads_and_workers_from_its_own_cpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A SLURM task of an 8-GPU job on a 112-CPU node (one rank per task, as the SLURM launcher
    starts them), bound to its 14 CPUs (--cpus-per-task): its share is those 14, not 14 divided
    again among the node's 8 local ranks."""
    monkeypatch.setattr(world, "usable_cores", lambda: list(range(14)))
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)  # no agent: the task is the rank
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "14")
    assert world.cores_per_rank(8) == 14 and loaders.data_workers("auto", 8) == 13
    monkeypatch.delenv("SLURM_PROCID")  # not a SLURM task: the node's cores among its ranks
    assert world.cores_per_rank(8) == 1 and loaders.data_workers("auto", 8) == 0


# A 96-CPU node, 8 ranks on it: each way they start inside SLURM (the environment SLURM and the
# starter give each rank; TORCHELASTIC_RUN_ID: a torch elastic agent started it) -> (its local
# world size, its cores): its share of its task's CPUs.
AGENT = {"TORCHELASTIC_RUN_ID": "none"}  # torchrun's without --rdzv-id
SLURM_SHARES = {
    "torchrun --nproc-per-node=8 in an sbatch -c 96 script": (
        {"SLURM_PROCID": "0", "SLURM_CPUS_PER_TASK": "96", **AGENT},
        (8, 12),
    ),
    "python train.py dist.nproc_per_node=8 in an srun -c 96 --pty shell": (
        {"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_CPUS_PER_TASK": "96", **AGENT},
        (8, 12),
    ),
    "srun --ntasks-per-node=2 -c 48 torchrun --nproc-per-node=4": (
        {"SLURM_PROCID": "1", "SLURM_STEP_ID": "1", "SLURM_CPUS_PER_TASK": "48", **AGENT},
        (4, 12),
    ),
    "srun --ntasks-per-node=8 -c 12, one rank per task (the SLURM launcher's way)": (
        {"SLURM_PROCID": "5", "SLURM_STEP_ID": "0", "SLURM_CPUS_PER_TASK": "12"},
        (8, 12),
    ),
}


@pytest.mark.parametrize("how", SLURM_SHARES)
def test_ranks_that_share_a_slurm_task_share_its_cpus(
    monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Ranks inside a SLURM allocation that are not tasks of their own (torchrun in the batch
    script, the launcher in an srun shell) divide their task's CPUs among them: each of 8
    ranks 12 cores and 11 DataLoader workers, not the task's 96 and 95 each (8 x 95 workers
    per persistent loader: ~1,500 processes on the node)."""
    environ, (local_world, cores) = SLURM_SHARES[how]
    monkeypatch.setattr(world, "usable_cores", lambda: list(range(96)))  # unbound: the node's
    for key in [k for k in os.environ if k.startswith(("SLURM_", "TORCHELASTIC_"))]:
        monkeypatch.delenv(key)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    assert world.cores_per_rank(local_world) == cores
    assert loaders.data_workers("auto", local_world) == cores - 1


AFFINITY_SHARE = (
    "import os, sys\n"
    "from ddp_launcher.core.world import cores_per_rank\n"
    "from data.loaders import data_workers\n"
    "local_world = int(sys.argv[1])\n"
    "print(len(os.sched_getaffinity(0)), cores_per_rank(local_world),"
    " data_workers('auto', local_world))\n"
)


@pytest.mark.slow
@pytest.mark.skipif(len(world.usable_cores()) < 2, reason="needs 2 cores to restrict to 1")
def test_threads_and_workers_follow_the_real_affinity() -> None:
    """Real processes started on 1 of this machine's cores (as SLURM binds a task whose srun
    lacked --cpus-per-task, while SLURM_CPUS_PER_TASK still says 2): 1 core, no DataLoader
    worker; on 2 cores the task's 2. Outside SLURM the affinity is shared among the ranks."""
    two = world.usable_cores()[:2]

    def share(cpus: list[int], local_world: int, **env: str) -> list[int]:
        proc = subprocess.run(
            [sys.executable, "-c", AFFINITY_SHARE, str(local_world)],
            cwd=fx.REPO,
            env=fx.run_env(**env),
            capture_output=True,
            text=True,
            timeout=120,
            preexec_fn=lambda: os.sched_setaffinity(0, cpus),
        )
        assert proc.returncode == 0, fx.output(proc)
        return [int(n) for n in proc.stdout.split()]

    slurm = {"SLURM_PROCID": "0", "SLURM_CPUS_PER_TASK": "2"}
    assert share(two[:1], 1, **slurm) == [1, 1, 0]
    assert share(two, 1, **slurm) == [2, 2, 1]
    assert share(two, 2) == [2, 1, 0]
