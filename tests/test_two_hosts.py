"""Multi-node training across two hosts of their own (tests/hosts.py: network namespaces, each
with its own address, hostname and hosts file, joined by an isolated bridge; one file system):
torchrun agents, the torchrun launcher's sweeps and a two-node SLURM cluster
(tests/slurm_cluster.py: slurm_two_nodes), with gloo ranks on CPU.

A job of 4 ranks on 2 hosts x 2 ends with the weights of the same job on 1 host x 4, after
losing a node and resuming from its checkpoint: under torchrun (rerun with resume=auto) and as
a SLURM job (the launcher's retry). Two multi-node jobs at once each meet at their own
rendezvous endpoint. Skipped, with one line, where namespaces cannot be made (not root).
First, without processes: how a rank picks gloo's interface and names a lost node.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
import torch.distributed as dist
from ddp_launcher.core import network
from ddp_launcher.core.errors import lost_a_peer
from ddp_launcher.core.run_dir import read_launch_record
from ddp_launcher.ranks.slurm_task import master_port

from tests.helpers import REPO, output, read_json, run, run_env, summary_rows, train_cmd, weights

if TYPE_CHECKING:
    from tests.hosts import Host, Hosts
    from tests.slurm_cluster import SlurmCluster

pytest_plugins = ["tests.hosts", "tests.slurm_cluster"]

# One job of 4 ranks, whatever their hosts: 10 steps of a 64-sample global batch, a checkpoint
# every 3 steps; float64, as the suite's other comparisons across worlds (float32 all-reduce
# rounding can flip a ReLU or max-pool tie).
JOB = [
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=10",
    "trainer.batch_size=64",
    "trainer.checkpoint_every_n_steps=3",
    "trainer.precision=64",
    "trainer.test_after_fit=false",
    "trainer.progress_bar=false",
    "wandb.mode=disabled",
]
# Rank 2 (node2's first) waits at step 7, after the step-6 checkpoint, until node2 is killed.
STALL = {"HYDRA_DDP_FAULT": "stall@7:2"}
CHECKPOINT = "step-00000006.pt"
SLURM = [
    "hydra/launcher=slurm",
    "hydra.launcher.poll_interval_s=0.25",
    "hydra.launcher.cpus_per_task=1",
]


@pytest.fixture(scope="module")
def one_host_4_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """JOB on this machine, 4 ranks under torchrun: the result the two-host runs must end with."""
    run_dir = tmp_path_factory.mktemp("one_host") / "run"
    proc = run(train_cmd(*JOB, f"hydra.run.dir={run_dir}", nproc=4))
    assert proc.returncode == 0, output(proc)[-5000:]
    return run_dir


def assert_same_weights(run_dir: Path, reference: Path) -> None:
    """The world-size invariance tolerance of tests/test_train.py."""
    got, want = weights(run_dir), weights(reference)
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-5, msg=key)


def wait_for_file(path: Path, procs: list[subprocess.Popen], logs: list[Path]) -> None:
    """Until `path` exists; fails when a process ends first (or after 10 minutes)."""
    deadline = time.time() + 600
    while not path.exists():
        ended = [log for p, log in zip(procs, logs, strict=True) if p.poll() is not None]
        assert not ended, "\n".join(log.read_text()[-3000:] for log in ended)
        assert time.time() < deadline, f"no {path}"
        time.sleep(0.05)


def stop(procs: list[subprocess.Popen]) -> None:
    """SIGKILL what is still running (on a host: all it started, tests/hosts.py)."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def listening_ports(pid: int) -> set[int]:
    """The TCP ports something listens on in the network namespace of process `pid` (its
    /proc/<pid>/net/tcp{,6}: state 0A)."""
    ports = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):  # the process has ended
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A":
                    ports.add(int(local.rsplit(":", 1)[1], 16))
    return ports


def ports_over_time(procs: list[subprocess.Popen], pid: int, timeout: float = 600) -> list[set]:
    """What listens in `pid`'s network namespace, every 50 ms until `procs` have ended."""
    seen, deadline = [], time.time() + timeout
    while any(p.poll() is None for p in procs) and time.time() < deadline:
        seen.append(listening_ports(pid))
        time.sleep(0.05)
    return seen


# ---------------------------------------------------------------------------------------------
# a rank's view: gloo's interface (ddp_launcher/core/network.py), a lost node
# (ddp_launcher/ranks/nodes.py)


def made_up_node(monkeypatch, interfaces: dict, routes: dict, names: dict) -> None:
    """This process's node as ddp_launcher/core/network.py sees it: its interfaces (name ->
    addresses), the
    local address of its route to each host, what each name resolves to."""
    monkeypatch.setattr(network, "interface_addresses", lambda: interfaces)
    monkeypatch.setattr(network, "source_address", lambda host: routes.get(host))
    monkeypatch.setattr(network, "resolve", lambda host: names.get(host, []))


def test_gloo_listens_on_the_interface_the_other_nodes_reach(monkeypatch) -> None:
    """The interface of the route to MASTER_ADDR, whatever the hostname says; on MASTER_ADDR's
    own node (a loopback route), the interface of the hostname's address, else the only one
    up; where neither tells, gloo's own choice and a warning naming the interfaces and
    GLOO_SOCKET_IFNAME."""
    interfaces = {"eth0": ["192.168.1.5"], "ib0": ["10.1.0.5", "fe80::1"]}
    made_up_node(monkeypatch, interfaces, {"node1": "10.1.0.5"}, {"node2": ["127.0.1.1"]})
    assert network.gloo_interface("node1", "node2")[0] == "ib0"
    routes, names = {"node1": "127.0.0.1"}, {"node1": ["127.0.1.1"]}
    made_up_node(monkeypatch, {"eth0": ["10.1.0.1"]}, routes, names)
    assert network.gloo_interface("node1", "node1")[0] == "eth0"
    made_up_node(monkeypatch, interfaces, routes, {"node1": ["127.0.1.1", "192.168.1.5"]})
    assert network.gloo_interface("node1", "node1")[0] == "eth0"
    made_up_node(monkeypatch, interfaces, routes, names)
    name, warning = network.gloo_interface("node1", "node1")
    assert name is None and "node1 resolves to 127.0.1.1" in warning
    assert "set GLOO_SOCKET_IFNAME" in warning and "ib0 (10.1.0.5 fe80::1)" in warning


def a_rank_of_two_nodes(monkeypatch) -> None:
    """This process as rank 1 of a job of 2 nodes x 1 rank (the variables torchrun sets)."""
    for key, value in {"RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "node1")


def test_gloo_socket_ifname_set_by_the_user_is_kept(monkeypatch) -> None:
    from ddp_launcher.ranks import nodes as distributed

    a_rank_of_two_nodes(monkeypatch)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ib7")
    monkeypatch.setattr(distributed, "gloo_interface", lambda _: pytest.fail("asked"))
    distributed.choose_gloo_interface()
    assert os.environ["GLOO_SOCKET_IFNAME"] == "ib7"


def test_a_lost_connection_names_the_node_it_led_to(monkeypatch) -> None:
    """A collective's error naming a peer on another node is a LostNode naming that node; one
    naming a peer on this node is one only where a rank said which node it lost (in the job's
    store); any other error is not one."""
    from ddp_launcher.ranks import nodes as distributed

    a_rank_of_two_nodes(monkeypatch)
    monkeypatch.setattr(distributed, "interface_addresses", lambda: {"eth0": ["10.0.0.1"]})
    monkeypatch.setattr(distributed.socket, "gethostbyaddr", lambda a: ("node2", [], [a]))
    monkeypatch.setattr(distributed, "LOST_NODE_WAIT_S", 0.2)
    gloo = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error"
    remote = RuntimeError(f"{gloo} [10.0.0.2]:4711: Connection reset by peer. This is ...")
    local = RuntimeError(f"{gloo} [10.0.0.1]:4712: Connection closed by peer. This is ...")
    if dist.is_initialized():
        pytest.skip("a process group of another test is still up in this process")
    assert distributed.lost_node(local) is None  # no process group: no store to ask
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert distributed.lost_node(local) is None  # no rank said which
        lost = distributed.lost_node(remote)
        assert str(lost).startswith("lost node node2 (10.0.0.2): the connections to its ranks")
        assert str(distributed.lost_node(local)) == str(lost)  # a rank of this node said so
    finally:
        dist.destroy_process_group()
    assert distributed.lost_node(RuntimeError("CUDA out of memory")) is None
    assert not lost_a_peer(lost)  # the cause the launcher reports, not a consequence


def test_a_nccl_job_that_lost_a_node_names_it_in_one_line(monkeypatch) -> None:
    """NCCL's errors name no peer: a rank of a job across nodes that gets one ("remote process
    exited or there was a network error", the watchdog's timeout) asks its gloo group with one
    barrier, whose error names the node that went; a barrier that passes means no node was
    lost (the error stays as it is). NCCL's watchdog is made to raise in the rank
    (TORCH_NCCL_ASYNC_ERROR_HANDLING=2) instead of ending it with SIGABRT, unless set."""
    import torch.distributed as torch_dist
    from ddp_launcher.ranks import nodes

    a_rank_of_two_nodes(monkeypatch)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    nodes.choose_gloo_interface()
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    nodes.choose_gloo_interface()
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"

    monkeypatch.setattr(nodes, "interface_addresses", lambda: {"eth0": ["10.0.0.1"]})
    monkeypatch.setattr(nodes.socket, "gethostbyaddr", lambda a: ("node2", [], [a]))
    monkeypatch.setattr(nodes, "tell_lost_node", lambda where: None)
    nccl = RuntimeError(
        "NCCL error in: ProcessGroupNCCL.cpp:2030, remote process exited or there was a network "
        "error, NCCL version 2.27.5\nncclRemoteError: A call failed possibly due to a network "
        "error or a remote process exiting prematurely."
    )
    peer = "[gloo/transport/tcp/pair.cc:545] Read error [10.0.0.2]:4711: Connection reset by peer"
    barriers = []

    def barrier(group=None):
        barriers.append(group)
        raise RuntimeError(peer)

    monkeypatch.setattr(torch_dist, "barrier", barrier)
    lost = nodes.lost_node(nccl, cpu_group="the job's gloo group")
    assert barriers == ["the job's gloo group"]
    assert str(lost).startswith("lost node node2 (10.0.0.2): the connections to its ranks")
    assert "\n" not in str(lost) and not lost_a_peer(lost)
    monkeypatch.setattr(torch_dist, "barrier", lambda group=None: None)
    assert nodes.lost_node(nccl, cpu_group="the job's gloo group") is None  # nobody went
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # one node: nothing to name
    assert nodes.lost_node(RuntimeError(peer)) is None


# ---------------------------------------------------------------------------------------------
# torchrun


def torchrun_agents(
    hosts: Hosts, run_dir: Path, name: str, *extra: str, **env: str
) -> tuple[list[subprocess.Popen], list[Path]]:
    """Both agents of a 2 hosts x 2 ranks torchrun job (c10d rendezvous at node1's name), and
    their logs (<name>.<host>.log). Each host's /etc/hosts says its own name is 127.0.1.1, as
    Debian writes it: gloo's default would listen there, out of the other host's reach."""
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=node1:29400",
        "--rdzv-id=two-hosts",
        str(REPO / "train.py"),
        *JOB,
        f"hydra.run.dir={run_dir}",
        *extra,
    ]
    procs, logs = [], []
    for host in hosts.hosts:
        logs.append(run_dir.parent / f"{name}.{host.name}.log")
        with logs[-1].open("w") as out:
            procs.append(
                hosts.popen(
                    host,
                    argv,
                    hosts.loopback_hosts_file(host),
                    cwd=run_dir.parent,
                    env=run_env(**env),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
    return procs, logs


@pytest.mark.slow
def test_torchrun_on_two_hosts_loses_one_then_resumes_to_the_one_host_result(
    hosts: Hosts, one_host_4_ranks: Path, tmp_path: Path
) -> None:
    """`torchrun --nnodes=2 --nproc-per-node=2` on node1 and node2 (each naming itself
    127.0.1.1): gloo listens on eth0, which the other host reaches. After the step-6
    checkpoint every process on node2 is killed: node1's ranks stop at once (not at the
    collective timeout) with one line naming node2; rerun on both with resume=auto, the job
    completes from that checkpoint with the weights of 1 host x 4 ranks."""
    node2 = hosts.hosts[1]
    run_dir = tmp_path / "run"
    procs, logs = torchrun_agents(hosts, run_dir, "killed", **STALL)
    try:
        wait_for_file(run_dir / "checkpoints" / CHECKPOINT, procs, logs)
        assert hosts.kill_all(node2)
        procs[0].wait(timeout=300)  # the collective timeout, dist.timeout_s, is 600 s
    finally:
        stop(procs)
    out = logs[0].read_text()
    assert procs[0].returncode != 0, out[-5000:]
    lost = f"lost node node2 ({node2.address}): the connections to its ranks broke"
    result = read_json(run_dir / "result.json")
    assert result["status"] == "failed" and result["error"].startswith(lost), result
    assert lost in out, out[-5000:]
    log = (run_dir / "train.log").read_text()
    assert "gloo listens on eth0: this node's only interface up" in log  # (node1 is 127.0.1.1)

    procs, logs = torchrun_agents(hosts, run_dir, "resumed", "resume=auto")
    try:
        for proc, log in zip(procs, logs, strict=True):
            assert proc.wait(timeout=600) == 0, log.read_text()[-5000:]
    finally:
        stop(procs)
    assert (
        f"resumed from {run_dir / 'checkpoints' / CHECKPOINT}"
        in (run_dir / "train.log").read_text()
    )
    assert read_json(run_dir / "result.json")["status"] == "completed"
    assert_same_weights(run_dir, one_host_4_ranks)


@pytest.mark.slow
def test_two_multi_node_jobs_at_once_meet_at_their_own_endpoints_across_hosts(
    hosts: Hosts, tmp_path: Path
) -> None:
    """The torchrun launcher on node1 and node2 runs a sweep of two 2-node jobs at once
    (max_parallel=2), job 0 shorter than job 1: each job's agents meet at their own endpoint on
    node1, rdzv_endpoint's port + the job's number (both stores listen there at once), and both
    complete. Before, both jobs met at one endpoint: job 1's agents joined job 0's store, which
    ended with job 0."""
    port, sweep_dir = 29500, tmp_path / "sweep"
    logs = [tmp_path / f"{h.name}.log" for h in hosts.hosts]
    procs = []
    for node_rank, (host, log) in enumerate(zip(hosts.hosts, logs, strict=True)):
        argv = [
            sys.executable,
            str(REPO / "train.py"),
            "-m",
            f"hydra.sweep.dir={sweep_dir}",
            "dist.nnodes=2",
            "dist.nproc_per_node=1",
            "hydra.launcher.max_parallel=2",
            f"hydra.launcher.rdzv_endpoint=node1:{port}",
            f"hydra.launcher.node_rank={node_rank}",
            "trainer.max_epochs=1,3",
            "trainer.progress_bar=false",
            "wandb.mode=disabled",
        ]
        with log.open("w") as out:
            procs.append(
                hosts.popen(
                    host, argv, cwd=REPO, env=run_env(), stdout=out, stderr=subprocess.STDOUT
                )
            )
    try:
        listened = ports_over_time(procs, procs[0].pid)  # in node1's network namespace
    finally:
        stop(procs)
    for proc, log in zip(procs, logs, strict=True):
        assert proc.returncode == 0, log.read_text()[-5000:]
    for num, epochs in ((0, 1), (1, 3)):
        result = read_json(sweep_dir / str(num) / "result.json")
        assert (result["status"], result["app"]["epochs"]) == ("completed", epochs), result
    assert any({port, port + 1} <= ports for ports in listened), listened


# ---------------------------------------------------------------------------------------------
# SLURM: node1 and node2 are the cluster's nodes; node1 is also its login node


def slurm_sweep(
    cluster: SlurmCluster, sweep_dir: Path, *overrides: str, log: Path, **env: str
) -> subprocess.Popen:
    """`python train.py -m hydra/launcher=slurm ...` on the login node (node1)."""
    cmd = [sys.executable, str(REPO / "train.py"), "-m", *SLURM, f"hydra.sweep.dir={sweep_dir}"]
    with log.open("w") as out:
        return subprocess.Popen(
            cluster.login([*cmd, *overrides]),
            cwd=REPO,
            env=run_env(**cluster.env, **env),
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def slurm_job_id(cluster: SlurmCluster, array_task: str) -> str:
    """SLURM_JOB_ID of an array's task (`12_0`: its own job id, which MASTER_PORT derives from)."""
    shown = cluster.run("scontrol", "show", "job", array_task)
    return re.search(r"\bJobId=(\d+)", shown.stdout).group(1)


def task_log(job_dir: Path, task: int) -> str:
    """submitit's stdout of one task of the job's (last) SLURM job."""
    record = read_launch_record(job_dir)
    job_id = record.attempts[-1].backend["slurm_job_id"]
    (path,) = job_dir.parent.glob(f".submitit/{job_id}/*_{task}_log.out")
    return path.read_text()


@pytest.mark.slow
def test_slurm_runs_two_node_jobs_at_once_each_with_its_own_rendezvous(
    slurm_two_nodes: SlurmCluster, tmp_path: Path
) -> None:
    """A sweep of two `dist.nnodes=2` jobs (1 task per node): SLURM runs both at once, each
    with a rank on node1 and one on node2; their ranks meet at MASTER_ADDR=node1 (the first
    node of SLURM's node list, which both hosts resolve) on a port of their own (both listen
    there at once); both complete."""
    cluster = slurm_two_nodes
    cluster.wait_until_idle()
    sweep_dir, log = tmp_path / "sweep", tmp_path / "sweep.log"
    proc = slurm_sweep(
        cluster,
        sweep_dir,
        "dist.nnodes=2",
        "dist.nproc_per_node=1",
        "optim.lr=0.05,0.1",
        "trainer.max_epochs=8",  # long enough to overlap however SLURM starts them
        "trainer.progress_bar=false",
        "wandb.mode=disabled",
        log=log,
    )
    try:
        listened = ports_over_time([proc], proc.pid)  # the launcher runs on node1
    finally:
        stop([proc])
    assert proc.returncode == 0, log.read_text()[-5000:]
    ports = set()
    for job in (sweep_dir / "0", sweep_dir / "1"):
        assert read_json(job / "result.json")["status"] == "completed"
        assert "hostname=node1" in task_log(job, 0) and "hostname=node2" in task_log(job, 1)
        assert (
            "gloo listens on eth0: its route to MASTER_ADDR=node1"
            in (job / "train.log").read_text()
        )
        array_task = read_launch_record(job).attempts[-1].backend["slurm_job_id"]
        ports.add(master_port(slurm_job_id(cluster, array_task)))
    assert len(ports) == 2 and any(ports <= seen for seen in listened), (ports, listened)


def kill_tasks(hosts: Hosts, host: Host) -> list[int]:
    """SIGKILL the SLURM tasks on `host` (every process there but slurmd, its steps' daemons
    and the host's own `unshare`)."""
    killed = []
    for pid in hosts.pids(host):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().strip() not in (
                "unshare",
                "slurmd",
                "slurmstepd",
            ):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
    return killed


@pytest.mark.slow
def test_slurm_job_loses_a_node_and_its_retry_resumes_to_the_one_host_result(
    slurm_two_nodes: SlurmCluster, hosts: Hosts, one_host_4_ranks: Path, tmp_path: Path
) -> None:
    """A `dist.nnodes=2 dist.nproc_per_node=2` SLURM job whose tasks on node2 are killed after
    its step-6 checkpoint: the job fails in one line naming node2, the launcher's retry
    (hydra.launcher.retries=1) resumes it from that checkpoint, it completes with the weights
    of 1 host x 4 ranks, and the sweep summary shows two attempts."""
    cluster = slurm_two_nodes
    cluster.wait_until_idle()
    sweep_dir, log = tmp_path / "sweep", tmp_path / "sweep.log"
    job = sweep_dir / "0"
    proc = slurm_sweep(
        cluster,
        sweep_dir,
        "dist.nnodes=2",
        "dist.nproc_per_node=2",
        "hydra.launcher.retries=1",
        *JOB,
        log=log,
        **STALL,
    )
    try:
        wait_for_file(job / "checkpoints" / CHECKPOINT, [proc], [log])
        assert kill_tasks(hosts, hosts.hosts[1])
        proc.wait(timeout=600)
    finally:
        stop([proc])
    out = log.read_text()
    assert proc.returncode == 0, out[-5000:]
    (failed,) = [line for line in out.splitlines() if "] #0 failed " in line]
    assert f"lost node node2 ({hosts.hosts[1].address}): " in failed, out
    (row,) = summary_rows(sweep_dir)
    assert (row["status"], row["attempts"]) == ("completed", "2"), row
    assert f"resumed from {job / 'checkpoints' / CHECKPOINT}" in (job / "train.log").read_text()
    assert_same_weights(job, one_host_4_ranks)
