#!/usr/bin/env bash
# The package on its own (launch/README.md): a fresh venv holding only torch (the CPU build pip
# takes from this machine's disk), `pip install ./launch` and pytest, and nothing of this
# checkout importable; there the example app (launch/examples/) runs one 2-rank run and
#   (a) a torchrun sweep over world sizes 1 and 2,
#   (b) a sweep whose launcher is SIGKILLed mid-sweep, then resumed to the end,
#   (c) an Optuna search whose pruner stops trials,
#   (d) `python -m ddp_launcher.report` on a sweep dir,
# and Hydra's own launcher suites run against the installed package (test_hydra_suites.py).
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

step "a fresh venv in $venv: $torch_spec, ./launch[optuna,report] (not editable), pytest ${more_specs[*]}"
"${DDP_LAUNCHER_PYTHON:-python3}" -m venv --clear "$venv"
# pip builds in the source tree (build/, *.egg-info): a copy keeps the checkout clean and an
# earlier build's leftovers out of the wheel.
mkdir "$work/src" && cp -r "$launch" "$work/src/launch" && rm -rf "$work/src/launch/build"
find "$work/src/launch" -maxdepth 1 -name '*.egg-info' -exec rm -rf {} +
# the example's search and report need the optuna and report extras
"$py" -m pip install -q "$torch_spec" "$work/src/launch[optuna,report]" pytest "${more_specs[@]}" \
  >"$work/pip.log" 2>&1 ||
  { tail -n 30 "$work/pip.log" >&2; fail "pip install (its log above)"; }

# Everything below runs outside the checkout, on a copy of the example app.
cp -r "$launch/examples" "$work/app"
cd "$work/app"
"$py" - "$torch_spec" <<'EOF' || fail "the venv imports something it should not (above)"
import importlib.metadata, importlib.util, sys, torch, ddp_launcher
assert "site-packages" in ddp_launcher.__file__, ddp_launcher.__file__
wanted = sys.argv[1].partition("==")[2]  # torch==X: that version (else whatever pip chose)
assert torch.__version__.startswith(wanted), (torch.__version__, wanted)
print("torch", torch.__version__, "hydra-core", importlib.metadata.version("hydra-core"))
for module in ("train", "components", "models", "torchvision"):  # the fork's, torchvision
    assert importlib.util.find_spec(module) is None, f"{module} is importable"
EOF

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

step "Hydra's launcher suites against the installed package"
mkdir "$work/suites" && cp "$launch/tests/test_hydra_suites.py" "$work/suites/"
cd "$work/suites"
"$py" -m pytest -q -p no:cacheprovider -o "markers=slow: starts processes" test_hydra_suites.py ||
  fail "Hydra's launcher suites"

step "every check passed"
