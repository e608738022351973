"""SageMaker's entry point: resume when a spot restart finds a complete checkpoint, then run distcourse.train."""
import sys
from pathlib import Path

from distcourse.checkpoint import latest_checkpoint
from distcourse.train import main

argv = sys.argv[1:]
out = argv[argv.index("--output_dir") + 1] if "--output_dir" in argv else "runs/default"
if latest_checkpoint(out) is not None and "--resume" not in argv: argv += ["--resume", "latest"]
main(argv)
