"""An image folder's tree as torchvision's ImageFolder reads it (`<root>/<split>/<class>/...`),
torch-free: walked by the gate's checks before a run dir opens (conf/checks.py, in the
launcher's process too, where no torch is imported), so that what would stop the run is said
before anything is written: a link back into the dataset (torchvision's walk would follow it
again and again), a class folder without an image, or, with dataset.skip_unreadable=true,
without one readable image; and by data/catalog.py when it builds the dataset (walk_once,
looks_readable), so that both walks find the same files and refuse the same trees.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from ddp_launcher import UserError

# torchvision.datasets.folder.IMG_EXTENSIONS (tests/test_data.py checks they stay the same)
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def is_image_name(name: str) -> bool:
    return name.lower().endswith(IMG_EXTENSIONS)


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()  # follows a link, as os.walk does
    except OSError:
        return False


def walk_once(top: str, guarded: Sequence[str]) -> list[tuple[str, list[str]]]:
    """(dir, its file names sorted) of ``top`` and every dir below it, sorted by dir: what
    torchvision's make_dataset reads from ``sorted(os.walk(top, followlinks=True))``, links to
    dirs followed alike, but each real dir once. os.walk keeps no record of the dirs it visited
    (Python's docs: a link to a parent of itself recurses without end), so a link back up the
    tree reads its images again and again; here a link into one of ``guarded`` (the
    dataset's split dirs, real paths: its own tree, or another split's images) or above one,
    and a dir reached twice, stop the run naming the link."""
    found: list[tuple[str, list[str]]] = []
    seen: set[str] = set()
    stack = [top]
    while stack:
        path = stack.pop()
        real = os.path.realpath(path)
        if real in seen:
            raise UserError(
                f"image folder {path} is the folder {real}, read already through another "
                "link: its images would count twice; remove one of the links"
            )
        seen.add(real)
        try:
            entries = list(os.scandir(path))
        except OSError:  # a dir that cannot be listed is skipped, as os.walk skips it
            continue
        dirs = [e for e in entries if _is_dir(e)]
        found.append((path, sorted(e.name for e in entries if not _is_dir(e))))
        for entry in dirs:
            target = os.path.realpath(entry.path) if entry.is_symlink() else None
            if target is not None and any(
                _within(target, g) or _within(g, target) for g in guarded
            ):
                raise UserError(
                    f"the link {entry.path} -> {target} leads back into the dataset's own "
                    "folders: its images would be read again (or leak from one split into "
                    "another); remove the link, or copy in what it should add"
                )
            stack.append(entry.path)
    return sorted(found)


def guarded_dirs(root: str) -> list[str]:
    """The real paths of the dataset's split dirs: a link into one of them is refused."""
    splits = (os.path.join(root, s) for s in ("train", "val", "test"))
    return [os.path.realpath(d) for d in splits if os.path.isdir(d)]


def looks_readable(path: str) -> bool:
    """A cheap check of an image file (its size, header and last bytes, not its pixels): not
    empty, an image format PIL knows, and a JPEG or PNG not cut short (its end marker there)."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            kind = image.format
        with open(path, "rb") as f:
            f.seek(-12, os.SEEK_END)
            tail = f.read()
    except (OSError, ValueError, SyntaxError):  # PIL's errors for files it cannot identify
        return False
    if kind == "JPEG":
        return tail.rstrip(b"\0").endswith(b"\xff\xd9")
    if kind == "PNG":
        return tail[4:8] == b"IEND"
    return True


def empty_class_error(root: str, empty: list[str], readable: bool = False) -> UserError:
    """The line for class folders (`<split>/<class>`) that hold no image (or, under
    dataset.skip_unreadable=true, no readable one; data/catalog.py says it the same way)."""
    names = f"{', '.join(empty[:5])}{', ...' if len(empty) > 5 else ''}"
    if readable:
        return UserError(
            f"class folder {names} of {root} holds no readable image (dataset.skip_unreadable="
            "true leaves its unreadable files out): put readable images there, or remove the "
            "folder"
        )
    return UserError(
        f"class folder {names} of {root} holds no image: put its images there, or remove the "
        "folder (a class needs images in train/ and in val/, test/ if present)"
    )


def check_image_tree(
    root: str, splits: Sequence[str] = ("train", "val", "test"), skip_unreadable: bool = False
) -> None:
    """The tree under `root` as a run would read it, without reading an image's pixels: every
    split dir walked once (links that lead back into the dataset, or a folder reached twice: a
    UserError naming the link), every class folder holding an image file (with
    `skip_unreadable`, one that looks readable: the first that does ends the search, so a
    class costs one file's header, not all of them). A root or split that is not there is the
    dataset's to say (it names the fix)."""
    root = os.path.abspath(os.path.expanduser(str(root)))
    guarded = guarded_dirs(root)
    empty, unreadable = [], []
    for split in splits:
        split_dir = os.path.join(root, split)
        if not os.path.isdir(split_dir):
            continue
        try:
            classes = sorted(e.name for e in os.scandir(split_dir) if _is_dir(e))
        except OSError:
            continue
        for name in classes:
            files = [
                os.path.join(folder, f)
                for folder, names in walk_once(os.path.join(split_dir, name), guarded)
                for f in names
                if is_image_name(f)
            ]
            if not files:
                empty.append(f"{split}/{name}")
            elif skip_unreadable and not any(looks_readable(f) for f in files):
                unreadable.append(f"{split}/{name}")
    if empty:
        raise empty_class_error(root, empty)
    if unreadable:
        raise empty_class_error(root, unreadable, readable=True)
