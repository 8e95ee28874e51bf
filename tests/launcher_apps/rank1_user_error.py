"""A dataset target for launch/tests/test_launcher.py: rank 1 alone hits a user error while building
its data (as a corrupt file only its shard reads would), so rank 0 fails in its next
collective only because rank 1 is gone; the other ranks build scikit-learn's digits."""

import os


def digits(**kwargs):
    from ddp_launcher.core.errors import UserError

    from data.catalog import digits as build

    if os.environ.get("RANK") == "1":
        raise UserError("/data/cat/7.jpg is truncated: remove or replace it")
    return build(**kwargs)
