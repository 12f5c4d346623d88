"""What a benchmark's results JSON records besides its figures: commit, dirty flag, arguments, environment."""
from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import torch


def provenance(args: dict) -> dict:
    root = Path(__file__).resolve().parent.parent

    def git(*cmd):
        try:
            return subprocess.run(["git", *cmd], cwd=root, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    status = git("status", "--porcelain")
    import transformers
    return {"commit": git("rev-parse", "HEAD") or None, "dirty": bool(status) if status is not None else None,
            "command": " ".join([Path(sys.executable).name, *sys.argv]), "args": args,
            "env": {"python": platform.python_version(), "torch": torch.__version__,
                    "transformers": transformers.__version__, "cuda": torch.version.cuda,
                    "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor()
                    or platform.machine()}}
