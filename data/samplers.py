"""Distributed samplers: resumable training shards and exact (unpadded) validation shards."""

from __future__ import annotations

from collections.abc import Iterator

from torch.utils.data import DistributedSampler, Sampler


class ResumableDistributedSampler(DistributedSampler):
    """torch's DistributedSampler (same order, same shard per rank) that can resume mid-epoch.

    Differences from the parent:

    * it yields ``(epoch, index)`` tuples, not bare ints, so the dataset can seed each sample's
      augmentation from (seed, epoch, index) (see data.seeding.EpochSeededDataset, which also
      accepts bare ints). Wrap any other dataset accordingly before using this sampler.
    * ``skip(n)``: iteration skips the first ``n`` samples of this rank's shard, and ``len``
      shrinks by ``n``, until the next ``set_epoch`` clears it. Resuming after k optimizer steps
      of a per-rank batch B is ``set_epoch(epoch); skip(k * B)``.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._skip = 0

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self._skip = 0

    def skip(self, n_samples: int) -> None:
        if not 0 <= n_samples <= self.num_samples:
            raise ValueError(
                f"skip({n_samples}): must be between 0 and this rank's {self.num_samples} samples"
            )
        self._skip = int(n_samples)

    def __iter__(self) -> Iterator[tuple[int, int]]:  # type: ignore[override]
        epoch = self.epoch
        indices = list(super().__iter__())[self._skip :]
        return iter([(epoch, index) for index in indices])

    def __len__(self) -> int:
        return self.num_samples - self._skip


class ExactShardSampler(Sampler[int]):
    """Rank r of W gets indices r, r+W, r+2W, ... : every index exactly once across ranks.

    DistributedSampler pads the last shards with duplicates so all ranks get equal counts; for
    validation that counts some samples twice and biases the metrics. Here shards may differ
    in length by one, so the caller must reduce metric sums and counts once after the loop,
    not run collectives per batch.
    """

    def __init__(self, dataset_len: int, rank: int, world_size: int) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world={world_size}")
        if dataset_len < 0:
            raise ValueError(f"dataset_len must be >= 0, got {dataset_len}")
        self.dataset_len = dataset_len
        self.rank = rank
        self.world_size = world_size

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.dataset_len, self.world_size))

    def __len__(self) -> int:
        return len(range(self.rank, self.dataset_len, self.world_size))
