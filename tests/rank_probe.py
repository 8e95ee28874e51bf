"""A model target that records the draws of the rank building it: `model._target_=
tests.rank_probe.small_cnn`, with RANK_PROBE_LOG naming a file. Each rank appends one JSON line
at its first training forward: a digest of its initial weights (drawn before DDP, from the
run's seed: every rank must draw the same) and of the dropout mask of that forward (the
model's own draw: each rank should draw its own). The mask is the real one: the draw is
replayed from the generator state before it (torch's CPU dropout is `empty_like(x).bernoulli_
(1 - p)`), and checked against the layer's output. Then it trains as `model=small_cnn` does."""

from __future__ import annotations

import hashlib
import json
import os

LOG_ENV = "RANK_PROBE_LOG"


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def small_cnn(**kwargs):
    import torch

    from models.small_cnn import SmallCNN

    model = SmallCNN(**kwargs)
    weights = digest(model.state_dict().values())
    (dropout,) = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    before: list = []

    def save_state(module, inputs):
        if module.training and not before:
            before.append(torch.get_rng_state())

    def record(module, inputs, output):
        if len(before) != 1:
            return
        (x,) = inputs
        state = torch.get_rng_state()
        torch.set_rng_state(before[0])
        mask = torch.empty_like(x).bernoulli_(1 - module.p).bool()
        torch.set_rng_state(state)
        assert torch.equal((output != 0)[x != 0], mask[x != 0]), "not dropout's mask"
        before.append(None)  # once
        with open(os.environ[LOG_ENV], "a") as f:  # one short line: an atomic append
            rank = int(os.environ.get("RANK", "0"))
            f.write(json.dumps({"rank": rank, "weights": weights, "mask": digest([mask])}) + "\n")

    dropout.register_forward_pre_hook(save_state)
    dropout.register_forward_hook(record)
    return model
