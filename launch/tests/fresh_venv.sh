#!/usr/bin/env bash
# The package on its own (launch/README.md), as a user installs it: its wheel, built here, in a
# fresh venv with torch (the CPU build pip takes from this machine's disk) and pytest, and
# nothing of this checkout importable.
#
# Core only (`pip install hydra_ddp_launcher-*.whl`): none of the extras' packages installed;
#   an unmodified @hydra.main app (it imports nothing of the package) runs a 2-job sweep of 2
#   ranks each; hydra/sweeper=optuna is one line naming the [optuna] extra; the package's own
#   tests that need no extra (test_package.py) and Hydra's launcher suites (test_hydra_suites.py).
# Then `pip install <wheel>[optuna,report]`; the example app (launch/examples/) runs one 2-rank
# run and
#   (a) a torchrun sweep over world sizes 1 and 2,
#   (b) a sweep whose launcher is SIGKILLed mid-sweep, then resumed to the end,
#   (c) an Optuna search whose pruner stops trials,
#   (d) `python -m ddp_launcher.report` on a sweep dir,
#   (e) the app as a git repository: a commit between a sweep and its resume is a drift line
#       (the installed package reads the app's repository), and an app's `resume: <file>`,
#       with no resume hook, reaches the job run again as it was;
# and test_package.py again, with the extras.
#
#   bash launch/tests/fresh_venv.sh [VENV_DIR]   (default: a temp dir, removed at the end;
#                                                 a given VENV_DIR is made anew and kept)
#
# The environment picks what the venv holds beside the package (the workflow's matrix sets them):
#   DDP_LAUNCHER_PYTHON  the interpreter that makes the venv (default: python3)
#   DDP_LAUNCHER_TORCH   torch's pip spec (default: torch==2.13.0, the CPU build on this disk)
#   DDP_LAUNCHER_PIP     more pip specs, e.g. "hydra-core==1.4.0rc3 omegaconf==2.4.1rc1"
set -euo pipefail
launch=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/ddp-launcher.XXXXXX")
trap 'rm -rf "$work"' EXIT
venv=${1:-$work/venv}
py=$venv/bin/python
torch_spec=${DDP_LAUNCHER_TORCH:-torch==2.13.0}
read -r -a more_specs <<<"${DDP_LAUNCHER_PIP:-}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
unset PYTHONPATH

fail() {
  echo "fresh_venv.sh: FAILED: $*" >&2
  exit 1
}
step() { echo "== ${SECONDS}s: $*"; }
# Every package at the version of the repository's lock (requirements.lock), so a run here is
# the same on any day; but for torch and what its own build brings (this venv tests the package
# with another torch than the app's, within the package's own ranges) and what DDP_LAUNCHER_PIP
# names itself.
own=$(for spec in torch "${more_specs[@]}"; do echo "${spec%%[=<>!~ ]*}"; done | paste -sd'|')
grep -viE "^(${own}|nvidia-[a-z0-9-]+|cuda-[a-z-]+|triton)==" "$launch/../requirements.lock" \
  >"$work/constraints.txt"
pip_install() { # quietly, under the lock; its log on failure
  "$py" -m pip install -q -c "$work/constraints.txt" "$@" >"$work/pip.log" 2>&1 ||
    { tail -n 30 "$work/pip.log" >&2; fail "pip install $* (its log above)"; }
  "$py" -m pip check || fail "pip check (above)"
}
# the package's own tests, outside the checkout: they test the installed package
run_tests() {
  rm -rf "$work/suites" && mkdir "$work/suites"
  cp "$launch/tests/test_hydra_suites.py" "$launch/tests/test_package.py" "$work/suites/"
  (cd "$work/suites" &&
    "$py" -m pytest -q -p no:cacheprovider -o "markers=slow: starts processes" "$@") ||
    fail "the package's tests ($*)"
}
commit() { git -c user.email=t@t -c user.name=t commit -qam "$1" && git rev-parse HEAD; }

step "the wheel, built from a copy of ./launch"
# pip builds in the source tree (build/, *.egg-info): a copy keeps the checkout clean and an
# earlier build's leftovers out of the wheel.
mkdir "$work/src" && cp -r "$launch" "$work/src/launch" && rm -rf "$work/src/launch/build"
find "$work/src/launch" -maxdepth 1 -name '*.egg-info' -exec rm -rf {} +
"${DDP_LAUNCHER_PYTHON:-python3}" -m venv --clear "$venv"
"$py" -m pip wheel -q --no-deps -w "$work/dist" "$work/src/launch" >"$work/pip.log" 2>&1 ||
  { tail -n 30 "$work/pip.log" >&2; fail "the wheel did not build (its log above)"; }
wheel=$(ls "$work"/dist/hydra_ddp_launcher-*.whl)

step "core only: $torch_spec, $(basename "$wheel"), pytest ${more_specs[*]}"
pip_install "$torch_spec" "$wheel" pytest "${more_specs[@]}"
extras=$("$py" -m pip list --format=freeze | grep -ioE '^(optuna|wandb|matplotlib|scipy|submitit)==' || true)
[[ -z $extras ]] || fail "a core install holds an extra's package: $extras"
mkdir "$work/plain" && cd "$work/plain"
"$py" - "$torch_spec" <<'EOF' || fail "the venv imports something it should not (above)"
import importlib.metadata, importlib.util, sys, torch, ddp_launcher
assert "site-packages" in ddp_launcher.__file__, ddp_launcher.__file__
wanted = sys.argv[1].partition("==")[2]  # torch==X: that version (else whatever pip chose)
assert torch.__version__.startswith(wanted), (torch.__version__, wanted)
print("torch", torch.__version__, "hydra-core", importlib.metadata.version("hydra-core"))
for module in ("train", "components", "models", "torchvision"):  # the fork's, torchvision
    assert importlib.util.find_spec(module) is None, f"{module} is importable"
EOF
cat >app.py <<'EOF'
import hydra
import torch
import torch.distributed as dist


@hydra.main(version_base=None, config_path=None, config_name=None)
def main(cfg) -> float:
    dist.init_process_group("gloo")
    total = torch.ones(1)
    dist.all_reduce(total)
    print(f"x={cfg.x} rank {dist.get_rank()} of {dist.get_world_size()}: sum {total.item()}")
    dist.destroy_process_group()
    return float(cfg.x)


if __name__ == "__main__":
    main()
EOF
# (its world size from the app contract's dist keys: +dist.nproc_per_node)
"$py" app.py -m hydra/launcher=torchrun +dist.nproc_per_node=2 +dist.backend=gloo +x=1,2 \
  hydra.sweep.dir=plain >plain.log 2>&1 || { cat plain.log >&2; fail "the unmodified app's sweep"; }
for job in 0 1; do
  said=$(cat plain/$job/rank_logs/*/attempt_0/*/stdout.log)
  [[ $(grep -c "of 2: sum 2.0" <<<"$said") == 2 ]] || fail "job $job did not run 2 ranks: $said"
done
set +e
"$py" app.py -m hydra/sweeper=optuna +x=1 hydra.sweep.dir=optuna >optuna.log 2>&1
code=$?
set -e
# the launcher's lines (Hydra's log) and any error; not the app's own warnings (its `import
# torch` without numpy, Hydra's word on its version_base)
said=$(grep -e "\[HYDRA\]" -e "Traceback" -e "Error" optuna.log || true)
[[ $code == 2 && $(grep -c . <<<"$said") == 1 ]] || { cat optuna.log >&2; fail "not one line"; }
grep -q "hydra/sweeper=optuna needs hydra-ddp-launcher\[optuna\]" <<<"$said" ||
  fail "the line does not name the extra: $said"
step "core only: the package's tests and Hydra's launcher suites"
run_tests

step "the extras: $(basename "$wheel")[optuna,report]"
pip_install "$torch_spec" "$wheel[optuna,report]" "${more_specs[@]}"

# Everything below runs outside the checkout, on a copy of the example app.
cp -r "$launch/examples" "$work/app"
cd "$work/app"

# status_of SWEEP_DIR JOB: the job's result.json status ("none" without one)
status_of() {
  "$py" -c 'import json, sys; print(json.load(open(sys.argv[1]))["status"])' \
    "$1/$2/result.json" 2>/dev/null || echo none
}
expect_status() { # SWEEP_DIR STATUS JOB...
  local sweep=$1 want=$2 job got
  shift 2
  for job in "$@"; do
    got=$(status_of "$sweep" "$job")
    [[ $got == "$want" ]] || fail "$sweep/$job/result.json says '$got', not '$want'"
  done
}

step "one run with 2 ranks: python toy_ddp.py dist.nproc_per_node=2 (hands off to torchrun)"
"$py" toy_ddp.py dist.nproc_per_node=2 hydra.run.dir=single || fail "the run exited $?"
expect_status . completed single

step "(a) a torchrun sweep over world sizes 1 and 2"
"$py" toy_ddp.py -m hydra/launcher=torchrun dist.nproc_per_node=1,2 hydra.sweep.dir=worlds ||
  fail "(a) the sweep exited $?"
expect_status worlds completed 0 1
for job in 0 1; do # torch's own per-rank log dirs: <job>/rank_logs/<run id>/attempt_0/<rank>/
  ranks=$(find "worlds/$job/rank_logs" -mindepth 3 -maxdepth 3 -type d | wc -l)
  [[ $ranks == $((job + 1)) ]] || fail "(a) job $job ran $ranks rank(s), not $((job + 1))"
done

step "(b) a sweep whose launcher is SIGKILLed while job 1 trains, then resumed"
slow=(-m hydra/launcher=torchrun seed=1,2,3 samples=40000 epochs=20 hydra.sweep.dir=resumed)
"$py" toy_ddp.py "${slow[@]}" >killed.log 2>&1 &
launcher_pid=$!
for _ in $(seq 600); do # job 1 has saved its first checkpoint
  [[ -f resumed/1/checkpoints/last.pt ]] && break
  kill -0 "$launcher_pid" 2>/dev/null || { cat killed.log >&2; fail "(b) the sweep ended early"; }
  sleep 0.1
done
kill -KILL "$launcher_pid"
wait "$launcher_pid" 2>/dev/null && fail "(b) the launcher was not killed"
[[ -f resumed/1/checkpoints/last.pt ]] || fail "(b) job 1 saved no checkpoint in 60 s"
expect_status resumed completed 0
expect_status resumed none 1 2 # (else the kill came too late to test anything)
"$py" toy_ddp.py "${slow[@]}" hydra.launcher.resume=true || fail "(b) the resume exited $?"
expect_status resumed completed 0 1 2
"$py" - <<'EOF' || fail "(b) the resumed sweep's records (above)"
import json
attempts = {j: json.load(open(f"resumed/{j}/launch.json"))["attempts"] for j in range(3)}
# job 0 completed before the kill: not run again; job 2 never started before it
assert len(attempts[0]) == 1 and len(attempts[2]) == 1, attempts
assert len(attempts[1]) == 2 and attempts[1][1]["continued"], attempts[1]
# job 1 went on from its checkpoint: each epoch trained once (a restart would repeat epoch 1)
epochs = [json.loads(line)["epoch"] for line in open("resumed/1/metrics.jsonl")]
assert epochs.count(1) == 1 and epochs[-1] == 20 and set(epochs) == set(range(1, 21)), epochs
EOF

step "(c) an Optuna search (hparams_search=lr: median pruner, 8 trials, seeded)"
"$py" toy_ddp.py hparams_search=lr hydra.sweep.dir=search || fail "(c) the search exited $?"
pruned=$(cat search/*/result.json | grep -c '"status": "pruned"' || true)
[[ $pruned -ge 1 ]] || fail "(c) no trial was pruned"
"$py" - <<'EOF' || fail "(c) the study's trials (above)"
import optuna
study = optuna.load_study(study_name="search", storage="sqlite:///search/optuna.db")
states = [t.state.name for t in study.trials]
assert len(states) == 8 and "PRUNED" in states and "COMPLETE" in states, states
EOF
echo "$pruned of 8 trials pruned"

step "(d) python -m ddp_launcher.report on the resumed sweep"
rm resumed/summary.csv resumed/summary.md resumed/summary.png
"$py" -m ddp_launcher.report resumed | tee report.txt || fail "(d) the report exited $?"
for name in summary.csv summary.md summary.png; do
  [[ -s resumed/$name ]] || fail "(d) no resumed/$name"
done
grep -q "3 jobs, 3 completed" report.txt || fail "(d) the report does not say 3 jobs completed"

step "(e) the app as a git repository: a commit between a sweep and its resume"
cp -r "$launch/examples" "$work/repo" && cd "$work/repo"
echo "# pretrained weights" >pretrained.pt
# job 1 (seed=2) fails until a file `fixed` is committed; the app has no resume hook
# (resume_key=null), so its own `resume`, a file, must reach the job run again unchanged
cat >>toy_ddp.py <<'EOF'


def failing_once(cfg):
    from pathlib import Path

    from hydra.core.hydra_config import HydraConfig

    here = Path(HydraConfig.get().runtime.output_dir)
    (here / "resume_seen.txt").write_text(str(cfg.resume))
    if cfg.seed == 2 and not (Path(cfg.resume).parent / "fixed").exists():
        raise ValueError("failing on purpose")
    return main(cfg)
EOF
sed -i 's/task="toy_ddp:main"/task="toy_ddp:failing_once"/' toy_ddp.py
git init -q . && git add -A && first=$(commit one)
drift=(-m hydra/launcher=torchrun seed=1,2 epochs=2 hydra.sweep.dir=drift
  hydra.launcher.resume_key=null "resume=$PWD/pretrained.pt")
set +e
"$py" toy_ddp.py "${drift[@]}" >drift.log 2>&1
code=$?
set -e
[[ $code != 0 ]] || { cat drift.log >&2; fail "(e) job 1 did not fail"; }
expect_status drift completed 0
touch fixed && git add fixed && second=$(commit two)
"$py" toy_ddp.py "${drift[@]}" hydra.launcher.resume=true >resumed.log 2>&1 ||
  { cat resumed.log >&2; fail "(e) the resumed sweep exited $?"; }
expect_status drift completed 0 1
grep -q "commit ${first:0:8}→${second:0:8}" resumed.log ||
  { cat resumed.log >&2; fail "(e) no drift line for the app's commit"; }
[[ $(cat drift/1/resume_seen.txt) == "$PWD/pretrained.pt" ]] ||
  fail "(e) the app's resume became $(cat drift/1/resume_seen.txt)"

step "with the extras: the package's tests"
run_tests test_package.py

step "every check passed"
