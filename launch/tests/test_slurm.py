"""The `hydra/launcher=slurm` plugin (ddp_launcher/slurm.py) and ddp_launcher/sbatch_example.sh on
a real
one-node SLURM cluster (tests/slurm_cluster.py: slurm-wlm + munge, started as root; skipped
when that is not possible), with gloo ranks on CPU and offline W&B.

Hydra's own launcher suites run first (as Hydra's launcher plugins test themselves). One 2-job
train.py sweep (dist.nproc_per_node=2, optim.lr=0.05,0.1) is shared by the tests of job dirs,
W&B runs, the summary, and serves as the uninterrupted reference of the preemption test. A
sweep whose launcher is SIGKILLed is resumed: the rerun waits for its SLURM jobs. A tiny
Hydra app (written into a temp dir, no torch) checks what the sweeper receives and how failures
are reported. Then `srun`/`sbatch` by hand: ddp_launcher/slurm.py's mapping,
ddp_launcher/sbatch_example.sh.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
import yaml
from ddp_launcher.core.errors import UserError
from ddp_launcher.core.requeue import (
    MAX_NUM_TIMEOUT_ENV,
    TIMEOUTS_FILE,
    TIMEOUTS_FILE_ENV,
    requeue_on_slurm,
    slurm_seconds,
    timed_out,
)
from ddp_launcher.core.run_dir import read_launch_record, read_result
from ddp_launcher.ranks.slurm_task import (
    expand_nodelist,
    expand_tasks_per_node,
    master_port,
    torch_env,
)
from ddp_launcher.slurm import (
    GPU_TASK_CPUS,
    DDPSlurmQueueConf,
    Submitted,
    app_dirs,
    job_resources,
    python_path_setup,
    sbatch_resources,
)
from ddp_launcher.slurm_queue import cpus_per_gpu_in_sinfo, gpus_in_gres
from hydra import version as hydra_version
from hydra.core.plugins import Plugins
from hydra.plugins.launcher import Launcher
from hydra.test_utils.launcher_common_tests import IntegrationTestSuite, LauncherTestSuite
from hydra.version import VersionBase
from hydra_plugins.hydra_ddp_launcher.slurm_launcher import DDPSlurmLauncher
from omegaconf import OmegaConf
from test_pruning import check_pruned, pruned_sweep

from components.checkpoint import load_checkpoint
from tests.helpers import (
    IMPORT_PATH,
    OFFLINE,
    REPO,
    RUN_DIR_ENTRIES,
    Sweep,
    offline_runs,
    output,
    read_json,
    run,
    run_env,
    summary_rows,
    train_cmd,
    wait_for_rows,
)

if TYPE_CHECKING:
    from tests.slurm_cluster import SlurmCluster

pytest_plugins = ["tests.slurm_cluster"]

# 2 epochs of 89 steps (digits: 1437 samples // 16): long enough to be preempted mid-run.
JOB = [
    "trainer.max_epochs=2",
    "trainer.batch_size=16",
    "trainer.log_every_n_steps=5",
    "trainer.checkpoint_every_n_steps=40",
    "model.dropout=0.1",
    "seed=7",
    "trainer.progress_bar=false",
]
POLL_S = 0.25  # the launcher's squeue interval: each call takes milliseconds
SLURM = [
    "hydra/launcher=slurm",
    f"hydra.launcher.poll_interval_s={POLL_S}",
    "hydra.launcher.cpus_per_task=1",
]
LRS = ("0.05", "0.1")
# Rank 0 writes exactly these into a train.py job dir; rank 1 nothing; the launcher launch.json.
JOB_DIR_ENTRIES = SWEEP_JOB_DIR_ENTRIES = RUN_DIR_ENTRIES


# ---------------------------------------------------------------------------------------------
# SLURM -> torch variables, and per-job resources (no cluster)


def test_expand_nodelist_and_tasks_per_node() -> None:
    assert expand_nodelist("vm") == ["vm"]
    assert expand_nodelist("gpu[01-03,7],cpu1") == ["gpu01", "gpu02", "gpu03", "gpu7", "cpu1"]
    assert expand_nodelist("a[1-2]-ib[3,4]") == ["a1-ib3", "a1-ib4", "a2-ib3", "a2-ib4"]
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("8") == [8]


def test_torch_env_from_slurm_variables() -> None:
    """Rank 5 of 2 nodes x 4 tasks: node 1, local rank 1; rendezvous at the first node."""
    slurm = {
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS": "8",
        "SLURM_STEP_NUM_TASKS": "8",
        "SLURM_STEP_NODELIST": "node[07-08]",
        "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
        "SLURM_NODEID": "1",
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
    }
    env = torch_env(slurm)
    assert env == {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "node07",
        "MASTER_PORT": str(master_port("4242")),
    }
    # A requeued job meets at another port (never the old store); the sbatch script agrees.
    assert master_port("4242", 1) != master_port("4242") == 20000 + 4242
    assert master_port("4242", 1) == 20000 + (4242 + 7919) % 40000
    with pytest.raises(UserError, match="not a SLURM task"):
        torch_env({})


def resources(config, gpus: int) -> dict:
    return job_resources(config, DDPSlurmQueueConf.from_config(config.hydra.launcher), gpus)


def test_job_resources_follow_each_jobs_world_size(train_config) -> None:
    """Tasks per node = dist.nproc_per_node (auto: the node's GPUs, 1 on CPU), nodes =
    dist.nnodes; GPU jobs ask for one GPU per task; the sbatch/srun options for preemption."""
    config = functools.partial(train_config.compose, "hydra/launcher=slurm")
    cpu = resources(config(), gpus=0)
    assert (cpu["nodes"], cpu["tasks_per_node"]) == (1, 1) and "gpus_per_node" not in cpu
    assert cpu["slurm_additional_parameters"] == {"signal": "USR1@120", "requeue": True}
    assert cpu["slurm_srun_args"] == ["--kill-on-bad-exit=1"]
    two = resources(config("dist.nproc_per_node=2", "dist.nnodes=3"), gpus=0)
    assert (two["nodes"], two["tasks_per_node"]) == (3, 2)
    gpu = resources(config(), gpus=8)
    assert (gpu["tasks_per_node"], gpu["gpus_per_node"]) == (8, 8)
    part = resources(config("dist.nproc_per_node=2"), gpus=8)
    assert (part["tasks_per_node"], part["gpus_per_node"]) == (2, 2)
    gloo = resources(config("dist=cpu"), gpus=8)  # CPU ranks on a GPU node
    assert gloo["tasks_per_node"] == 1 and "gpus_per_node" not in gloo
    fixed = resources(config("hydra.launcher.tasks_per_node=4"), gpus=0)
    assert fixed["tasks_per_node"] == 4
    extra = resources(
        config(
            "hydra.launcher.signal_delay_s=300",
            "hydra.launcher.requeue=false",
            "+hydra.launcher.additional_parameters.reservation=r1",
            "hydra.launcher.partition=gpu",
        ),
        gpus=0,
    )
    assert extra["slurm_additional_parameters"] == {
        "signal": "USR1@300",
        "no-requeue": True,
        "reservation": "r1",
    }
    assert extra["slurm_partition"] == "gpu"
    with pytest.raises(UserError, match="asks for 16 GPUs per node"):
        resources(config("dist.nproc_per_node=16"), gpus=8)
    with pytest.raises(UserError, match="hydra.launcher.tasks_per_node=4"):
        resources(config("dist.nproc_per_node=2", "hydra.launcher.tasks_per_node=4"), 0)
    with pytest.raises(UserError, match="gpus_per_task"):
        resources(config("hydra.launcher.gpus_per_task=1"), gpus=8)


def test_gpus_per_node_is_the_request_per_node_as_submitit_means_it(train_config, tmp_path) -> None:
    """hydra.launcher.gpus_per_node=N requests N GPUs per node (sbatch --gpus-per-node=N), as
    hydra-submitit-launcher's key does, whatever a node has: a GPU job's ranks per node (auto)
    are then N, fewer ranks leave GPUs of the request unused, more is one line; 0 requests
    none (a CPU job). auto (the default) requests one per rank."""
    config = functools.partial(train_config.compose, "hydra/launcher=slurm")
    four = resources(config("hydra.launcher.gpus_per_node=4"), gpus=8)
    assert (four["tasks_per_node"], four["gpus_per_node"]) == (4, 4)
    two = resources(config("hydra.launcher.gpus_per_node=4", "dist.nproc_per_node=2"), gpus=8)
    assert (two["tasks_per_node"], two["gpus_per_node"]) == (2, 4)
    with pytest.raises(UserError, match="hydra.launcher.gpus_per_node=4 requests 4"):
        resources(config("hydra.launcher.gpus_per_node=4", "dist.nproc_per_node=8"), gpus=8)
    none = resources(config("hydra.launcher.gpus_per_node=0"), gpus=8)
    assert none["tasks_per_node"] == 1 and "gpus_per_node" not in none
    assert resources(config("dist.nproc_per_node=2"), gpus=8)["gpus_per_node"] == 2  # auto
    # what sbatch gets: the request, beside 2 tasks per node
    script = sbatch_resources(Submitted(job=None, params=two, folder=str(tmp_path)))
    assert "--gpus-per-node=4" in script and "--ntasks-per-node=2" in script, script


def test_a_time_limit_requeues_at_most_max_num_timeout_times(tmp_path, monkeypatch) -> None:
    """hydra.launcher.max_num_timeout, submitit's meaning: a job at its time limit (it ran at
    least min(80 % of its limit, limit - 10 min)) is requeued that many times, counted in its
    job dir; after that it is not (one warning), while a job preempted earlier is requeued
    whatever the count. The batch script exports the limit (job_resources)."""
    fake_bin, calls = tmp_path / "bin", tmp_path / "calls"
    fake_bin.mkdir()
    (fake_bin / "scontrol").write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {calls}\n'
        'if [ "$1" = show ]; then echo "JobId=42 JobState=RUNNING Requeue=1 '
        'RunTime=$FAKE_RUNTIME TimeLimit=01:00:00"; fi\n'
    )
    (fake_bin / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_bin}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv(MAX_NUM_TIMEOUT_ENV, "2")
    monkeypatch.setenv(TIMEOUTS_FILE_ENV, str(tmp_path / TIMEOUTS_FILE))
    monkeypatch.setenv("FAKE_RUNTIME", "00:58:00")  # USR1 120 s before the hour
    assert requeue_on_slurm() and requeue_on_slurm()
    assert not requeue_on_slurm()  # a third time limit
    assert calls.read_text().count("requeue 42") == 2
    monkeypatch.setenv("FAKE_RUNTIME", "00:05:00")  # preempted: requeued whatever the count
    assert requeue_on_slurm() and calls.read_text().count("requeue 42") == 3
    assert (tmp_path / TIMEOUTS_FILE).read_text().strip() == "2"
    assert timed_out("RunTime=00:48:00 TimeLimit=01:00:00")
    assert not timed_out("RunTime=00:47:59 TimeLimit=01:00:00")
    assert timed_out("RunTime=00:00:30 TimeLimit=00:01:00")  # limit - 10 min < 0
    assert not timed_out("RunTime=1-02:00:00 TimeLimit=UNLIMITED")
    assert slurm_seconds("1-02:03:04") == 93784
    job = resources(
        OmegaConf.create({"hydra": {"launcher": {"max_num_timeout": 5}}}),
        gpus=0,
    )
    assert f"export {MAX_NUM_TIMEOUT_ENV}=5" in job["slurm_setup"]


def test_tasks_import_the_apps_folders_never_site_packages(tmp_path, monkeypatch) -> None:
    """SLURM tasks unpickle the job by reference to the app's modules: the batch script puts
    the app's folders on PYTHONPATH (its task module's, for a function and for the entry
    point's "module:function"), never an installed package's folder (site-packages)."""
    from ddp_launcher.ranks.bootstrap import run_task
    from hydra.utils import instantiate  # a function of an installed package

    app = tmp_path / "app"
    app.mkdir()
    (app / "my_task.py").write_text("def main(cfg):\n    return 1\n")
    monkeypatch.syspath_prepend(str(app))
    import my_task

    for task in (my_task.main, functools.partial(run_task, "my_task:main")):
        found = app_dirs(task)
        assert found[0] == str(app.resolve()), found
        assert not any("site-packages" in d for d in found), found
    assert not any("site-packages" in d for d in app_dirs(instantiate))
    (setup,) = python_path_setup([str(app), "/other app"])
    assert setup == f"export PYTHONPATH='{app}{os.pathsep}/other app'${{PYTHONPATH:+:$PYTHONPATH}}"
    assert python_path_setup([]) == []


def test_gpu_jobs_get_the_nodes_cpus_per_gpu_by_default(train_config) -> None:
    """hydra.launcher.cpus_per_task=null: each task (rank) of a GPU job gets its GPU's share of
    the node's CPUs (sinfo's CPUs / GPUs), GPU_TASK_CPUS where sinfo cannot tell; not SLURM's
    default of 1 (one thread and no DataLoader workers per rank). CPU jobs keep the cluster's
    default; an explicit cpus_per_task or cpus_per_gpu wins."""
    config = functools.partial(train_config.compose, "hydra/launcher=slurm")

    def cpus(*overrides: str, gpus: int = 8, per_gpu: int | None = 14) -> int | None:
        settings = DDPSlurmQueueConf.from_config(config(*overrides).hydra.launcher)
        return job_resources(config(*overrides), settings, gpus, per_gpu).get("cpus_per_task")

    assert cpus() == 14 and cpus("dist.nproc_per_node=2") == 14
    assert cpus(per_gpu=None) == GPU_TASK_CPUS > 1
    assert cpus(gpus=0) is None and cpus("dist=cpu") is None  # CPU ranks: the cluster's default
    assert cpus("hydra.launcher.cpus_per_task=6") == 6
    assert cpus("hydra.launcher.cpus_per_gpu=6") is None  # SLURM's --cpus-per-gpu does it
    # sinfo --format="%c %G": CPUs and gres per kind of node; the smallest share of GPU nodes
    assert cpus_per_gpu_in_sinfo("112 gpu:h100:8(S:0-1)\n64+ gpu:4\n16 (null)\n") == 14
    assert cpus_per_gpu_in_sinfo("16 (null)\n") is None


def test_gpus_in_gres() -> None:
    assert gpus_in_gres("(null)\n") == 0
    assert gpus_in_gres("gpu:8\ngpu:4(S:0)") == 8
    assert gpus_in_gres("gpu:a100:4(S:0-1),shard:8") == 4


def test_discovery() -> None:
    names = [x.__name__ for x in Plugins.instance().discover(Launcher)]
    assert DDPSlurmLauncher.__name__ in names


# ---------------------------------------------------------------------------------------------
# Hydra's launcher test suites on the cluster (hydra.test_utils apps: no `dist`, 1 task a job)


@pytest.fixture
def cluster_env(idle_cluster: SlurmCluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The suites launch from this process (and `python task.py` subprocesses of a temp dir):
    they need the cluster's SLURM_CONF and the repo (plugin, launch/) on the import path, and
    Hydra's version base as in a fresh process (an earlier test's compose() sets it to 1.3
    for the whole process, which turns off the chdir the suite's apps expect)."""
    for key, value in idle_cluster.env.items():
        monkeypatch.setenv(key, value)
    rest = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([IMPORT_PATH, *([rest] if rest else [])]))
    version_base = VersionBase.instance().getbase()
    VersionBase.instance().version_base = hydra_version._UNSPECIFIED_
    try:
        yield
    finally:
        VersionBase.instance().version_base = version_base


@pytest.mark.slow
@pytest.mark.usefixtures("cluster_env")
@pytest.mark.parametrize(
    "launcher_name, overrides", [("ddp_slurm", [f"hydra.launcher.poll_interval_s={POLL_S}"])]
)
class TestSlurmLauncher(LauncherTestSuite):
    """Hydra's launcher suite: in-process sweeps; each job a SLURM job."""


@pytest.mark.slow
@pytest.mark.usefixtures("cluster_env")
@pytest.mark.parametrize(
    "task_launcher_cfg, extra_flags",
    [
        (
            {},
            [
                "-m",
                "hydra/job_logging=hydra_debug",
                "hydra/job_logging=disabled",
                "hydra/launcher=ddp_slurm",
                f"hydra.launcher.poll_interval_s={POLL_S}",
            ],
        )
    ],
)
class TestSlurmLauncherIntegration(IntegrationTestSuite):
    """Hydra's integration suite: `python task.py -m ...` apps written into a temp dir."""


# ---------------------------------------------------------------------------------------------
# helpers for the cluster tests


def task_logs(sweep_dir: Path, task: int, kind: str = "err") -> str:
    """submitit's stderr (or stdout: kind="out") files of one task (rank) of every SLURM job
    of a sweep."""
    paths = sorted(sweep_dir.glob(f".submitit/*/*_{task}_log.{kind}"))
    return "\n".join(p.read_text(errors="replace") for p in paths)


# ---------------------------------------------------------------------------------------------
# a train.py sweep: two 2-task jobs


@pytest.fixture(scope="module")
def sweep(slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Sweep:
    slurm_cluster.wait_until_idle()
    sweep_dir = tmp_path_factory.mktemp("slurm_sweep") / "sweep"
    cmd = train_cmd(
        "-m",
        *SLURM,
        f"hydra.sweep.dir={sweep_dir}",
        *JOB,
        OFFLINE,  # the jobs' W&B runs are read back
        "dist.nproc_per_node=2",
        f"optim.lr={','.join(LRS)}",
    )
    result = Sweep(sweep_dir, run(cmd, timeout=300, **slurm_cluster.env))
    assert result.proc.returncode == 0, result.out[-5000:]
    return result


@pytest.mark.slow
def test_sweep_jobs_are_2_rank_slurm_jobs(sweep: Sweep) -> None:
    """Each job: one SLURM job of 2 tasks (ranks), a complete Hydra job dir written by rank 0
    only, DDP over both ranks (the per-rank memory list is all-gathered), one array for both."""
    assert sorted(p.name for p in sweep.dir.iterdir() if p.is_dir()) == [
        ".submitit",
        "0",
        "1",
        "wandb",
    ]
    for num, lr in enumerate(LRS):
        job = sweep.job(num)
        assert {p.name for p in job.iterdir()} == SWEEP_JOB_DIR_ENTRIES, sorted(job.iterdir())
        overrides = yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text())
        assert f"optim.lr={lr}" in overrides
        hydra_cfg = yaml.safe_load((job / ".hydra" / "hydra.yaml").read_text())["hydra"]
        assert hydra_cfg["job"]["num"] == num and "_" in hydra_cfg["job"]["id"]  # array task
        assert "val/acc" in (job / "train.log").read_text()
        result = read_json(job / "result.json")
        assert result["status"] == "completed" and result["error"] is None, result
        assert len(result["app"]["peak_memory_mb_per_rank"]) == 2
    # One array of two 2-task jobs, preemption-ready.
    (script,) = sweep.dir.glob(".submitit/.submission_file_*.sh")
    text = script.read_text()
    for line in (
        "--array=0-1%",
        "--ntasks-per-node=2",
        "--nodes=1",
        "--signal=USR1@120",
        "--requeue",
        "--kill-on-bad-exit=1",
    ):
        assert line in text, text
    # Rank 1 ran in every job and printed no error (its only output is errors).
    assert task_logs(sweep.dir, 1, "out").count("Starting with JobEnvironment") == 2
    rank1 = task_logs(sweep.dir, 1)
    assert "Traceback" not in rank1 and "ERROR" not in rank1, rank1
    # The console: the array's SLURM id, one line per finished job, the summary table.
    assert "#0-#1: SLURM job array " in sweep.out, sweep.out
    for num, lr in enumerate(LRS):
        (line,) = [x for x in sweep.out.splitlines() if f"[HYDRA] #{num} completed  " in x]
        assert "val/acc=" in line and line.endswith(f"  lr={lr}"), line


@pytest.mark.slow
def test_sweep_wandb_runs(sweep: Sweep) -> None:
    """One offline W&B run per job, from rank 0, and the sweep-summary run, in one group; each
    job's run named by the job's swept values."""
    runs = offline_runs(sweep.dir)
    by_job = {r.path.relative_to(sweep.dir).parts[0]: r for r in runs}
    assert len(runs) == 3 and sorted(by_job) == ["0", "1", "wandb"], [r.path for r in runs]
    assert len({r.group for r in runs}) == 1 and runs[0].group
    assert by_job["wandb"].job_type == "sweep_summary"
    for num, lr in enumerate(LRS):
        wb = by_job[str(num)]
        assert wb.name == f"{num}:lr={lr}", wb.name
        assert wb.config["run"]["world_size"] == 2 and wb.exit_code == 0
        assert any("val/acc" in h for h in wb.history)


@pytest.mark.slow
def test_sweep_summary(sweep: Sweep) -> None:
    """The multirun's summary lists both jobs with rank 0's result.json numbers."""
    rows = {r["job"]: r for r in summary_rows(sweep.dir)}
    assert sorted(rows) == ["0", "1"]
    for num in range(2):
        result = read_json(sweep.job(num) / "result.json")
        assert rows[str(num)]["status"] == "completed"
        assert float(rows[str(num)]["best"]) == pytest.approx(result["value"])
    assert "Sweep summary" in sweep.out


# ---------------------------------------------------------------------------------------------
# preemption: USR1 -> checkpoint -> requeue -> exact resume


def weights(job_dir: Path) -> dict:
    return load_checkpoint(job_dir / "checkpoints" / "last.pt")["model"]


def metric_rows(job_dir: Path) -> list[dict]:
    keep = ("step", "epoch", "train/loss", "lr", "val/loss", "val/acc", "val/count")
    rows = [json.loads(x) for x in (job_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in keep if k in r} for r in rows]


@pytest.mark.slow
def test_usr1_checkpoints_requeues_and_resumes_exactly(
    sweep: Sweep, idle_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """`scancel --signal=USR1` mid-run: the ranks checkpoint at an agreed step, rank 0 requeues
    the job, the requeued job resumes in the same job dir and W&B run, and ends with the weights
    of the uninterrupted sweep job #0 (same config)."""
    sweep_dir = tmp_path / "preempted"
    cmd = train_cmd(
        "-m",
        *SLURM,
        f"hydra.sweep.dir={sweep_dir}",
        *JOB,
        OFFLINE,
        "dist.nproc_per_node=2",
        f"optim.lr={LRS[0]}",
        "trainer.preemption_check_every_n_steps=1",
    )
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=run_env(**idle_cluster.env),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        job = sweep_dir / "0"
        wait_for_rows(job / "metrics.jsonl", 1, proc)
        (job_id,) = idle_cluster.job_ids()
        signalled = idle_cluster.run("scancel", "--signal=USR1", job_id)
        assert signalled.returncode == 0, signalled.stderr
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-5000:]
    log = (job / "train.log").read_text()
    assert "preempted at step" in log, f"the run ended before USR1 arrived?\n{log}"
    assert "restart 1 of the SLURM job" in log and "resumed from" in log, log
    assert f"SLURM job {job_id}) requeued" in out, out[-3000:]
    assert read_json(job / "result.json")["status"] == "completed"
    # The same weights and metrics as the uninterrupted job #0 of the sweep.
    reference, resumed = weights(sweep.job(0)), weights(job)
    assert reference.keys() == resumed.keys()
    for key in reference:
        assert torch.equal(reference[key], resumed[key]), f"{key} differs after the requeue"
    assert metric_rows(job) == metric_rows(sweep.job(0))
    # One W&B run, continued by the requeued job (one record file per attempt).
    runs = offline_runs(job)
    assert len(runs) == 2 and len({r.run_id for r in runs}) == 1, [r.path for r in runs]
    assert runs[-1].exit_code == 0
    # The preempted attempt left no result for the launcher; the requeued one did.
    assert "Traceback" not in task_logs(sweep_dir, 1)


# ---------------------------------------------------------------------------------------------
# the launcher's death: a resumed sweep re-attaches to its SLURM jobs


def hold(cluster: SlurmCluster, job_id: str) -> str | None:
    """Keep a SLURM job from running on: `scontrol hold` while it is queued, `suspend` once it
    runs (`hold` of a job that has just started succeeds and does nothing, so the state after
    is what counts); the scontrol verb that undoes it, or None (it has ended)."""

    def state() -> str:
        squeue = cluster.run("squeue", "--noheader", "--array", "--format=%T", f"--jobs={job_id}")
        return squeue.stdout.strip()

    verbs = (
        ("hold", "PENDING", "PENDING", "release"),
        ("suspend", "RUNNING", "SUSPENDED", "resume"),
    )
    for verb, before, after, undo in verbs:
        if state() == before:
            cluster.run("scontrol", verb, job_id)
            if state() == after:
                return undo
    return None


@pytest.mark.slow
def test_resume_waits_for_the_slurm_jobs_of_a_dead_launcher(
    idle_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """SIGKILL the launcher of a 3-job sweep (one task each: two run on the 2-CPU node, one
    waits): its SLURM jobs go on; the rerun with hydra.launcher.resume=true waits for them
    instead of submitting them again (one SLURM job per job dir, one submission in all),
    collects each job's result and exits 0."""
    sweep_dir = tmp_path / "sweep"
    cmd = train_cmd(
        "-m",
        *SLURM,
        f"hydra.sweep.dir={sweep_dir}",
        *JOB,
        "hydra.launcher.resume=true",
        "optim.lr=0.05,0.1,0.2",
    )
    jobs = [sweep_dir / str(n) for n in range(3)]

    def slurm_job(job: Path) -> str | None:
        record = read_launch_record(job)
        return (
            (record.attempts[-1].backend or {}).get("slurm_job_id")
            if record and record.attempts
            else None
        )

    def start(log_name: str) -> subprocess.Popen:
        with open(tmp_path / log_name, "w") as log:
            return subprocess.Popen(
                cmd, cwd=REPO, env=run_env(**idle_cluster.env), stdout=log, stderr=subprocess.STDOUT
            )

    launcher = start("killed.log")
    try:
        deadline = time.time() + 180
        while not (all(slurm_job(j) for j in jobs) and (jobs[0] / "metrics.jsonl").exists()):
            assert launcher.poll() is None, (tmp_path / "killed.log").read_text()[-3000:]
            assert time.time() < deadline, "the sweep's jobs never started"
            time.sleep(0.2)
        launcher.kill()
    finally:
        launcher.kill()
        launcher.wait()
    submitted = [slurm_job(j) for j in jobs]
    still_there = set(submitted) & set(idle_cluster.job_ids())
    assert still_there, f"the SLURM jobs {submitted} did not outlive the launcher"
    # SLURM holds the jobs still there (queued: `hold`; running: `suspend`) until the rerun has
    # re-attached to them: on a loaded machine they could otherwise all end before it starts.
    held = {job_id: undo for job_id in still_there if (undo := hold(idle_cluster, job_id))}
    assert held, f"the SLURM jobs {sorted(still_there)} ended before they could be held"

    def completed_earlier(n: int, out: str) -> bool:
        """The rerun's first line of job #n says it was collected, not run or waited for."""
        first = next((line for line in out.splitlines() if f"] #{n} " in line), "")
        return "completed earlier" in first

    def settled(job_id: str, out: str) -> bool:
        """The rerun re-attached to this SLURM job, or found its result already written (a job
        held in its last moments, after its result.json: collected, not waited for)."""
        return f"SLURM job {job_id}): re-attached" in out or completed_earlier(
            submitted.index(job_id), out
        )

    resumer = start("resumed.log")
    try:
        deadline = time.time() + 180
        while held:
            ended = resumer.poll() is not None  # before the read: its last lines are in `out`
            out = (tmp_path / "resumed.log").read_text()
            for job_id in [j for j in held if settled(j, out)]:
                idle_cluster.run("scontrol", held.pop(job_id), job_id)
            assert not held or not ended, out[-5000:]
            assert time.time() < deadline, f"the rerun never re-attached to {held}\n{out[-3000:]}"
            time.sleep(0.2)
        resumer.wait(timeout=400)
    finally:
        for job_id, undo in held.items():
            idle_cluster.run("scontrol", undo, job_id)
        resumer.kill()
        resumer.wait()
    out = (tmp_path / "resumed.log").read_text()
    assert resumer.returncode == 0, out[-5000:]
    # Each job either ended while no launcher watched (its result is collected) or is waited
    # for; the held ones are still there when the rerun starts.
    attached = {
        n
        for n, job_id in enumerate(submitted)
        if f"#{n} (SLURM job {job_id}): re-attached to the SLURM job" in out
    }
    collected = {n for n in range(3) if completed_earlier(n, out)}
    assert attached and not attached & collected and attached | collected == {0, 1, 2}, out
    for job, job_id in zip(jobs, submitted, strict=True):
        record = read_launch_record(job)
        assert [a.backend["slurm_job_id"] for a in record.attempts] == [
            job_id
        ]  # never submitted again
        assert record.attempts[0].status == "completed"
        assert read_result(job).status == "completed"
    assert len(list(sweep_dir.glob(".submitit/.submission_file_*.sh"))) == 1
    rows = summary_rows(sweep_dir)
    assert sorted(r["job"] for r in rows) == ["0", "1", "2"]
    assert all(r["status"] == "completed" and r["attempts"] == "1" for r in rows), rows


# ---------------------------------------------------------------------------------------------
# what the sweeper receives, and failures: a tiny app (no torch), 2 tasks per job

APP = """\
import os
import signal
import sys
import time

import hydra


@hydra.main(version_base="1.3", config_path=".", config_name="app")
def main(cfg):
    rank = int(os.environ["RANK"])
    assert os.environ["WORLD_SIZE"] == "2" and os.environ["MASTER_ADDR"]
    if cfg.fail == "exit":
        sys.exit(f"failing on purpose on rank {rank}")
    if cfg.fail == "kill":
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    return float(cfg.x) + 100 * rank  # the sweeper must get rank 0's value


if __name__ == "__main__":
    main()
"""


def write_app(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "app.py").write_text(APP)
    (root / "app.yaml").write_text(
        textwrap.dedent(f"""\
        defaults:
          - override hydra/launcher: slurm
          - _self_
        dist: {{nproc_per_node: 2, nnodes: 1, backend: gloo}}
        x: 1.0
        fail: none
        hydra:
          searchpath: [file://{REPO}/conf]
          launcher: {{poll_interval_s: {POLL_S}, cpus_per_task: 1}}
        """)
    )
    (root / "search").mkdir(exist_ok=True)
    (root / "search" / "optuna.yaml").write_text(
        textwrap.dedent("""\
        # @package _global_
        defaults:
          - override /hydra/sweeper: optuna
        hydra:
          sweeper:
            direction: minimize
            n_trials: 3
            n_jobs: 3
            sampler: {seed: 0}
            params:
              x: choice(3.0, 1.0, 2.0)
        """)
    )
    return root / "app.py"


@pytest.mark.slow
def test_sweeper_receives_rank_0s_value(idle_cluster: SlurmCluster, tmp_path: Path) -> None:
    """3 Optuna trials, 2 tasks each, in one array: the study's best value is the smallest
    x of the trials, which only rank 0 returns (rank 1 returns x + 100)."""
    app = write_app(tmp_path / "app")
    sweep_dir = tmp_path / "optuna"
    proc = run(
        [sys.executable, str(app), "-m", "+search=optuna", f"hydra.sweep.dir={sweep_dir}"],
        cwd=tmp_path,
        timeout=240,
        **idle_cluster.env,
    )
    assert proc.returncode == 0, output(proc)[-5000:]
    xs = []
    for num in range(3):
        overrides = yaml.safe_load((sweep_dir / str(num) / ".hydra" / "overrides.yaml").read_text())
        xs += [float(o.split("=", 1)[1]) for o in overrides if o.startswith("x=")]
    best = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    assert best["best_value"] == min(xs), (best, xs)
    assert float(best["best_params"]["x"]) == min(xs)
    assert len(list(sweep_dir.glob(".submitit/*_2/*_2_1_log.err"))) == 1  # one array, 2 tasks


@pytest.mark.slow
def test_failed_jobs_are_reported(idle_cluster: SlurmCluster, tmp_path: Path) -> None:
    """A job whose ranks exit with an error and a job whose rank 1 is SIGKILLed both fail with a
    one-line reason (console, result.json); the good job completes; the sweep exits non-zero."""
    app = write_app(tmp_path / "app")
    sweep_dir = tmp_path / "failing"
    proc = run(
        [sys.executable, str(app), "-m", "fail=none,exit,kill", f"hydra.sweep.dir={sweep_dir}"],
        cwd=tmp_path,
        timeout=240,
        **idle_cluster.env,
    )
    out = output(proc)
    assert proc.returncode != 0, out[-5000:]
    assert (sweep_dir / "0" / ".hydra").is_dir() and not (sweep_dir / "0" / "result.json").exists()
    exited = read_json(sweep_dir / "1" / "result.json")
    assert exited["status"] == "failed" and exited["error"] == "failing on purpose on rank 0"
    # srun stopped rank 0 (SIGTERM, --kill-on-bad-exit) when rank 1 died: rank 1 is the cause.
    killed = read_json(sweep_dir / "2" / "result.json")
    assert killed["status"] == "failed" and killed["error"].startswith("rank 1 on "), killed
    # then rank 0's word in brackets, when srun's SIGTERM reached it after its handlers were
    # in place (under load it may still be starting its interpreter, and die without one)
    assert re.fullmatch(
        r"rank 1 on \S+: killed( \(rank 0: stopped by SIGTERM .*\))?", killed["error"]
    ), killed
    assert "#1 failed  " in out and "  fail=exit: failing on purpose on rank 0" in out, out
    assert "  fail=kill: rank 1 on" in out
    assert "Traceback" not in out, out[-5000:]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_pruning_across_slurm_jobs(idle_cluster: SlurmCluster, tmp_path: Path) -> None:
    """launch/tests/test_pruning.py's search as SLURM jobs of 2 tasks each: the study is a journal
    file on the shared sweep dir (no database), the pruned trial says so everywhere."""
    _, sweep_dir, out = pruned_sweep(tmp_path, *SLURM, **idle_cluster.env)
    assert not (sweep_dir / "optuna.db").exists()
    check_pruned(sweep_dir, out, "optuna.journal")


# ---------------------------------------------------------------------------------------------
# srun by hand: ddp_launcher/sbatch_example.sh


@pytest.mark.slow
def test_srun_tasks_get_torch_variables(idle_cluster: SlurmCluster) -> None:
    """`srun -n2 python -m ddp_launcher.ranks.slurm_task env`: ranks 0 and 1 of 2, one rendezvous
    address."""
    proc = idle_cluster.run(
        "srun",
        "--nodes=1",
        "--ntasks=2",
        "--cpus-per-task=1",
        sys.executable,
        "-m",
        "ddp_launcher.ranks.slurm_task",
        "env",
        timeout=120,
        cwd=REPO,
        PYTHONPATH=IMPORT_PATH,
    )
    assert proc.returncode == 0, proc.stderr
    envs = [dict(kv.split("=", 1) for kv in line.split()) for line in proc.stdout.splitlines()]
    envs.sort(key=lambda e: e["RANK"])
    assert [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"]) for e in envs] == [
        ("0", "0", "2"),
        ("1", "1", "2"),
    ]
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1


@pytest.mark.slow
def test_sbatch_example_runs_one_job_in_one_dir(idle_cluster: SlurmCluster, tmp_path: Path) -> None:
    """sbatch ddp_launcher/sbatch_example.sh with 2 tasks: one DDP run in RUN_DIR, written by
    rank 0."""
    run_dir = tmp_path / "run"
    proc = run(
        [
            "sbatch",
            "--parsable",
            "--nodes=1",
            "--ntasks-per-node=2",
            "--cpus-per-task=1",
            f"--output={tmp_path}/slurm-%j.out",
            "launch/ddp_launcher/sbatch_example.sh",
            "trainer.max_epochs=1",
            "wandb.mode=offline",
            "trainer.progress_bar=false",
        ],
        RUN_DIR=str(run_dir),
        PYTHON=sys.executable,
        APP="train.py",
        **idle_cluster.env,
    )
    assert proc.returncode == 0, output(proc)
    job_id = proc.stdout.strip().split(";")[0]
    deadline = time.time() + 240
    while job_id in idle_cluster.job_ids() and not (run_dir / "result.json").exists():
        assert time.time() < deadline, "the sbatch job did not finish"
        time.sleep(0.2)
    idle_cluster.wait_until_idle()
    log = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert f"job {job_id} (restart 0): 2 rank(s) on 1 node(s)" in log, log
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", f"slurm-{job_id}.out"]
    assert {p.name for p in run_dir.iterdir()} == JOB_DIR_ENTRIES
    result = read_json(run_dir / "result.json")
    assert result["status"] == "completed" and len(result["app"]["peak_memory_mb_per_rank"]) == 2
    (wb,) = offline_runs(run_dir)
    assert wb.config["run"]["world_size"] == 2 and wb.exit_code == 0
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]


@pytest.mark.slow
def test_tasks_run_on_the_cpus_sbatch_gave_them(idle_cluster: SlurmCluster, tmp_path: Path) -> None:
    """The cluster binds each task to its cores (task/affinity). A sweep job with
    hydra.launcher.cpus_per_task=2, and ddp_launcher/sbatch_example.sh with --cpus-per-task=2: each
    task runs on 2 CPUs (this machine's 2), not 1 (since SLURM 22.05 srun does not inherit
    sbatch's count), and its threads and DataLoader workers follow; each rank records them
    (tests/gpu_probe.py)."""
    from tests.gpu_probe import LOG_ENV
    from tests.test_gpu_fork import PROBE, probed

    if idle_cluster.cpus < 2:
        pytest.skip("a node of one CPU: 2 per task cannot be had")
    log = tmp_path / "probe.jsonl"
    env = {**idle_cluster.env, LOG_ENV: str(log), "OMP_NUM_THREADS": ""}  # unset: the task's
    quick = ["trainer.max_epochs=1", "wandb.mode=disabled", "trainer.progress_bar=false"]
    cmd = train_cmd(
        "-m",
        "hydra/launcher=slurm",
        f"hydra.launcher.poll_interval_s={POLL_S}",
        "hydra.launcher.cpus_per_task=2",
        PROBE,
        *quick,
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    )
    proc = run(cmd, timeout=240, **env)
    assert proc.returncode == 0, output(proc)[-5000:]
    idle_cluster.wait_until_idle()
    by_hand = [
        "sbatch",
        "--wait",
        "--nodes=1",
        "--ntasks-per-node=1",
        "--cpus-per-task=2",
        f"--output={tmp_path}/slurm-%j.out",
        "launch/ddp_launcher/sbatch_example.sh",
        PROBE,
        *quick,
    ]
    proc = run(
        by_hand,
        timeout=240,
        RUN_DIR=str(tmp_path / "run"),
        PYTHON=sys.executable,
        APP="train.py",
        **env,
    )
    logs = "".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
    assert proc.returncode == 0, output(proc) + logs[-5000:]
    ranks = probed(log)
    assert [(len(r["cores"]), r["threads"], r["workers"]) for r in ranks] == [(2, 2, 1)] * 2, ranks


@pytest.mark.slow
def test_no_slurm_task_is_a_cuda_bad_fork(idle_cluster: SlurmCluster, tmp_path: Path) -> None:
    """Each SLURM task of a 2-rank job builds tests/gpu_probe.py's dataset: none is a CUDA bad
    fork (tests/test_gpu_fork.py checks every other way a rank starts)."""
    from tests.gpu_probe import LOG_ENV
    from tests.test_gpu_fork import PROBE, assert_no_bad_fork, probed

    log, sweep_dir = tmp_path / "probe.jsonl", tmp_path / "sweep"
    cmd = train_cmd(
        "-m",
        *SLURM,
        "dist.nproc_per_node=2",
        PROBE,
        "trainer.max_epochs=1",
        "wandb.mode=disabled",
        "trainer.progress_bar=false",
        f"hydra.sweep.dir={sweep_dir}",
    )
    proc = run(cmd, timeout=240, **idle_cluster.env, **{LOG_ENV: str(log)})
    assert proc.returncode == 0, output(proc)[-5000:]
    assert_no_bad_fork(probed(log), 2)


# ---------------------------------------------------------------------------------------------
# hydra.launcher.dry_run=true: sbatch's resources per job, nothing submitted
# (ddp_launcher/preview.py)


def sbatch_spy(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """PATH with an sbatch that notes each call, then runs SLURM's; the file of its calls."""
    import shutil

    bin_dir, calls = tmp_path / "spy", tmp_path / "sbatch.calls"
    bin_dir.mkdir()
    spy = bin_dir / "sbatch"
    spy.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexec {shutil.which("sbatch")} "$@"\n')
    spy.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}, calls


@pytest.mark.slow
def test_dry_run_shows_each_jobs_sbatch_resources_and_submits_nothing(
    idle_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """6 jobs of 1 and 2 tasks: 6 rows with the resource options of the job's sbatch script;
    no sbatch run, nothing queued, no sweep dir."""
    from test_preview import DRY, table

    spy_env, calls = sbatch_spy(tmp_path)
    sweep_dir = tmp_path / "sweep"
    cmd = train_cmd(
        "-m", *SLURM, DRY, f"hydra.sweep.dir={sweep_dir}", *JOB,
        "dist.nproc_per_node=1,2", "optim.lr=0.05,0.1,0.2",
    )  # fmt: skip
    proc = run(cmd, timeout=120, **idle_cluster.env, **spy_env)
    out = output(proc)
    assert proc.returncode == 0, out
    rows = table(out)
    assert sorted(rows) == [str(n) for n in range(6)], out
    for num, (overrides, world, resources, run_dir) in rows.items():
        nproc = 1 if int(num) < 3 else 2
        assert overrides.startswith(f"dist.nproc_per_node={nproc} optim.lr="), out
        assert world == f"1 x {nproc}" and run_dir == str(sweep_dir / num), out
        for option in ("--nodes=1", f"--ntasks-per-node={nproc}", "--cpus-per-task=1"):
            assert option in resources.split(), (option, resources)
        assert "--time=60" in resources.split() and "--output" not in resources, resources
    assert not calls.exists(), calls.read_text()
    assert idle_cluster.job_ids() == []
    assert not sweep_dir.exists()


@pytest.mark.slow
def test_dry_run_resume_on_slurm_is_what_resume_does(
    idle_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """A 2-job sweep of the tiny app (job 0 completes, job 1 fails), then a dry run with
    resume=true: job 0 skipped (its SLURM result), job 1 started fresh, the sweep dir unchanged
    byte for byte, nothing submitted; the real resume submits job 1 alone."""
    from test_preview import DRY, RESUME, snapshot, table

    app = write_app(tmp_path / "app")
    sweep_dir = tmp_path / "sweep"
    cmd = [sys.executable, str(app), "-m", "fail=none,exit", f"hydra.sweep.dir={sweep_dir}", RESUME]
    first = run(cmd, cwd=tmp_path, timeout=240, **idle_cluster.env)
    assert first.returncode != 0 and (sweep_dir / "1" / "result.json").exists(), output(first)
    before = snapshot(sweep_dir)
    attempts = {n: len(read_launch_record(sweep_dir / str(n)).attempts) for n in (0, 1)}

    spy_env, calls = sbatch_spy(tmp_path)
    proc = run([*cmd, DRY], cwd=tmp_path, timeout=120, **idle_cluster.env, **spy_env)
    out = output(proc)
    assert proc.returncode == 0, out
    rows = table(out)
    assert rows["0"][-1] == "skip (completed)" and rows["0"][2] == "-", out
    assert rows["1"][-1] == "start fresh" and "--ntasks-per-node=2" in rows["1"][2], out
    assert snapshot(sweep_dir) == before, "a dry run changed the sweep dir"
    assert not calls.exists() and idle_cluster.job_ids() == []

    resumed = run(cmd, cwd=tmp_path, timeout=240, **idle_cluster.env)
    assert resumed.returncode != 0, output(resumed)  # job 1 fails again
    assert len(read_launch_record(sweep_dir / "0").attempts) == attempts[0]
    assert len(read_launch_record(sweep_dir / "1").attempts) == attempts[1] + 1
