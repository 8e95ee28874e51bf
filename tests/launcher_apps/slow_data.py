"""A dataset target for launch/tests/test_launcher.py: a set that local rank 0 "downloads" for
SLOW_DATA_S seconds (dataset.download=true) while the node's other ranks wait for it, as a
large download or the indexing of a big folder on a network file system can take; then
scikit-learn's digits."""

import os
import time


def digits(download: bool = False, root: str = "", val_fraction: float = 0.1, **kwargs):
    from data.catalog import digits as build

    if download and os.environ.get("LOCAL_RANK", "0") == "0":
        time.sleep(float(os.environ["SLOW_DATA_S"]))
    return build(val_fraction=val_fraction, **kwargs)
