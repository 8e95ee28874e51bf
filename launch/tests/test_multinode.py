"""Multi-node torchrun, with two "nodes" on this machine: two torchrun agents (--nnodes=2,
c10d rendezvous), each in its own working directory, form one job.

Global rank 0 writes the run dir; the other node's rank writes nothing (Hydra only creates the
same, empty, run dir there: both nodes agreed on `${now:}` through the rendezvous store).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import OFFLINE, QUICK, REPO, RUN_DIR_ENTRIES, free_port, offline_runs, run_env

pytestmark = pytest.mark.slow

RUN_FILES = RUN_DIR_ENTRIES


def two_node_torchrun(endpoint: str, rdzv_id: str, node_rank: int, *overrides: str) -> list[str]:
    """`torchrun --nnodes=2 --nproc-per-node=1` (c10d) for node `node_rank` of a two-node job
    on this machine; --local-addr names each node (c10d orders nodes by it: 127.0.0.1 <
    localhost)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={rdzv_id}",
        f"--node-rank={node_rank}",
        f"--local-addr={('127.0.0.1', 'localhost')[node_rank]}",
        str(REPO / "train.py"),
        *overrides,
    ]


def start_nodes(tmp_path: Path, argv_for_node) -> list[tuple[Path, subprocess.Popen]]:
    """One process per node, each in its own directory (its own `outputs/`)."""
    nodes = []
    for node_rank in (0, 1):
        cwd = tmp_path / f"node{node_rank}"
        cwd.mkdir()
        proc = subprocess.Popen(
            argv_for_node(node_rank),
            cwd=cwd,
            env=run_env(),
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        nodes.append((cwd, proc))
    return nodes


def wait_all(nodes: list[tuple[Path, subprocess.Popen]], timeout: float = 300) -> list[str]:
    outs = []
    try:
        for _, proc in nodes:
            out, _ = proc.communicate(timeout=timeout)
            outs.append(out)
    finally:
        for _, proc in nodes:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outs


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def test_two_torchrun_agents_form_one_job(tmp_path: Path) -> None:
    """`torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d` on two nodes: one job of
    world size 2; node 0's rank (global rank 0) writes the only run dir, node 1's writes nothing."""
    endpoint = f"127.0.0.1:{free_port()}"

    def torchrun(node_rank: int) -> list[str]:
        return two_node_torchrun(
            endpoint, "two-nodes", node_rank, *QUICK, OFFLINE, "trainer.batch_size=64"
        )

    nodes = start_nodes(tmp_path, torchrun)
    outs = wait_all(nodes)
    for (_, proc), out in zip(nodes, outs, strict=True):
        assert proc.returncode == 0, out[-5000:]
    (node0, _), (node1, _) = nodes
    run_dirs = [sorted(cwd.glob("outputs/*/*")) for cwd in (node0, node1)]
    assert [len(d) for d in run_dirs] == [1, 1], run_dirs
    # One start instant for the run: the same run dir name on both nodes.
    assert run_dirs[0][0].relative_to(node0) == run_dirs[1][0].relative_to(node1)
    run_dir = run_dirs[0][0]
    assert {p.name for p in run_dir.iterdir()} == RUN_FILES
    assert files_under(node1) == [], "the second node's rank wrote files"
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "completed" and len(result["app"]["peak_memory_mb_per_rank"]) == 2
    (wb,) = offline_runs(run_dir)
    assert wb.config["run"]["world_size"] == 2 and wb.exit_code == 0
    assert "Traceback" not in outs[1] and "ERROR" not in outs[1], outs[1][-3000:]


def test_torchrun_launcher_runs_one_job_on_two_nodes(tmp_path: Path) -> None:
    """`python train.py -m hydra/launcher=torchrun dist.nnodes=2` on both nodes with the same
    (shared) sweep dir and rdzv_endpoint: one job dir written by rank 0; each node's launcher
    keeps its own files; both sweeps succeed (the node without rank 0 returns no value)."""
    endpoint = f"127.0.0.1:{free_port()}"
    sweep_dir = tmp_path / "shared" / "sweep"

    def sweep(node_rank: int) -> list[str]:
        return [
            sys.executable,
            str(REPO / "train.py"),
            "-m",
            "hydra/launcher=torchrun",
            f"hydra.sweep.dir={sweep_dir}",
            "dist.nnodes=2",
            "dist.nproc_per_node=1",
            f"hydra.launcher.rdzv_endpoint={endpoint}",
            f"hydra.launcher.node_rank={node_rank}",
            *QUICK,
            "wandb.mode=disabled",
        ]

    nodes = start_nodes(tmp_path, sweep)
    outs = wait_all(nodes)
    for (_, proc), out in zip(nodes, outs, strict=True):
        assert proc.returncode == 0, out[-5000:]
    job = sweep_dir / "0"
    assert (job / ".hydra" / "config.yaml").is_file()
    assert json.loads((job / "result.json").read_text())["status"] == "completed"
    assert sorted(p.name for p in (job / ".torchrun").iterdir()) == ["node0", "node1"]
    with_result = [n for n in ("node0", "node1") if (job / ".torchrun" / n / "result.pkl").exists()]
    assert len(with_result) == 1, with_result
    assert sum("rank 0 ran on another node" in out for out in outs) == 1, outs


def listening_ports() -> set[int]:
    """TCP ports something on this machine listens on (Linux /proc/net/tcp{,6}: state 0A)."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A":
                    ports.add(int(local.rsplit(":", 1)[1], 16))
    return ports


def free_port_pair() -> int:
    """A port P with P + 1 free too."""
    while True:
        port = free_port()
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port + 1))
            return port


def test_two_2_node_jobs_at_once_meet_at_their_own_endpoints(tmp_path: Path) -> None:
    """Two launchers as two nodes run a sweep of two 2-node jobs at once (max_parallel=2), job
    0 shorter than job 1. Each job's agents meet at their own endpoint, rdzv_endpoint's port +
    the job's number (their stores listen there while the jobs run); before, both met at the
    one endpoint, job 1's agents as clients of job 0's store, which ended with job 0."""
    port = free_port_pair()
    sweep_dir = tmp_path / "shared" / "sweep"

    def sweep(node_rank: int) -> list[str]:
        return [
            sys.executable,
            str(REPO / "train.py"),
            "-m",
            f"hydra.sweep.dir={sweep_dir}",
            "dist.nnodes=2",
            "dist.nproc_per_node=1",
            "hydra.launcher.max_parallel=2",
            f"hydra.launcher.rdzv_endpoint=127.0.0.1:{port}",
            f"hydra.launcher.node_rank={node_rank}",
            "trainer.max_epochs=1,3",
            "wandb.mode=disabled",
            "trainer.progress_bar=false",
        ]

    logs = [tmp_path / f"node{node_rank}.log" for node_rank in (0, 1)]
    procs = [
        subprocess.Popen(
            sweep(n), cwd=REPO, env=run_env(), stdout=log.open("w"), stderr=subprocess.STDOUT
        )
        for n, log in enumerate(logs)
    ]
    listened: set[int] = set()
    deadline = time.time() + 600
    try:
        while any(proc.poll() is None for proc in procs) and time.time() < deadline:
            listened |= listening_ports() & {port, port + 1}
            time.sleep(0.05)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    for proc, log in zip(procs, logs, strict=True):
        assert proc.returncode == 0, log.read_text()[-5000:]
    for num, epochs in ((0, 1), (1, 3)):
        result = json.loads((sweep_dir / str(num) / "result.json").read_text())
        assert (result["status"], result["app"]["epochs"]) == ("completed", epochs), result
    assert listened == {port, port + 1}


RESUME_JOB = [
    "trainer.max_epochs=2",
    "trainer.batch_size=128",
    "trainer.checkpoint_every_n_steps=3",
    "trainer.progress_bar=false",
    "wandb.mode=disabled",
]


def two_agents(dirs: list[Path], *extra: str, **env: str) -> tuple[list[str], list]:
    """Both agents (c10d, one rank each) of a job whose nodes' hydra.run.dir are `dirs`."""
    endpoint = f"127.0.0.1:{free_port()}"
    procs = []
    for node_rank in (0, 1):
        dirs[node_rank].parent.mkdir(parents=True, exist_ok=True)
        run_dir = f"hydra.run.dir={dirs[node_rank]}"
        argv = two_node_torchrun(
            endpoint, f"resume-{len(extra)}", node_rank, *RESUME_JOB, run_dir, *extra
        )
        procs.append(
            subprocess.Popen(
                argv,
                cwd=dirs[node_rank].parent,
                env=run_env(**env),
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    nodes = [(d.parent, p) for d, p in zip(dirs, procs, strict=True)]
    return wait_all(nodes, timeout=900), procs  # two agents on a busy machine: slow


@pytest.fixture(scope="module")
def killed_two_node_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-node job killed (rank 1, step 7) after its step-6 checkpoint; the tests resume
    copies of it."""
    root = tmp_path_factory.mktemp("killed")
    dirs = [root / f"node{n}" / "run" for n in (0, 1)]
    outs, procs = two_agents(dirs, HYDRA_DDP_FAULT="kill@7:1")
    assert all(p.returncode != 0 for p in procs), outs
    assert not (dirs[1] / "checkpoints").exists()  # rank 1 writes nothing
    return root


@pytest.mark.parametrize("second_copy", ["none", "torn"])
def test_two_agents_resume_from_rank0s_checkpoint_though_run_dirs_differ(
    tmp_path: Path, killed_two_node_job: Path, second_copy: str
) -> None:
    """Two agents (c10d, one rank each) whose hydra.run.dir differ, killed after a checkpoint,
    restarted with resume=auto. Node 1's run dir holds no checkpoint (or a torn copy of rank
    0's newest): rank 0 chooses, rank 1 receives rank 0's file, and both finish from the same
    step (before, rank 1 started fresh and the first collective aborted)."""
    shutil.copytree(killed_two_node_job, tmp_path, dirs_exist_ok=True)
    dirs = [tmp_path / f"node{n}" / "run" for n in (0, 1)]
    newest = sorted((dirs[0] / "checkpoints").glob("step-*.pt"))[-1]
    if second_copy == "torn":
        (dirs[1] / "checkpoints").mkdir(parents=True)
        (dirs[1] / "checkpoints" / newest.name).write_bytes(newest.read_bytes()[:1000])
    outs, procs = two_agents(dirs, "resume=auto")
    for proc, out in zip(procs, outs, strict=True):
        assert proc.returncode == 0, out[-5000:]
    log = (dirs[0] / "train.log").read_text()
    assert f"resumed from {newest}" in log
    problem = "cannot be read" if second_copy == "none" else "differs from rank 0's"
    assert f"resume: {newest.name}: rank 1 on " in log and problem in log
    result = json.loads((dirs[0] / "result.json").read_text())
    assert result["status"] == "completed" and result["app"]["epochs"] == 2
    steps = [json.loads(x)["step"] for x in (dirs[0] / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and max(steps) == 22  # 11 steps per epoch, in order
    assert "Traceback" not in outs[1], outs[1][-3000:]
