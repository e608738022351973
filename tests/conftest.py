import os, socket, subprocess, sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Tests never reach the Hub: everything they use is built offline.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cli(args, cwd=ROOT, timeout=600, env=None):
    "Run a command line, returning the CompletedProcess (text mode)."
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.fixture
def cli():
    return run_cli


PY = sys.executable
ACCELERATE = [PY, "-m", "accelerate.commands.launch"]
