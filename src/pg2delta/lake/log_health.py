"""How much a Delta table's log and files have grown since it was last maintained, from its files.

What ``pg2delta status`` watches so that a lake run every few minutes does not slow down unseen:
the commits since the last checkpoint (a reader replays every one of them), the commits since the
last compaction (``OPTIMIZE``, by pg2delta's maintenance or anyone else's) and the small files of
the latest version. Read with pyarrow from the log itself, like the rest of ``status``: no engine.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.fs as pafs

from pg2delta.errors import LakeError
from pg2delta.lake.lake_files import Lake

COMPACTIONS = frozenset({"OPTIMIZE"})  # commitInfo.operation of a compaction, on Apache Spark and delta-rs
# Commits maintenance itself makes after compacting, which add no file: not counted.
NOT_COUNTED = frozenset({"VACUUM START", "VACUUM END"})


@dataclass(frozen=True, slots=True)
class LogHealth:
    commits_since_checkpoint: int  # commits after the newest checkpoint (all of them when there is none)
    # Commits after the newest compaction (VACUUM's own not counted), looked for among the last
    # ``scan`` commits: a figure of ``scan`` means at least that many.
    commits_since_compaction: int
    small_files: int  # data files of the latest version under the size asked


def log_health(lake: Lake, uri: str, files: dict[str, int], *, small_file_size: int, scan: int) -> LogHealth | None:
    """The figures of the Delta table at ``uri`` whose latest version has ``files`` (path -> bytes,
    as :meth:`Lake.files_now` returns them); None when there is no table. Reads at most ``scan``
    commit files, newest first."""
    log_dir = f"{lake.fs_path(uri)}/_delta_log"
    try:
        infos = lake.fs.get_file_info(pafs.FileSelector(log_dir, allow_not_found=True))
    except (OSError, pa.ArrowException) as exc:
        raise LakeError(f"cannot list {log_dir}: {exc}") from exc
    commits: list[int] = []
    checkpoints: list[int] = []
    for info in infos:
        if m := re.fullmatch(r"(\d{20})\.json", info.base_name):
            commits.append(int(m.group(1)))
        elif m := re.fullmatch(r"(\d{20})\.checkpoint(\.\d{10}\.\d{10})?\.parquet", info.base_name):
            checkpoints.append(int(m.group(1)))
    if not commits:
        return None
    latest = max(commits)
    checkpoint = max((v for v in checkpoints if v <= latest), default=-1)
    since_compaction = 0
    oldest = min(commits)
    for version in range(latest, max(oldest, latest - scan + 1) - 1, -1):
        operation = _operation(lake, f"{log_dir}/{version:020d}.json")
        if operation in COMPACTIONS:
            break
        since_compaction += operation not in NOT_COUNTED
    return LogHealth(
        commits_since_checkpoint=latest - checkpoint,
        commits_since_compaction=since_compaction,
        small_files=sum(1 for size in files.values() if size < small_file_size),
    )


def _operation(lake: Lake, path: str) -> str | None:
    """``commitInfo.operation`` of one commit file (None: it has none, or it is gone)."""
    try:
        with lake.fs.open_input_stream(path) as f:
            lines = f.read().decode().splitlines()
    except FileNotFoundError:
        return None
    except (OSError, pa.ArrowException) as exc:
        raise LakeError(f"cannot read {path}: {exc}") from exc
    for line in lines:
        if '"commitInfo"' in line:
            info = json.loads(line).get("commitInfo") or {}
            operation = info.get("operation")
            return str(operation) if operation is not None else None
    return None
