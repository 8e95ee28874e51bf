"""Read what W&B wrote in offline mode: the run-<id>.wandb record log.

The file is a LevelDB-style log (32 KiB blocks, 7-byte record headers, FULL/FIRST/MIDDLE/LAST
fragments) of protobuf `Record` messages from wandb.proto.wandb_internal_pb2.
"""

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

from wandb.proto import wandb_internal_pb2 as pb

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _payloads(data: bytes):
    assert data[:4] == b":W&B", "not a W&B record log"
    pos, parts = HEADER, b""
    while pos + HEADER <= len(data):
        room = BLOCK - pos % BLOCK
        if room < HEADER:  # block trailer padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if kind == 0 and length == 0:
            pos += room
            continue
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            parts = chunk
        elif kind == MIDDLE:
            parts += chunk
        elif kind == LAST:
            yield parts + chunk
            parts = b""


@dataclass
class OfflineRun:
    path: Path
    run_id: str = ""
    group: str = ""
    job_type: str = ""
    name: str = ""
    config: dict = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)
    exit_code: int | None = None


def read_run(path: Path) -> OfflineRun:
    run = OfflineRun(path)
    for raw in _payloads(path.read_bytes()):
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run
            run.run_id, run.group, run.job_type, run.name = (
                r.run_id, r.run_group, r.job_type, r.display_name
            )
            for item in r.config.update:
                run.config[item.key] = json.loads(item.value_json)
        elif kind == "history":
            items = record.history.item
            run.history.append(
                {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in items}
            )
        elif kind == "exit":
            run.exit_code = record.exit.exit_code
    return run


def offline_runs(root: Path) -> list[OfflineRun]:
    """Every offline W&B run under `root` (any depth), oldest first."""
    return [read_run(p) for p in sorted(root.rglob("offline-run-*/run-*.wandb"))]
