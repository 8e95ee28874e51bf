"""The experiment's configs (the YAML groups beside this file), their typed schema (schema.py)
and its checks (checks.py). TRUSTED_TARGETS: the `_target_`s its configs may name, which train.py
and eval.py hand the launcher package's entry point (Hydra 1.4's execution whitelist; the
package trusts only its own). Importing this file imports nothing else."""

# Packages, not single names, so a new class in one of them needs no edit here. A target of
# a package of your own (a dataset, a transform, a model) goes here too: the whitelist must
# come from code, not config, for it to mean anything (Hydra's threat model).
TRUSTED_TARGETS = (
    # the experiment's packages
    "components.*",
    "conf.*",
    "data.*",
    "models.*",
    # libraries its configs name: optimizers, torchvision transforms and models
    "torch.optim.*",
    "torchvision.*",
)
