"""Which code and config a sweep job or a single run ran, and what changed when it is resumed.

Every attempt's launch.json entry (ddp_launcher/resume.py) holds `code`: the launcher's commit,
whether its tree was dirty and a digest of the uncommitted diff (ddp_launcher/core/repro.py's
git_state: the one git reader of the repo), and a digest of the job's resolved config; the
record keeps the job's first resolved config, flat, to name the keys that changed. A resumed
job whose code or config differs from its first attempt's says so in one line
(:func:`drift_line`); hydra.launcher.on_drift=refuse makes that a user error. A single run
(`python app.py`, with dist.nproc_per_node=N, rank 0 of plain torchrun) records its attempts
in its run dir's launch.json the same way, from its gate (ddp_launcher/resume.py's RunAttempts).
Torch-free.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ddp_launcher.core.errors import UserError

ON_DRIFT = ("warn", "refuse")
# How a job starts, not what it runs (ddp_launcher/core/gate.py's what_runs leaves them out too).
HOW_IT_STARTS = ("resume", "start_over")


@functools.cache  # one git state per launcher process: the code does not change under it
def code_state(run_dir: Path | None = None, where: Path | None = None) -> dict[str, Any]:
    """{commit, dirty, diff_sha256} of the app's code (its repository: git in `where`, default
    ddp_launcher/core/repro.py's code_dir) that the launcher's jobs run; commit None outside a
    git checkout. A `run_dir` inside the repository is not part of the code."""
    from ddp_launcher.core.repro import git_state

    state = git_state(run_dir, where)
    diff = hashlib.sha256(state.diff.encode()).hexdigest()[:16] if state.dirty else None
    return {"commit": state.commit, "dirty": state.dirty, "diff_sha256": diff}


def flat_config(config: DictConfig) -> dict[str, str]:
    """The job's config without Hydra's node, resolved where it resolves, as {dotted key: JSON
    value} (the keys that say how it starts left out)."""
    body = {k: v for k, v in config.items_ex(resolve=False) if k != "hydra"}
    node = OmegaConf.create(body)
    try:
        data = OmegaConf.to_container(node, resolve=True)
    except Exception:  # noqa: BLE001 - an interpolation only a rank resolves (${hydra:...})
        data = OmegaConf.to_container(node, resolve=False)
    flat: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for key, item in value.items():
                walk(f"{prefix}{key}.", item)
        else:
            flat[prefix[:-1]] = json.dumps(value, sort_keys=True, default=str)

    walk("", data)
    return {k: v for k, v in flat.items() if k not in HOW_IT_STARTS}


def config_digest(flat: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(flat, sort_keys=True).encode()).hexdigest()[:16]


def job_code(
    config: DictConfig, run_dir: Path | None = None, task_function: Any = None
) -> tuple[dict[str, Any], dict[str, str]]:
    """(an attempt's `code` entry, the job's flat config); the code is the app's, in the
    folder of its task's module (else Hydra's runtime cwd: repro.py's task_code_dir)."""
    from ddp_launcher.core.repro import task_code_dir

    flat = flat_config(config)
    where = task_code_dir(task_function, config) if task_function is not None else None
    return {**code_state(run_dir, where), "config_sha256": config_digest(flat)}, flat


def changes(
    before: dict[str, Any], now: dict[str, Any], old: dict | None, new: dict[str, str]
) -> list[str]:
    """What differs between two `code` entries (and flat configs): commit a→b, the uncommitted
    changes, the config keys."""
    found = []
    if before.get("commit") != now.get("commit"):
        found.append(f"commit {short(before.get('commit'))}→{short(now.get('commit'))}")
    tree = ("dirty", "diff_sha256")
    if [before.get(k) for k in tree] != [now.get(k) for k in tree]:
        was = "dirty" if before.get("dirty") else "clean"
        found.append(f"uncommitted changes ({was}→{'dirty' if now.get('dirty') else 'clean'})")
    if before.get("config_sha256") != now.get("config_sha256"):
        keys = sorted(k for k in set(old or {}) | set(new) if (old or {}).get(k) != new.get(k))
        found.append(f"config {', '.join(keys)}" if old is not None and keys else "config")
    return found


def short(commit: str | None) -> str:
    return commit[:8] if commit else "none"


def since_first(
    record: Any, config: DictConfig, run_dir: Path | None = None, task_function: Any = None
) -> list[str]:
    """What differs between `config` (and the code now) and the record's first attempt (an
    older launch.json without a `code` entry, or none: nothing to compare)."""
    first = next((a for a in record.attempts if a.code), None) if record is not None else None
    if first is None:
        return []
    now, flat = job_code(config, run_dir, task_function)
    return changes(first.code, now, record.config, flat)


def drift_line(job: Any, record: Any) -> str | None:
    """One line when the job's code or config differs from its first recorded attempt's."""
    task = getattr(job.spec, "task_function", None)
    found = since_first(record, job.spec.config, task_function=task)
    if not found:
        return None
    what = " ".join(job.overrides) or "(no overrides)"
    return f"#{job.num} {what}: changed since its first attempt: {'; '.join(found)}"


def check_on_drift(value: str) -> None:
    if value not in ON_DRIFT:
        raise UserError(
            f"hydra.launcher.on_drift={value}: use warn (say what changed, go on) or refuse "
            "(stop before anything runs)"
        )
