"Trackers and plots with real processes: TensorBoard events on 1 and 2 processes, wandb offline, the plot CLI."
import importlib.util
import json
import os
import subprocess

import pytest
import yaml

from conftest import ACCELERATE, PY, ROOT, free_port, run_cli

# Logs 5 train records and 1 eval record through the trackers `--tracker ARGV[2]` gives, as the trainer would.
SCRIPT = '''
import sys
from distcourse.launch import make_accelerator
from distcourse.tracking import log_metrics, resolve_tracker, resource_stats, start_tracking
out, tracker = sys.argv[1], sys.argv[2]
acc = make_accelerator(log_with=resolve_tracker(tracker) or None, project_dir=out)
start_tracking(acc, "proj", {"model": "tiny", "betas": [0.9, 0.95], "resume": None, "optim": {"name": "adamw"}})
for step in range(1, 6):
    log_metrics(acc, {"step": step, "loss": 10.0 / step, "lr": 1e-3 * step, **resource_stats(acc.device)})
log_metrics(acc, {"step": 5, "split": "val", "loss": 2.5, "samples": 10, "perplexity": 12.2})
acc.wait_for_everyone()
acc.end_training()
sys.stdout.write(f"rank {acc.process_index} of {acc.num_processes}\\n"); sys.stdout.flush()  # one write(): lines
# of the two ranks cannot interleave (print() writes the text and the newline separately)
'''


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "log_some.py"
    path.write_text(SCRIPT)
    return path


def scalars(logdir) -> dict:
    "{tag: [(step, value)]} of the TensorBoard event files directly in `logdir`."
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ea = EventAccumulator(str(logdir))
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


def check_events(logdir):
    s = scalars(logdir)
    assert [step for step, _ in s["train/loss"]] == [1, 2, 3, 4, 5]
    assert [v for _, v in s["train/loss"]] == pytest.approx([10.0, 5.0, 10 / 3, 2.5, 2.0], rel=1e-6)
    assert s["val/perplexity"] == [(5, pytest.approx(12.2, rel=1e-6))]
    assert s["train/rss_mb"][0][1] > 50  # a Python process with torch loaded holds more than 50 MB
    hparams = yaml.safe_load(next(logdir.glob("*/hparams.yml")).read_text())
    assert hparams == {"model": "tiny", "betas": "[0.9, 0.95]", "resume": "None", "optim/name": "adamw"}


NEEDS_TENSORBOARD = pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None and not os.getenv("CI"),
                                       reason="needs the tensorboard extra; CI installs it, and fails here without it")


@NEEDS_TENSORBOARD
def test_tensorboard_one_process(tmp_path, script):
    proc = run_cli([PY, str(script), str(tmp_path / "run"), "tensorboard"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no supported trackers" not in proc.stderr
    check_events(tmp_path / "run/proj")  # TensorBoard writes to project_dir/<project_name>/


@NEEDS_TENSORBOARD
def test_tensorboard_two_processes_one_writer(tmp_path, script):
    proc = run_cli([*ACCELERATE, "--multi_gpu", "--num_processes", "2", "--main_process_port", str(free_port()),
                    str(script), str(tmp_path / "run"), "tensorboard"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {"rank 0 of 2", "rank 1 of 2"} <= set(proc.stdout.splitlines())  # a real 2-process run
    assert len(list((tmp_path / "run/proj").glob("events.out.tfevents.*"))) == 1  # only the main process writes
    check_events(tmp_path / "run/proj")


def test_tracker_none_writes_nothing(tmp_path, script):
    proc = run_cli([PY, str(script), str(tmp_path / "run"), "none"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()
    assert "no supported trackers" not in proc.stderr


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None and not os.getenv("CI"),
                    reason="needs the wandb extra; CI installs it, and fails here without it")
def test_wandb_offline_without_key(tmp_path, script):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}  # no key, no mode: the default
    proc = subprocess.run([PY, str(script), str(tmp_path / "run"), "wandb"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = list((tmp_path / "run/wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("run-*.wandb")), sorted((tmp_path / "run").rglob("*"))


# --- plot_run from the command line, on a real trainer run ---

@pytest.fixture(scope="module")
def run(tmp_path_factory):
    "A 6-step tiny run logging every step, and a copy that looks resumed (steps 4-6 logged twice)."
    tmp = tmp_path_factory.mktemp("plot")
    proc = run_cli([PY, "-m", "distcourse.train", "--config", str(ROOT / "configs/tiny.yaml"), "--max_steps", "6",
                    "--log_every", "1", "--eval_every", "3", "--output_dir", str(tmp / "run")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = tmp / "resumed"
    resumed.mkdir()
    lines = (tmp / "run/metrics.jsonl").read_text().splitlines()
    again = [json.dumps({**json.loads(l), "loss": 1.0}) for l in lines if json.loads(l)["step"] >= 4]
    (resumed / "metrics.jsonl").write_text("\n".join(lines + again) + "\n")
    return tmp


def plot(*args):
    return run_cli([PY, "-m", "distcourse.tracking", *map(str, args)])


def is_png(path):
    return path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_plot_cli_several_runs(run):
    proc = plot(run / "run", run / "resumed", "--out", run / "both.png")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == f"wrote {run / 'both.png'}"
    assert is_png(run / "both.png")
    proc = plot(run / "run")  # default: metrics.png in the (first) run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert is_png(run / "run/metrics.png")


def test_plot_keeps_last_record_of_a_step(run):
    from distcourse.tracking import plot_run, read_metrics
    m = read_metrics(run / "resumed")
    assert [r["step"] for r in m["train"]] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in m["train"]][3:] == [1.0, 1.0, 1.0]
    fig = plot_run(run / "run", run / "resumed")
    loss = fig.axes[0]
    assert [l.get_label() for l in loss.get_lines()] == ["run train loss", "run val loss",
                                                         "resumed train loss", "resumed val loss"]
    assert list(loss.get_lines()[2].get_ydata())[3:] == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("case, says", [("missing", "no such directory"), ("no_metrics", "has no metrics.jsonl"),
                                        ("empty", "is empty"), ("garbage", "line 1 is not JSON")])
def test_plot_cli_bad_input(tmp_path, case, says):
    d = tmp_path / case
    if case != "missing": d.mkdir()
    if case == "empty": (d / "metrics.jsonl").write_text("")
    if case == "garbage": (d / "metrics.jsonl").write_text("step=1 loss=2\n")
    proc = plot(d, "--out", tmp_path / "x.png")
    assert proc.returncode == 2
    assert says in proc.stderr and str(d) in proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert not (tmp_path / "x.png").exists()
