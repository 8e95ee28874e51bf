"""A disk that fills at start, resume or save is one line naming the dir and the bytes needed,
exit 2, and nothing already written is lost (issue 66, item 5). On 5f215d2 a run dir on a disk
with 8 KB free was a 7-line traceback, a sweep dir there 30 lines, resume=auto there 50. The
real disk is a small tmpfs in a mount namespace of the test's own (root only; skipped
elsewhere); the metrics.jsonl row cut short is shown in this process."""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
import sys

import pytest
from ddp_launcher.core.errors import UserError

from tests.helpers import QUICK, REPO, run_env


def test_a_row_that_does_not_fit_leaves_metrics_jsonl_whole(tmp_path):
    """The row is cut back to the file's last whole row and the run stops in one line (a torn
    last row is what a later reader would choke on)."""
    from components.metrics import RunLogger

    logger = RunLogger(tmp_path, enabled=True)
    logger._file = open(tmp_path / "metrics.jsonl", "ab", buffering=0)  # noqa: SIM115
    logger.log({"step": 1, "epoch": 0, "train/loss": 1.0})
    real = logger._file

    class FillsHalfway:
        def __getattr__(self, name):
            return getattr(real, name)

        def write(self, data: bytes) -> int:
            real.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")

    logger._file = FillsHalfway()
    with pytest.raises(UserError) as caught:
        logger.log({"step": 2, "epoch": 0, "train/loss": 0.5})
    message = str(caught.value)
    assert message.startswith(f"no space left on the disk of {tmp_path} for a row of metrics.jsonl")
    assert "needs " in message and "free there" in message, message
    real.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1]


def can_mount() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = "d=$(mktemp -d) && mount -t tmpfs -o size=64k tmpfs $d"
    return (
        subprocess.run(["unshare", "--mount", "sh", "-c", probe], capture_output=True).returncode
        == 0
    )


# The steps, run in one mount namespace with a small tmpfs at DISK (argv[1]); what each step
# said and left goes to argv[2] as JSON.
DRIVER = r"""
import json, os, subprocess, sys
disk, out = sys.argv[1], sys.argv[2]
quick = json.loads(sys.argv[3])
results = {}

def run(name, *overrides):
    flags = [o for o in overrides if o.startswith("-")]
    cmd = [sys.executable, "train.py", *flags, *quick, *(o for o in overrides if o not in flags)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    results[name] = {"code": proc.returncode, "out": proc.stdout + proc.stderr}

def fill(leave):
    stat = os.statvfs(disk)
    free = stat.f_bavail * stat.f_frsize
    with open(os.path.join(disk, f"filler-{leave}"), "wb") as f:
        f.write(b"\0" * max(0, free - leave))

def files(root):
    found = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, root)] = f.read().hex()
    return found

run_dir = os.path.join(disk, "run")
run("trained", f"hydra.run.dir={run_dir}")
fill(8192)
before = files(run_dir)
run("start", f"hydra.run.dir={os.path.join(disk, 'new')}")
run("sweep", "-m", "optim.lr=0.1,0.2", f"hydra.sweep.dir={os.path.join(disk, 'sweep')}")
run("resume", f"hydra.run.dir={run_dir}", "resume=auto", "trainer.max_epochs=2")
results["unchanged"] = files(run_dir) == before
results["new"] = [d for d in ("new", "sweep") if os.path.exists(os.path.join(disk, d))]
os.remove(os.path.join(disk, "filler-8192"))
fill(160 * 1024)  # room for the start, not for the next checkpoint
run("save", f"hydra.run.dir={run_dir}", "resume=auto", "trainer.max_epochs=2")
with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    results["rows"] = [json.loads(line)["step"] for line in f]
results["result"] = json.load(open(os.path.join(run_dir, "result.json")))
results["checkpoints"] = sorted(os.listdir(os.path.join(run_dir, "checkpoints")))
json.dump(results, open(out, "w"))
"""


@pytest.mark.slow
@pytest.mark.skipif(not can_mount(), reason="needs a mount namespace (root) for a small tmpfs")
def test_a_disk_that_fills_at_start_resume_or_save_is_one_line(tmp_path):
    disk, out = tmp_path / "disk", tmp_path / "results.json"
    disk.mkdir()
    quick = json.dumps([*QUICK, "trainer.log_every_n_steps=11"])
    mount = f"mount -t tmpfs -o size=3m tmpfs {disk}"
    script = f"{mount} && {sys.executable} -c \"$1\" {disk} {out} '{quick}'"
    proc = subprocess.run(
        ["unshare", "--mount", "sh", "-c", script, "sh", DRIVER],
        cwd=REPO,
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(out.read_text())
    assert results["trained"]["code"] == 0, results["trained"]["out"][-3000:]
    for step, key in (
        ("start", "hydra.run.dir"),
        ("sweep", "hydra.sweep.dir"),
        ("resume", "hydra.run.dir"),
    ):
        said = results[step]["out"].strip().splitlines()
        assert results[step]["code"] == 2 and len(said) == 1, (step, said)
        assert f"no space left on the disk of {disk}" in said[0], (step, said)
        assert "(needs " in said[0] and "KiB, 8.0 KiB free there)" in said[0], (step, said)
        assert said[0].endswith(f"or choose another {key}"), (step, said)
    assert results["unchanged"] and results["new"] == []
    # the save: the epoch trained, its checkpoint did not fit; what was there stays whole
    said = [line for line in results["save"]["out"].splitlines() if "[ERROR]" in line]
    assert results["save"]["code"] == 2 and len(said) == 1, results["save"]["out"][-3000:]
    assert "cannot write checkpoint" in said[0] and "it needs about" in said[0], said
    assert (
        "Traceback" not in results["save"]["out"] and "Logging error" not in results["save"]["out"]
    )
    assert results["rows"] == sorted(results["rows"]) and 22 in results["rows"], results["rows"]
    assert (
        results["result"]["status"] == "failed" and "it needs about" in results["result"]["error"]
    )
    assert "step-00000022.pt" in results["checkpoints"], results["checkpoints"]
