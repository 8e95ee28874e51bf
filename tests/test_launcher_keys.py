"""The experiment under the launcher's own keys (torchrun's names, as the other Hydra torchrun
launchers take them): conf/dist's `auto` defers to `hydra.launcher.nproc_per_node`, a job's own
`dist.nproc_per_node` still wins. The rules themselves: launch/tests/test_drop_in.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from ddp_launcher import read_result

from tests.helpers import read_json, sweep


@pytest.mark.slow
def test_the_launchers_nproc_per_node_gives_each_auto_job_2_ranks(tmp_path: Path) -> None:
    """`python train.py -m hydra/launcher=torchrun hydra.launcher.nproc_per_node=2` with
    dist.nproc_per_node=auto (conf/dist's default) and 1: job 0 trains with 2 ranks, job 1
    with its own 1, both complete."""
    result = sweep(
        tmp_path / "sweep",
        "hydra/launcher=torchrun",
        "hydra.launcher.nproc_per_node=2",
        "dist.nproc_per_node=auto,1",
    )
    assert result.proc.returncode == 0, result.out[-5000:]
    for num, ranks in ((0, 2), (1, 1)):
        record = read_json(result.job(num) / ".torchrun" / "job.json")
        assert (record["world_size"], record["status"]) == (ranks, "completed"), record
        assert read_result(result.job(num)).status == "completed"
