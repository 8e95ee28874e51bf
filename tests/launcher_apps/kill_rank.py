"""A Hydra app for launch/tests/test_launcher.py: with kill=true, rank 1 SIGKILLs itself at once and
rank 0 waits as if blocked in a collective with it (torchrun's agent then stops it).

    python tests/launcher_apps/kill_rank.py -m hydra/launcher=torchrun kill=true,false
"""

import os
import signal
import time

import hydra
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path=".", config_name="kill_rank")
def main(cfg: DictConfig) -> int:
    if cfg.kill:
        if os.environ.get("RANK") == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)
    return int(os.environ.get("WORLD_SIZE", "1"))


if __name__ == "__main__":
    main()
