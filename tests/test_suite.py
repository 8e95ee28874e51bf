"""How the suite shares the cores (tests/suite_plugin.py): tests that share an expensive fixture of
this suite run on one xdist worker, so it is built once; a test that shares nothing is free to
run anywhere. A broken grouping only shows as a slower run, so it is checked here. And how it
stays on the CPU on a GPU host, its `gpu` tests getting the machine's GPUs back."""

import os
import sys

import pytest

from tests.gpu import MACHINE_CUDA_ENV, UNSET, machine_gpus, on_gpu
from tests.helpers import output, run, run_env
from tests.test_docs import COMMANDS


@pytest.fixture(scope="module")
def shared_once():
    """Stands for a trained run or a sweep: module-scoped, written in tests/."""
    return object()


def test_first_user_of_a_shared_fixture(shared_once):
    assert shared_once is not None


def test_second_user_of_a_shared_fixture(shared_once):
    assert shared_once is not None


def test_alone(tmp_path):
    """Only pytest's own fixtures (tmp_path comes from the session-scoped tmp_path_factory)."""
    assert tmp_path.is_dir()


def group_of(item) -> str | None:
    mark = item.get_closest_marker("xdist_group")
    return mark.args[0] if mark else None


def test_tests_sharing_a_fixture_share_one_xdist_group_and_no_other(request):
    items = {item.name: item for item in request.session.items if item.module.__name__ == __name__}
    first, second = (
        items["test_first_user_of_a_shared_fixture"],
        items["test_second_user_of_a_shared_fixture"],
    )
    assert group_of(first) == group_of(second) == f"{__name__}.shared_once"
    assert group_of(items["test_alone"]) is None  # tmp_path_factory joins nothing
    assert group_of(request.node) is None
    if os.environ.get("PYTEST_XDIST_WORKER") and request.config.getvalue("loadgroup"):
        # xdist reads the marks in its own collection hook and puts the group in the node id:
        # marks added after it would be ignored
        assert first.nodeid.endswith(f"@{__name__}.shared_once")


@pytest.mark.slow
def test_a_launcher_suite_test_first_leaves_the_plugins_configs_for_the_next_test(tmp_path):
    """Hydra's launcher suites put back the ConfigStore a test started with: run first in a
    process, one would take away the configs our plugins store when Hydra discovers them
    (tests/suite_plugin.py: pytest_configure discovers them before any test)."""
    suite = "launch/tests/test_hydra_suites.py::TestTorchrunLauncher::"
    suite += "test_sweep_1_job[torchrun-overrides0]"
    optuna = next(c for c in COMMANDS if "sweeps.md" in c.where and "optuna" in c.text)
    needs_optuna = f"tests/test_docs.py::test_every_documented_command_composes[{optuna.where}]"
    proc = run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider"]
        + ["--basetemp", str(tmp_path / "t"), suite, needs_optuna],
        timeout=300,
    )
    assert proc.returncode == 0 and "2 passed" in proc.stdout, output(proc)[-3000:]


def cuda_visible_devices() -> str | None:
    return os.environ.get("CUDA_VISIBLE_DEVICES")


@pytest.mark.slow
def test_the_suite_sees_no_gpu_and_gpu_tests_get_the_machines_back(monkeypatch):
    """On a GPU host the suite's CPU tests run as on a CPU machine: no GPU in this process nor
    in the processes tests start (an `auto` world would take every GPU); a `gpu` test's
    process sees what the machine showed, ids, UUIDs and MIG entries as written."""
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "" == run_env()["CUDA_VISIBLE_DEVICES"]
    assert os.environ[MACHINE_CUDA_ENV]  # what pytest was started with (or <unset>)
    assert machine_gpus() >= 0
    monkeypatch.setenv(MACHINE_CUDA_ENV, "3,GPU-8f6e,MIG-5c1a")
    assert on_gpu(cuda_visible_devices) == "3,GPU-8f6e,MIG-5c1a"
    monkeypatch.setenv(MACHINE_CUDA_ENV, UNSET)  # the machine's every GPU
    assert on_gpu(cuda_visible_devices) is None


@pytest.mark.gpu
def test_gpu_tests_run_only_where_the_machine_has_a_gpu():
    """Collected everywhere, run only where CUDA exists (skipped here otherwise)."""
    assert machine_gpus() > 0
    assert on_gpu(cuda_device_count) == machine_gpus()


def cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count()
