"""Speed features on CPU: precision modes, gradient accumulation, channels_last, compile, and
the per-step speed metrics. (Speed itself is shown by `python -m docs.bench`, not asserted.)

Runs are in this process (world size 1) where no second rank is needed; the 2-rank
accumulation check (in tests/rank_pool.py's two ranks) and compilation are marked slow.
"""

import json
import logging
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from components.checkpoint import load_checkpoint
from tests.helpers import output, run, train_cmd, train_in_process, train_rows

QUICK = ["trainer.max_epochs=1", "wandb.mode=disabled", "trainer.progress_bar=false"]


def result(run_dir: Path) -> dict:
    return json.loads((run_dir / "result.json").read_text())


# fp16 on a CPU is emulated: 3 epochs take 10+ s. 64: float64 weights and inputs (numerics checks)
@pytest.mark.parametrize("precision", ["bf16", "64", pytest.param("fp16", marks=pytest.mark.slow)])
def test_mixed_precision_and_channels_last_train(tmp_path, precision):
    run_dir = tmp_path / precision
    train_in_process(
        run_dir,
        *QUICK,
        "trainer.max_epochs=3",
        f"trainer.precision={precision}",
        "trainer.channels_last=true",
        "trainer.grad_clip=1.0",
    )
    assert result(run_dir)["app"]["best_val_acc"] > 0.5  # it learns (chance is 0.1)
    state = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    # fp16 carries a GradScaler (scale state saved for exact resume); bf16 needs none
    assert bool(state["scaler"]) == (precision == "fp16")
    dtypes = {w.dtype for w in state["model"].values() if w.is_floating_point()}
    assert dtypes == {torch.float64 if precision == "64" else torch.float32}


def final_weights(run_dir: Path, accumulate: int, two_ranks=None) -> dict:
    overrides = [*QUICK, "trainer.batch_size=128", f"trainer.accumulate_grad_batches={accumulate}"]
    if two_ranks is None:
        train_in_process(run_dir, *overrides)
    else:
        two_ranks.train(run_dir, *overrides)
    return load_checkpoint(run_dir / "checkpoints" / "last.pt")


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_accumulation_equals_the_bigger_batch(request, tmp_path, nproc):
    """batch 128 in 2 micro-batches (no_sync on the first) == batch 128 in one go."""
    ranks = request.getfixturevalue("two_ranks") if nproc == 2 else None  # tests/rank_pool.py
    one, two = (final_weights(tmp_path / f"acc{a}", a, ranks) for a in (1, 2))
    # 1437 samples // 128: the same optimizer steps
    assert one["progress"]["step"] == two["progress"]["step"] == 11
    for key in one["model"]:
        torch.testing.assert_close(one["model"][key], two["model"][key], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_compile_path_runs(tmp_path):
    run_dir = tmp_path / "compiled"
    proc = run(
        train_cmd(
            *QUICK, "trainer.compile=true", "trainer.batch_size=256", f"hydra.run.dir={run_dir}"
        ),
        timeout=900,
    )
    assert proc.returncode == 0, output(proc)
    # the checkpoint holds the plain module's weights (no torch.compile prefix)
    state = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    assert not any(k.startswith("_orig_mod.") for k in state["model"])


# Compiled and eager 2-rank runs of the same seed: the compiled kernels sum in another order, so
# they may differ in the last bits; after an epoch of 11 steps on digits the val loss agrees
# to within 1e-4 (measured: 6e-9) and every weight to within 1e-4.
COMPILE_TOLERANCE = 1e-4


@pytest.mark.slow
def test_compiled_ddp_trains_like_eager_on_two_ranks(tmp_path):
    """trainer.compile=true on 2 ranks (`python train.py dist.nproc_per_node=2`, gloo): dynamo's
    DDPOptimizer splits the graph at DDP's buckets (its log line, on both ranks), it trains as
    eager does, and the checkpoints keep the plain model's keys."""
    common = [*QUICK, "dist.nproc_per_node=2", "trainer.batch_size=128"]
    common += ["trainer.accumulate_grad_batches=2"]  # no_sync through the compiled module
    runs = {}
    # Every rank's output on the console (one run shows local rank 0's), to see both ranks' line
    common += ["hydra.launcher.tee=3"]
    for name, extra in (("eager", []), ("compiled", ["trainer.compile=true"])):
        runs[name] = tmp_path / name
        proc = run(
            train_cmd(*common, *extra, f"hydra.run.dir={runs[name]}"),
            timeout=900,
            TORCH_LOGS="+torch._dynamo.backends.distributed",
        )
        assert proc.returncode == 0, output(proc)
        if name == "compiled":
            used = [line for line in output(proc).splitlines() if "DDPOptimizer used" in line]
            assert {line[:7] for line in used} == {"[rank0]", "[rank1]"}, output(proc)
    eager, compiled = (result(runs[n])["app"]["final"] for n in ("eager", "compiled"))
    assert compiled["val/loss"] == pytest.approx(eager["val/loss"], abs=COMPILE_TOLERANCE)
    assert compiled["val/acc"] == pytest.approx(eager["val/acc"], abs=1 / eager["val/count"])
    plain, fast = (load_checkpoint(runs[n] / "checkpoints" / "last.pt") for n in runs)
    assert list(fast["model"]) == list(plain["model"])  # no _orig_mod. / module. prefix
    assert fast["progress"]["step"] == plain["progress"]["step"] > 0
    for key, weight in plain["model"].items():
        torch.testing.assert_close(fast["model"][key], weight, rtol=0, atol=COMPILE_TOLERANCE)


def test_force_ddp_wraps_a_single_rank_and_trains_the_same(monkeypatch, tmp_path):
    """dist.force_ddp=true: DDP around the model even at world size 1 (how the GPU check runs
    DDP's reducer and DDPOptimizer on one GPU, docs/bench/gpu.py); its all-reduce over one rank
    changes nothing, so the weights end as the plain model's do. Without it, no DDP."""
    import components.distributed as distributed

    wrapped = []

    class SpyDDP(distributed.DDP):
        def __init__(self, module, **kwargs):
            wrapped.append(type(module).__name__)
            super().__init__(module, **kwargs)

    monkeypatch.setattr(distributed, "DDP", SpyDDP)
    train_in_process(tmp_path / "plain", *QUICK)
    assert wrapped == []
    train_in_process(tmp_path / "ddp", *QUICK, "dist.force_ddp=true")
    assert wrapped == ["SmallCNN"]
    plain, ddp = (
        load_checkpoint(tmp_path / n / "checkpoints" / "last.pt") for n in ("plain", "ddp")
    )
    assert list(ddp["model"]) == list(plain["model"])  # no module. prefix
    for key, weight in plain["model"].items():
        assert torch.equal(ddp["model"][key], weight), key


def compiled_types(rank: int, run_dir: str, overrides: list[str]) -> list[str]:
    """train.py's train(cfg) on this rank, recording what torch.compile is handed."""
    from tests.rank_pool import train_rank

    handed, real = [], torch.compile

    def spy(model, *args, **kwargs):
        handed.append(type(model).__name__)
        return real(model, *args, **kwargs)

    torch.compile = spy
    try:
        train_rank(rank, run_dir, overrides)
    finally:
        torch.compile = real
    return handed


@pytest.mark.slow
def test_compile_takes_the_ddp_wrapped_module(two_ranks, tmp_path):
    """What torch.compile compiles is the DDP wrapper (timm's and torch's order), not the
    model DDP then wraps."""
    overrides = [*QUICK, "trainer.compile=true", "trainer.limit_train_batches=2"]
    handed = two_ranks.run(compiled_types, str(tmp_path / "r"), overrides, timeout=600)
    assert handed == [["DistributedDataParallel"]] * 2


def test_speed_metrics_are_logged(tmp_path):
    run_dir = tmp_path / "r"
    train_in_process(run_dir, *QUICK, "trainer.log_every_n_steps=5")
    rows = train_rows(run_dir)
    assert rows
    for row in rows:
        assert row["samples_per_s"] > 0 and row["step_time_ms"] > 0 and row["peak_mem_mb"] > 0
        assert 0 <= row["data_wait_pct"] <= 100
        assert "mfu" not in row  # MFU needs a GPU's peak FLOP/s
    res = result(run_dir)
    assert (
        res["app"]["time_to_first_step_s"] > 0 and len(res["app"]["peak_memory_mb_per_rank"]) == 1
    )


# --- trainer.precision=auto: bf16 where the hardware has it natively, else 32 ----------------

# An AVX2-only CPU stood in for by a CPU with AVX512-BF16: oneDNN (which runs the CPU's bf16
# convolutions and matmuls) and ATen capped at AVX2.
AVX2_STAND_IN = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


def fake_cpu(monkeypatch, capability: str, avx512_bf16: bool, amx: bool, **env: str) -> None:
    """torch's CPU probes (and oneDNN's cap) as on a CPU with these features."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize(
    "capability, avx512_bf16, amx, env, native, said",
    [
        ("AVX2", False, False, {}, False, "this CPU has no native bf16: AVX2"),  # AMD EPYC Rome
        ("AVX512", False, False, {}, False, "this CPU has no native bf16: AVX512"),  # Skylake
        ("AVX512", True, False, {}, True, "native bf16: AVX512 with AVX512-BF16"),  # Zen 4
        ("AVX512", True, True, {}, True, "native bf16: AVX512 with AVX512-BF16 and AMX"),
        ("DEFAULT", False, False, {}, False, "no native bf16: DEFAULT"),  # e.g. a Mac's arm64
        # oneDNN capped below its bf16 ISA (either prefix, any case): emulated, so 32
        ("AVX2", True, True, AVX2_STAND_IN, False, "AVX2, ONEDNN_MAX_CPU_ISA=AVX2"),
        ("AVX512", True, False, {"DNNL_MAX_CPU_ISA": "avx512_core"}, False, "avx512_core"),
        ("AVX512", True, False, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"}, False, "VNNI"),
        # ... or at it and above, or a name oneDNN does not know (no cap): native
        ("AVX512", True, False, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, True, "native"),
        ("AVX512", True, True, {"ONEDNN_MAX_CPU_ISA": "avx10_1_512_amx"}, True, "native"),
        ("AVX512", True, True, {"ONEDNN_MAX_CPU_ISA": "DEFAULT"}, True, "native"),
        # ATen's kernels capped alone: oneDNN still runs bf16 natively (2.0x fp32 measured)
        ("AVX2", True, False, {}, True, "native bf16: AVX2 with AVX512-BF16"),
    ],
)
def test_auto_precision_follows_the_cpus_native_bf16(
    monkeypatch, capability, avx512_bf16, amx, env, native, said
):
    from components.precision import native_bf16

    fake_cpu(monkeypatch, capability, avx512_bf16, amx, **env)
    found, why = native_bf16(torch.device("cpu"))
    assert found is native and said in why, why


def test_auto_precision_without_torchs_private_cpu_probes(monkeypatch):
    """A torch build without the private probes: no native bf16 known, so 32."""
    from components.precision import native_bf16

    fake_cpu(monkeypatch, "AVX512", True, True)
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported")
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")
    assert native_bf16(torch.device("cpu")) == (False, "this CPU has no native bf16: AVX512")


@pytest.mark.parametrize(
    "name, capability, native",
    [("NVIDIA H100 80GB HBM3", (9, 0), True), ("Tesla T4", (7, 5), False)],
)
def test_auto_precision_follows_the_gpus_native_bf16(monkeypatch, name, capability, native):
    """torch.cuda.is_bf16_supported without emulation (a T4 or V100 emulates bf16)."""
    from components.precision import native_bf16

    asked = []

    def is_bf16_supported(including_emulation=True):
        asked.append(including_emulation)
        return capability >= (8, 0)

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    found, why = native_bf16(torch.device("cuda", 0))
    assert (found, asked) == (native, [False])
    assert why == (
        f"{name} has native bf16"
        if native
        else f"{name} has no native bf16: compute capability 7.5"
    )


def test_the_avx2_stand_in_has_no_native_bf16_by_torchs_own_probes():
    """Where the MNIST recipe's 5x slowdown was measured, a CPU with AVX512-BF16 stands in for an
    AVX2-only one (docs/performance.md): torch's real probes, in a process of its own, say AVX2
    and auto says 32."""
    code = (
        "import torch\n"
        "from components.precision import native_bf16\n"
        "print(torch.backends.cpu.get_cpu_capability(), *native_bf16(torch.device('cpu')))"
    )
    proc = run([sys.executable, "-c", code], **AVX2_STAND_IN)
    assert proc.returncode == 0, output(proc)
    assert proc.stdout.startswith("AVX2 False this CPU has no native bf16"), proc.stdout


@pytest.mark.parametrize("native", [True, False])
def test_auto_precision_is_resolved_before_anything_records_it(
    monkeypatch, caplog, tmp_path, native
):
    """trainer.precision=auto trains in bf16 on a CPU with native bf16, in 32 on one without,
    says which and why in one line, and result.json, the checkpoints' config and eval.py see
    the value that trained."""
    from tests.helpers import eval_in_process, read_json

    fake_cpu(monkeypatch, "AVX512" if native else "AVX2", native, False)
    caplog.set_level(logging.INFO, logger="components.precision")
    run_dir, chosen = tmp_path / "run", "bf16" if native else "32"
    train_in_process(run_dir, *QUICK, "trainer.precision=auto")
    said = [r.getMessage() for r in caplog.records if r.name == "components.precision"]
    why = "native bf16: AVX512 with AVX512-BF16" if native else "no native bf16: AVX2"
    assert said == [f"trainer.precision=auto: {chosen} (this CPU has {why})"]
    assert result(run_dir)["app"]["precision"] == chosen
    config = load_checkpoint(run_dir / "checkpoints" / "best.pt")["config"]
    assert OmegaConf.create(config).trainer.precision == chosen
    caplog.clear()
    acc = eval_in_process(tmp_path / "eval", f"run={run_dir}", "trainer.precision=auto")
    assert acc == read_json(run_dir / "result.json")["app"]["test"]["test/acc"]
    said = [r.getMessage() for r in caplog.records if r.name == "components.precision"]
    assert said == [f"trainer.precision=auto: {chosen} (this CPU has {why})"]


@pytest.mark.slow
def test_the_mnist_recipe_trains_in_32_on_a_cpu_without_native_bf16(tmp_path):
    """`python train.py dataset=mnist` on 2 ranks under the AVX2 stand-in: its recipe's
    precision (auto) is 32, said once in the log (both ranks follow rank 0), and result.json,
    the checkpoint's config and the W&B run's config say 32; the composed config keeps auto."""
    from tests.helpers import OFFLINE, make_mnist, offline_runs, read_json

    make_mnist(tmp_path / "data")
    run_dir = tmp_path / "run"
    cmd = train_cmd(
        "dataset=mnist",
        f"dataset.root={tmp_path / 'data'}",
        "dist.nproc_per_node=2",
        "trainer.max_epochs=1",
        "trainer.progress_bar=false",
        OFFLINE,
        f"hydra.run.dir={run_dir}",
    )
    proc = run(cmd, timeout=300, **AVX2_STAND_IN)
    assert proc.returncode == 0, output(proc)
    said = [line for line in output(proc).splitlines() if "trainer.precision=auto" in line]
    assert len(said) == 1, output(proc)
    assert said[0].endswith(
        "trainer.precision=auto: 32 (this CPU has no native bf16 for oneDNN: AVX2, "
        "ONEDNN_MAX_CPU_ISA=AVX2)"
    )
    assert read_json(run_dir / "result.json")["app"]["precision"] == "32"
    config = OmegaConf.create(load_checkpoint(run_dir / "checkpoints" / "last.pt")["config"])
    assert config.trainer.precision == "32"
    (wandb_run,) = offline_runs(run_dir)
    assert wandb_run.config["trainer"]["precision"] == "32"
    assert OmegaConf.load(run_dir / ".hydra" / "config.yaml").trainer.precision == "auto"
