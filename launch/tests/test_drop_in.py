"""A drop-in launcher: an unmodified `@hydra.main` app (it imports nothing of ddp_launcher) gets
its ranks from `hydra.launcher.*` (torchrun's names), each job its own GPUs, and no process that
forks ranks runs the app's top-level code.

First the world-size rules without processes (the launcher's keys under a job's own `dist`),
then real sweeps of a 15-line app (gloo on the CPU): 2 jobs x 2 ranks from another cwd, whose
top level makes any process forked after it a CUDA bad fork (torch sets the flag without a GPU);
and two jobs at once on 4 faked GPUs, with and without `dist`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from ddp_launcher.core.errors import UserError
from ddp_launcher.jobs import Job
from ddp_launcher.lifecycle import place
from ddp_launcher.ranks.job_spec import JobSpec
from ddp_launcher.torchrun import (
    TorchrunBackend,
    TorchrunLauncherConf,
    rdzv_conf,
    single_run_world,
)
from omegaconf import OmegaConf

from tests.helpers import output, run_env

GPUS = [str(g) for g in range(4)]

# The app of "Done when": Hydra's own decorator and torch's own calls, nothing of ddp_launcher.
# Every process that runs its top level, and every rank, appends a JSON line to $APP_LOG.
APP = """\
import json, os
import hydra, torch, torch.distributed as dist
CUDA = torch.cuda.is_available()  # here, a process forked after this one is a CUDA bad fork
def note(**fields):
    with open(os.environ["APP_LOG"], "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), **fields}) + "\\n")
note(top=__name__)
@hydra.main(version_base=None, config_path=".", config_name="app")
def main(cfg):
    dist.init_process_group("gloo")
    total = torch.tensor([dist.get_rank() + 1.0]); dist.all_reduce(total)
    env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "CUDA_VISIBLE_DEVICES")}
    note(x=cfg.x, sum=total.item(), bad_fork=torch.cuda._is_in_bad_fork(), **env)
    dist.destroy_process_group()
if __name__ == "__main__":
    main()
"""
# Both jobs of the isolation sweep wait here for each other (up to a minute) before they finish:
# each rank 0 leaves a file, then waits for the other job's. Sequential jobs would time out.
MEET = """\
import os, pathlib, time
def meet(cfg):
    if os.environ["RANK"] != "0":
        return
    here = pathlib.Path(os.environ["APP_LOG"]).parent
    (here / f"started-{cfg.x}").touch()
    deadline = time.time() + 60
    while not (here / f"started-{3 - cfg.x}").exists() and time.time() < deadline:
        time.sleep(0.1)
"""
# The launcher sees 4 GPUs (the suite hides the machine's: CUDA_VISIBLE_DEVICES="").
FAKE_GPUS = """\
import os
if os.environ.get("FAKE_GPUS"):
    from ddp_launcher.core import world
    world.visible_gpus = lambda: int(os.environ["FAKE_GPUS"])
"""


def write_app(folder: Path, config: str = "x: 0\n", meet: bool = False) -> Path:
    folder.mkdir(parents=True)
    app = APP
    if meet:
        (folder / "meeting.py").write_text(MEET)
        app = app.replace("import hydra,", "from meeting import meet\nimport hydra,")
        app = app.replace(
            "    dist.destroy_process_group()",
            "    meet(cfg)\n    dist.barrier()\n    dist.destroy_process_group()",
        )
    (folder / "app.py").write_text(app)
    (folder / "app.yaml").write_text(config)
    return folder / "app.py"


def notes(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def sweep_app(app: Path, tmp_path: Path, *overrides: str, **env: str):
    """`python <app> -m hydra/launcher=torchrun ...` from a cwd that is not the app's folder."""
    cwd = tmp_path / "elsewhere"
    cwd.mkdir(exist_ok=True)
    cmd = [sys.executable, str(app), "-m", "hydra/launcher=torchrun", *overrides]
    cmd.append(f"hydra.sweep.dir={tmp_path / 'sweep'}")
    return subprocess.run(
        cmd,
        cwd=cwd,
        env=run_env(APP_LOG=str(tmp_path / "app.log"), **env),
        capture_output=True,
        text=True,
        timeout=300,
    )


# ---------------------------------------------------------------------------------------------
# the launcher's keys, under a job's own dist


def placed(settings: TorchrunLauncherConf, config: dict, gpus: int = 0) -> Job:
    job = Job(0, [], Path("/nonexistent/0"), JobSpec(None, OmegaConf.create(config), None))
    place(job, TorchrunBackend(settings, gpu_ids=GPUS[:gpus], cores=[0, 1]))
    return job


def world(job: Job) -> tuple[int, int, bool]:
    assert job.error is None, job.error
    return job.nproc, job.nnodes, job.uses_gpus


def test_the_launchers_keys_size_a_job_whose_dist_does_not() -> None:
    """hydra.launcher.nproc_per_node / nnodes (torchrun's names) size every job, the weaker
    side: a job's own dist value wins (a sweep over dist.nproc_per_node=1,2), its `auto` or
    absent key takes the launcher's; the launcher's `auto` is one rank per GPU, 1 on the CPU.
    An app without `dist` is a job like any other: on a GPU host its ranks take GPUs."""
    two = TorchrunLauncherConf(nproc_per_node=2)
    assert world(placed(two, {})) == (2, 1, False)  # no dist: the launcher's
    assert world(placed(two, {"dist": {"nproc_per_node": "auto"}})) == (2, 1, False)
    assert world(placed(two, {"dist": {"backend": "gloo"}})) == (2, 1, False)
    assert world(placed(two, {"dist": {"nproc_per_node": 1}})) == (1, 1, False)  # the job's
    assert world(placed(two, {"dist": {"nproc_per_node": 3}}, gpus=4)) == (3, 1, True)
    assert world(placed(TorchrunLauncherConf(), {})) == (1, 1, False)  # auto on the CPU
    assert world(placed(TorchrunLauncherConf(), {}, gpus=4)) == (4, 1, True)  # a rank per GPU
    assert world(placed(two, {}, gpus=4)) == (2, 1, True)
    assert world(placed(two, {"dist": {"backend": "gloo"}}, gpus=4)) == (2, 1, False)
    endpoint = "node01:29400"
    for nnodes in (2, "2", "2:2"):
        settings = TorchrunLauncherConf(nnodes=nnodes, rdzv_endpoint=endpoint, node_rank=0)
        assert world(placed(settings, {"dist": {"nproc_per_node": 1}})) == (1, 2, False)
        mine = {"dist": {"nnodes": 1}}  # the job's own wins
        assert world(placed(settings, mine)) == (1, 1, False)


def test_a_bad_launcher_key_is_one_line_naming_it() -> None:
    """A value from the launcher's keys is named as hydra.launcher.<key>: one that no job can
    take (not a count, an elastic range) before any job starts, as the launcher's other agent
    keys; one that a job's own world decides against in the job's error (the job fails alone,
    as with a bad dist.<key>)."""
    for settings, error in (
        (TorchrunLauncherConf(nproc_per_node="two"), "hydra.launcher.nproc_per_node=two is"),
        (TorchrunLauncherConf(nnodes="1:4"), "hydra.launcher.nnodes=1:4 is an elastic range"),
    ):
        with pytest.raises(UserError) as caught:
            placed(settings, {})
        assert str(caught.value).startswith(error) and "\n" not in str(caught.value)
    cases = [
        (TorchrunLauncherConf(nproc_per_node=8), 4, "hydra.launcher.nproc_per_node=8 asks for 8"),
        (TorchrunLauncherConf(nnodes=2), 0, "hydra.launcher.nnodes=2 needs a rendezvous point"),
        (TorchrunLauncherConf(rdzv_conf="join_timeout"), 0, "hydra.launcher.rdzv_conf="),
    ]
    for settings, gpus, error in cases:
        job = placed(settings, {}, gpus)
        assert job.error is not None and job.error.startswith(error), job.error
        assert "\n" not in job.error
    job = placed(TorchrunLauncherConf(nproc_per_node=8), {"dist": {"nproc_per_node": 6}}, 4)
    assert job.error.startswith("dist.nproc_per_node=6 asks for 6 GPUs"), job.error


def test_rdzv_conf_is_torchruns() -> None:
    assert rdzv_conf("join_timeout=900, read_timeout=60") == {
        "join_timeout": "900",
        "read_timeout": "60",
    }
    assert rdzv_conf({"join_timeout": 900}) == {"join_timeout": "900"}
    assert rdzv_conf(None) == rdzv_conf("") == {}
    with pytest.raises(UserError, match="KEY=VALUE"):
        rdzv_conf("=3")
    settings = TorchrunLauncherConf(rdzv_conf="join_timeout=900")
    backend = TorchrunBackend(settings, gpu_ids=[], cores=[0, 1])
    job = placed(settings, {})
    _, cpus = backend.reserve(job)
    assert backend.agent_spec(job, {}, cpus).rdzv_conf == {"join_timeout": "900"}


def test_jobs_with_or_without_dist_get_disjoint_gpus() -> None:
    """On 4 GPUs two 2-rank jobs run at once, each with its own CUDA_VISIBLE_DEVICES, whether
    the app has a `dist` node or not (before, a job without one counted as a CPU job that
    saw every GPU); the real sweep below runs the app without one."""
    settings = TorchrunLauncherConf(nproc_per_node=2)
    for config in ({}, {"dist": {"backend": "auto"}}, {"dist": {"nproc_per_node": 2}}):
        backend = TorchrunBackend(settings, gpu_ids=["4", "5", "6", "7"], cores=[0, 1, 2, 3])
        visible = []
        for num in (0, 1):
            job = Job(
                num, [], Path(f"/nonexistent/{num}"), JobSpec(None, OmegaConf.create(config), None)
            )
            place(job, backend)
            assert (job.nproc, job.uses_gpus, job.error) == (2, True, None), config
            gpus, cpus = backend.reserve(job)  # both fit now: they run at once
            visible.append(backend.job_env(job, gpus, cpus)["CUDA_VISIBLE_DEVICES"])
        assert visible == ["4,5", "6,7"], (config, visible)


def test_one_run_without_m_takes_the_launchers_keys_too() -> None:
    """`python app.py ...` without -m where hydra/launcher=torchrun is configured (train.py's
    default): its world under the launcher's keys, as a sweep job's; another launcher's config
    leaves it to dist alone."""
    from hydra import compose, initialize
    from hydra.core.hydra_config import HydraConfig

    def single(*overrides: str) -> tuple[int, int]:
        with initialize(version_base=None, config_path=None):
            cfg = compose(overrides=list(overrides), return_hydra_config=True)
        before = HydraConfig.instance().cfg
        HydraConfig.instance().set_config(cfg)
        try:
            return single_run_world(cfg)
        finally:
            HydraConfig.instance().cfg = before

    ours = ["hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=2"]
    assert single(*ours, "+dist.nproc_per_node=auto") == (2, 1)
    assert single(*ours, "+x=1") == (2, 1)  # no dist
    assert single(*ours, "+dist.nproc_per_node=1") == (1, 1)  # its own
    assert single("+dist.nproc_per_node=2", "+dist.nnodes=1", "+dist.backend=gloo") == (2, 1)
    basic = ["+dist.nproc_per_node=auto", "+dist.nnodes=auto", "+dist.backend=auto"]
    assert single(*basic) == (1, 1)  # the basic launcher: dist's auto, 1 on the CPU


# ---------------------------------------------------------------------------------------------
# real sweeps of the unmodified app


@pytest.mark.slow
def test_an_unmodified_app_runs_each_job_with_the_launchers_ranks(tmp_path: Path) -> None:
    """`-m hydra/launcher=torchrun hydra.launcher.nproc_per_node=2 x=1,2` from another cwd: 2
    jobs x 2 ranks (WORLD_SIZE=2, an all-reduce across them), exit 0. The app's top level runs
    in the launcher and in each rank (imported there as __mp_main__, as plain torchrun runs it
    in each rank), never in a process that forks ranks (the warm start's agents), so no rank is
    a CUDA bad fork although that top level calls torch.cuda.is_available()."""
    app = write_app(tmp_path / "app")
    proc = sweep_app(app, tmp_path, "hydra.launcher.nproc_per_node=2", "x=1,2")
    assert proc.returncode == 0, output(proc)[-5000:]
    found = notes(tmp_path / "app.log")
    ranks = [n for n in found if "RANK" in n]
    assert sorted((n["x"], n["RANK"]) for n in ranks) == [(1, "0"), (1, "1"), (2, "0"), (2, "1")]
    assert {(n["WORLD_SIZE"], n["sum"]) for n in ranks} == {("2", 3.0)}  # 1 + 2, all-reduced
    assert [n for n in ranks if n["bad_fork"]] == []
    tops = [n for n in found if "top" in n]
    assert [n["top"] for n in tops].count("__main__") == 1  # the launcher: `python app.py`
    forks_ranks = {n["ppid"] for n in ranks}  # each job's agent
    assert len(forks_ranks) == 2 and not forks_ranks & {n["pid"] for n in tops}, found
    assert {n["pid"] for n in tops if n["top"] == "__mp_main__"} == {n["pid"] for n in ranks}


@pytest.mark.slow
def test_two_jobs_at_once_get_disjoint_gpus(tmp_path: Path) -> None:
    """With 4 faked GPUs, the app's 2 jobs of 2 ranks run at once (each waits for the other
    before it ends), each on its own 2 GPUs (CUDA_VISIBLE_DEVICES), though the app has no
    `dist` node; their ranks see only their job's."""
    app = write_app(tmp_path / "app", meet=True)
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "sitecustomize.py").write_text(FAKE_GPUS)
    path = f"{tmp_path / 'fake'}:{run_env()['PYTHONPATH']}"
    overrides = ["hydra.launcher.nproc_per_node=2", "x=1,2"]
    visible = ",".join(GPUS)
    proc = sweep_app(
        app, tmp_path, *overrides, PYTHONPATH=path, FAKE_GPUS="4", CUDA_VISIBLE_DEVICES=visible
    )
    assert proc.returncode == 0, output(proc)[-5000:]
    ranks = [n for n in notes(tmp_path / "app.log") if "RANK" in n]
    assert len(ranks) == 4, ranks
    seen = {x: {n["CUDA_VISIBLE_DEVICES"] for n in ranks if n["x"] == x} for x in (1, 2)}
    (one,), (two,) = seen[1], seen[2]  # one value per job, shared by its ranks
    assert len(one.split(",")) == len(two.split(",")) == 2, seen
    assert not set(one.split(",")) & set(two.split(",")), seen
    assert set(one.split(",")) | set(two.split(",")) == set(GPUS)
    assert all((tmp_path / f"started-{x}").exists() for x in (1, 2))
