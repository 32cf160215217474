"""The commit line of the reports the benchmarks write (with the command and date lines beside it)."""

from __future__ import annotations

import datetime
import json
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def project_commit() -> str:
    """``$PROJECT_COMMIT`` if set (a copy of the tree without ``.git``, e.g. on a GPU machine), else git's
    short HEAD, marked when tracked files differ from it; "unknown" without either."""
    if os.environ.get("PROJECT_COMMIT"):
        return os.environ["PROJECT_COMMIT"]

    def git(*args: str) -> str:
        try:
            done = subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return done.stdout.strip() if done.returncode == 0 else ""

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return "unknown (no git checkout; set PROJECT_COMMIT)"
    return head + (" + uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def write_gpu_rows(path: str, command: str, rows: list) -> None:
    """``{"meta": {command, commit, hardware, versions, date}, "rows": rows}`` as JSON at ``path``: the raw rows
    of a one-GPU timing benchmark with what produced them."""
    import torch
    import triton

    meta = {
        "command": command,
        "commit": project_commit(),
        "hardware": torch.cuda.get_device_name(),
        "versions": f"torch {torch.__version__} triton {triton.__version__}",
        "date": datetime.date.today().isoformat(),
    }
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
