"""The plain DDP recipe the benchmark (docs/bench/bench.py) compares train.py against.

    python -m docs.bench.reference --workload A|B|C|D --mode reference|raw --steps N --log-every K
                              [--num-workers W] [--data-root DIR]
    python -m docs.bench.reference --workload E --dataset mnist|fashion_mnist --data-root DIR
                              [--epochs N] [--seed S]
    python -m torch.distributed.run --standalone --nproc-per-node=2 -m docs.bench.reference ...

reference: init_process_group(gloo) -> torchvision dataset (FakeData, MNIST, ImageFolder) with
v1 transforms (ToTensor + Normalize, after the same augmentation) + DistributedSampler +
DataLoader (W workers) -> model (DDP when world size > 1) -> SGD; set_epoch each epoch;
forward, backward, step. Nothing else. Same data, augmentation, model, optimizer and per-rank
batch as train.py's config.
raw: the same model and optimizer on one pre-built batch of random tensors, reused every step:
the ceiling for this model on this machine.

Throughput is measured the way train.py measures it (its metrics.jsonl rows): samples/s per
window of K steps on rank 0, timed from the start of the epoch's loop; docs.bench.bench takes the
median after the warm-up window(s). Rank 0 prints one line: RESULT_TAG + JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torchvision import transforms as v1

from docs.bench.common import RESULT_TAG, process_age
from docs.bench.workloads import D_CHANNELS, D_HIDDEN, PLAIN_LR, WORKLOADS

# train.py's data.transforms constants, restated so this script stays the plain recipe
# (tests/test_bench.py checks that they agree).
FAKE_NORM = ((0.5, 0.5, 0.5), (0.29, 0.29, 0.29))
MNIST_NORM = ((0.1307,), (0.3081,))
FASHION_MNIST_NORM = ((0.2860,), (0.3530,))
IMAGENET_NORM = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))  # imagefolder's
MNIST_PADDING = 3  # conf/dataset/mnist.yaml's augment=shift: 28 // 8
LR, MOMENTUM, WEIGHT_DECAY = PLAIN_LR, 0.9, 5e-4  # conf/optim/sgd.yaml's at the batch of 64
# Workload E's seed recipe: the lesson's plain loop at train.py's default global batch (before
# the time-to-accuracy recipes: b2beecb's), for b2beecb's 5 epochs; val: conf/dataset/mnist.yaml's
# val_fraction.
SEED_BATCH, SEED_EPOCHS, VAL_FRACTION = 64, 5, 0.1
VAL_TAG, TEST_TAG = "E_VAL ", "E_TEST "


def build_dataset(workload: str, size: int, data_root: str | None):
    to_tensor = [v1.ToTensor(), v1.Normalize(*FAKE_NORM)]
    if workload in ("A", "C"):  # conf/dataset/fake.yaml: no augmentation
        return torchvision.datasets.FakeData(size, (3, 32, 32), 10, transform=v1.Compose(to_tensor))
    if workload == "B":  # conf/dataset/mnist.yaml: augment=shift (random 28px crop, padding 3)
        tf = v1.Compose(
            [v1.RandomCrop(28, padding=MNIST_PADDING), v1.ToTensor(), v1.Normalize(*MNIST_NORM)]
        )
        return torchvision.datasets.MNIST(data_root, train=True, transform=tf)
    # conf/dataset/imagefolder.yaml: augment=random_resized_crop (scale 0.08-1, ratio 3/4-4/3)
    tf = v1.Compose(
        [
            v1.RandomResizedCrop(WORKLOADS["D"].shape[-1]),
            v1.RandomHorizontalFlip(),
            v1.ToTensor(),
            v1.Normalize(*IMAGENET_NORM),
        ]
    )
    return torchvision.datasets.ImageFolder(os.path.join(data_root, "train"), transform=tf)


def build_model(workload: str) -> nn.Module:
    if workload in ("A", "C"):  # conf/model/resnet18.yaml (models/torchvision.py)
        model = torchvision.models.get_model("resnet18", weights=None, num_classes=10)
        if workload == "A":  # small_input_stem=true
            model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
            model.maxpool = nn.Identity()
        return model
    from models.small_cnn import SmallCNN  # conf/model/small_cnn.yaml

    if workload == "B":
        return SmallCNN(num_classes=10, in_channels=1, image_size=28)
    return SmallCNN(
        num_classes=10,
        in_channels=3,
        image_size=WORKLOADS["D"].shape[-1],
        channels=D_CHANNELS,
        hidden=D_HIDDEN,
    )


def init_gloo() -> tuple[int, int]:
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


def seed_recipe(args: argparse.Namespace) -> None:
    """Workload E's seed recipe (the DDP lesson's): the small CNN, SGD at a constant lr with
    momentum, no augmentation (ToTensor + Normalize), DistributedSampler + set_epoch; after each
    epoch rank 0 validates on the same val split train.py carves (data.datasets.carve_val:
    10 %, by class, fixed seed) and prints VAL_TAG + {epoch, val_acc, time}; after ``--epochs``
    (its recipe's end) it tests on the official test set and prints TEST_TAG + {test_acc}."""
    from data.datasets import carve_val

    rank, world = init_gloo()
    torch.manual_seed(args.seed)
    cls = {"mnist": torchvision.datasets.MNIST, "fashion_mnist": torchvision.datasets.FashionMNIST}
    norm = {"mnist": MNIST_NORM, "fashion_mnist": FASHION_MNIST_NORM}[args.dataset]
    tf = v1.Compose([v1.ToTensor(), v1.Normalize(*norm)])
    full = cls[args.dataset](args.data_root, train=True, transform=tf)
    train, val = carve_val(full, VAL_FRACTION)
    sampler = DistributedSampler(train, shuffle=True)
    loader = DataLoader(train, batch_size=SEED_BATCH // world, sampler=sampler)
    model = small_cnn(1, 28)
    ddp = DDP(model) if world > 1 else model
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        for x, y in loader:
            loss = F.cross_entropy(ddp(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        if rank == 0:
            acc = accuracy(model, DataLoader(val, batch_size=1000))
            print(VAL_TAG + json.dumps({"epoch": epoch + 1, "val_acc": acc, "time": time.time()}))
            sys.stdout.flush()
        dist.barrier()
    if rank == 0:
        test = cls[args.dataset](args.data_root, train=False, transform=tf)
        acc = accuracy(model, DataLoader(test, batch_size=1000))
        print(TEST_TAG + json.dumps({"test_acc": acc}), flush=True)
    dist.destroy_process_group()


@torch.no_grad()
def accuracy(model: nn.Module, loader: DataLoader) -> float:
    model.eval()
    correct = total = 0
    for x, y in loader:
        correct += int((model(x).argmax(1) == y).sum())
        total += len(y)
    return correct / total


def small_cnn(in_channels: int, image_size: int) -> nn.Module:
    from models.small_cnn import SmallCNN  # conf/model/small_cnn.yaml's defaults

    return SmallCNN(num_classes=10, in_channels=in_channels, image_size=image_size)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=sorted([*WORKLOADS, "E"]), required=True)
    p.add_argument("--mode", choices=("reference", "raw"), default="reference")
    p.add_argument("--steps", type=int, help="optimizer steps to run")
    p.add_argument("--log-every", type=int, help="steps per throughput window")
    p.add_argument("--data-root", help="MNIST root (workloads B, E), ImageFolder root (D)")
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader workers per rank")
    p.add_argument("--dataset", choices=("mnist", "fashion_mnist"), help="workload E's data")
    p.add_argument("--epochs", type=int, default=SEED_EPOCHS, help="workload E: its end")
    p.add_argument("--seed", type=int, default=0, help="workload E: torch.manual_seed")
    args = p.parse_args()
    if args.workload == "E":
        if args.dataset is None or args.data_root is None:
            p.error("--workload E needs --dataset and --data-root")
        return seed_recipe(args)
    if args.steps is None or args.log_every is None:
        p.error(f"--workload {args.workload} needs --steps and --log-every")
    spec = WORKLOADS[args.workload]

    rank, world = init_gloo()
    torch.manual_seed(0)
    batch = spec.global_batch // world

    if args.mode == "reference":
        dataset = build_dataset(args.workload, args.steps * spec.global_batch, args.data_root)
        sampler = DistributedSampler(dataset, shuffle=True)
        loader = DataLoader(
            dataset,
            batch_size=batch,
            sampler=sampler,
            num_workers=args.num_workers,
            persistent_workers=args.num_workers > 0,
        )
        epochs = -(-args.steps // len(loader))
    else:
        x = torch.randn(batch, *spec.shape)
        y = torch.randint(0, 10, (batch,))
        loader, sampler, epochs = [(x, y)] * args.steps, None, 1

    model = build_model(args.workload)
    if world > 1:
        model = DDP(model)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY
    )

    step, rates, first_step_s = 0, [], None
    for epoch in range(epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        tic, window = time.perf_counter(), 0
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step, window = step + 1, window + 1
            if first_step_s is None:
                first_step_s = process_age()
            if step % args.log_every == 0:
                rates.append(window * len(x) * world / (time.perf_counter() - tic))
                tic, window = time.perf_counter(), 0
            if step == args.steps:
                break

    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    per_rank: list = [None] * world
    dist.all_gather_object(per_rank, peak_mb)
    if rank == 0:
        result = {
            "workload": args.workload,
            "mode": args.mode,
            "world_size": world,
            "steps": step,
            "window_rates": rates,
            "time_to_first_step_s": first_step_s,
            "peak_memory_mb_per_rank": per_rank,
        }
        print(RESULT_TAG + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
