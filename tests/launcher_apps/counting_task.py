"""A task function for launch/tests/test_resume.py's foreign-app sweep (no result.json, no torch):
it
appends its `a` to the file named by RESUME_TEST_CALLS, and a=1 fails until a file beside it,
<calls>.ok, exists (a transient failure)."""

import os
from pathlib import Path


def counting_task(cfg) -> int:
    calls = Path(os.environ["RESUME_TEST_CALLS"])
    with open(calls, "a") as f:
        f.write(f"{cfg.a}\n")
    if cfg.a == 1 and not calls.with_suffix(".ok").exists():
        raise RuntimeError("a transient failure")
    return 10 * cfg.a
