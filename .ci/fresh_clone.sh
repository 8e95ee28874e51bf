#!/usr/bin/env bash
# What a new user gets: a fresh `git clone` of this checkout's commit, a fresh venv, and README
# command 2 exactly as the README writes it (`pip install -r requirements.txt && python -m
# pytest`), N times in a row, each in a new clone and venv (both removed afterwards; pip's
# download cache is reused, as on a user's machine). Prints each run's counts and wall time,
# then all of them; exit status 1 when a run failed.
#
#   .ci/fresh_clone.sh [N]                 (default 1)
#   PYTHON=python3.12 .ci/fresh_clone.sh   the venv's interpreter (default python3)
#   PYTEST_ADDOPTS='-k test_docs' .ci/fresh_clone.sh 1
#                                          a selection, to check the script itself: pytest
#                                          reads PYTEST_ADDOPTS, the command stays verbatim
#
# Each run's log is kept (the folder is printed). Uncommitted changes are not in the clone.
set -euo pipefail
runs=${1:-1}
[[ $runs =~ ^[1-9][0-9]*$ ]] || { echo "usage: .ci/fresh_clone.sh [N], N a count of runs" >&2; exit 2; }
python=${PYTHON:-python3}
command -v "$python" >/dev/null || { echo "no $python here: set PYTHON to an interpreter" >&2; exit 2; }
repo=$(cd "$(dirname "$0")/.." && pwd)
commit=$(git -C "$repo" rev-parse HEAD)
# a worktree's .git is a file: clone from the repository that holds its objects
source_repo=$(cd "$repo" && cd "$(git rev-parse --git-common-dir)" && pwd)
if [[ -n $(git -C "$repo" status --porcelain --untracked-files=no) ]]; then
  echo "note: $repo has uncommitted changes; the clones hold commit ${commit:0:12} only" >&2
fi
logs=$(mktemp -d "${TMPDIR:-/tmp}/fresh-clone-logs.XXXXXX")
work=""
trap '[[ -n $work ]] && rm -rf "$work"' EXIT
export PIP_DISABLE_PIP_VERSION_CHECK=1
unset PYTHONPATH VIRTUAL_ENV

summaries=()
failed=0
for run in $(seq "$runs"); do
  begin=$(date +%s)
  work=$(mktemp -d "${TMPDIR:-/tmp}/fresh-clone.XXXXXX")
  git clone --quiet --no-checkout "$source_repo" "$work/clone"
  git -C "$work/clone" checkout --quiet --detach "$commit"
  # the venv where .ci/run makes it, inside the clone: a venv's paths under the checkout are
  # what CI's tests see (torchrun's own traceback has frames there)
  venv=$work/clone/.ci/venv
  "$python" -m venv "$venv"
  # README command 2 as the README writes it (the line under "# 2. ", as .ci/run reads it)
  readme_tests=$(grep -A1 '^# 2\. ' "$work/clone/README.md" | tail -n 1)
  [[ $readme_tests == *"python -m pytest"* ]] || { echo "README command 2 not found" >&2; exit 1; }
  log=$logs/run-$run.log
  echo "== run $run of $runs: commit ${commit:0:12}, $("$venv/bin/python" --version), in $work"
  echo "   \$ $readme_tests${PYTEST_ADDOPTS:+   (PYTEST_ADDOPTS=$PYTEST_ADDOPTS)}"
  start=$(date +%s)
  status=0
  (
    cd "$work/clone"
    # shellcheck disable=SC1091
    source "$venv/bin/activate"
    eval "$readme_tests"
  ) >"$log" 2>&1 || status=$?
  wall=$(($(date +%s) - start))
  if ! check=$("$venv/bin/python" -m pip check 2>&1); then
    [[ $status != 0 ]] || status=1
  fi
  check=$(tail -n 1 <<<"$check")
  # pytest's last line: "=== 3 failed, 1058 passed, 2 skipped in 1310.25s (0:21:50) ==="
  counts=$(grep -E '^=+ .*( in [0-9.]+s)' "$log" | tail -n 1 | sed -E 's/^=+ //; s/ =+$//')
  rm -rf "$work"
  work=""
  total=$(($(date +%s) - begin))
  summary="run $run: ${counts:-no pytest summary (see $log)}; README command 2 ${wall} s (install + tests), ${total} s with clone, venv and removal; exit $status; pip check: $check"
  echo "   $summary"
  summaries+=("$summary")
  ((status == 0)) || failed=1
done

echo "== $runs run(s) of README command 2 in fresh clones of ${commit:0:12} ($python):"
printf '   %s\n' "${summaries[@]}"
echo "   CPU: $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -n 1), $(nproc) cores; logs in $logs"
exit "$failed"
