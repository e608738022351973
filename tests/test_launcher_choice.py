"""The launch says what it does: the shipped launcher configs start the README's commands without Accelerate's
warnings about values nobody passed, a precision given to the launcher is used or refused in one line, the trainer
says what it chose at the start of the run, and running the same command twice works and says where it went."""
import json
import re
import logging
from types import SimpleNamespace

import pytest
import yaml

from conftest import ACCELERATE, PY, ROOT, free_port, run_cli

CONFIGS = sorted((ROOT / "configs/accelerate").glob("cpu-*.yaml"))
# A run of a few seconds: the tiny preset, one optimizer step, fp32 unless a test says otherwise.
QUICK = ["--model", "tiny", "--seq_len", "64", "--max_examples", "300", "--max_steps", "1", "--eval_every", "0",
         "--compile", "false"]
DEFAULTS_WARNING = "were not passed to `accelerate launch` and had defaults used instead"


def launch_args(config):
    "accelerate launch's arguments for `--config_file config`, after its own validation, and what it logged."
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("accelerate.commands.launch")
    logger.addHandler(handler)
    try: args, *_ = _validate_launch_command(launch_command_parser().parse_args(
        ["--config_file", str(config), "-m", "distcourse.train"]))
    finally: logger.removeHandler(handler)
    return args, [r.getMessage() for r in records]


@pytest.mark.fast
@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_shipped_cpu_configs_warn_nothing(config):
    "Each cpu-N.yaml starts N processes as the trainer expects, sets no precision or dynamo, and Accelerate warns of nothing."
    n = int(config.stem.split("-")[1])
    raw = yaml.safe_load(config.read_text())
    assert "mixed_precision" not in raw and "dynamo_config" not in raw  # the trainer's flags decide
    args, logged = launch_args(config)
    assert not any(DEFAULTS_WARNING in m or "set to a value" in m for m in logged), logged
    assert args.num_processes == n and args.multi_gpu == (n > 1)  # several processes need MULTI_GPU, on a CPU too


@pytest.mark.fast
def test_readme_commands_use_shipped_configs():
    "Every --config_file the README and docs pass exists; the README's commands need no unexplained --multi_gpu."
    text = "".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    named = {w.split()[1] for w in re.findall(r"--config_file \S+", text)}
    assert named and all((ROOT / n).is_file() for n in named), named
    assert "--multi_gpu" not in (ROOT / "README.md").read_text()


@pytest.mark.fast
def test_launcher_precision_read_from_its_command_line(monkeypatch, tmp_path):
    "The launcher's --mixed_precision (either spelling) or its config file's key; the script's own flags ignored."
    import distcourse.train as t
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")  # set by every accelerate launch, chosen or not
    conf = tmp_path / "launch.yaml"

    def parent(*argv):
        fake = SimpleNamespace(cmdline=lambda: ["python", "-m", "accelerate.commands.launch", *argv],
                               cwd=lambda: str(tmp_path))
        monkeypatch.setattr(t, "_launcher", lambda: fake)
        return t.launcher_precision()
    assert parent("--mixed_precision", "bf16", "-m", "distcourse.train")[0] == "bf16"
    assert parent("--mixed_precision=fp16", "train.py")[0] == "fp16"
    assert parent("-m", "distcourse.train", "--mixed_precision", "bf16") == (None, None)  # the trainer's flag
    conf.write_text("num_processes: 2\nmixed_precision: no\n")  # YAML 1.1 reads it as False
    assert parent("--config_file", "launch.yaml", "-m", "distcourse.train") == ("no", f"mixed_precision: no in {conf}")
    conf.write_text("num_processes: 2\n")
    assert parent("--config_file", str(conf), "-m", "distcourse.train") == (None, None)  # Accelerate's default: not a choice
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION")
    assert parent("--mixed_precision", "bf16", "-m", "distcourse.train") == (None, None)  # not under accelerate launch


def test_launcher_precision_used_and_said_first(tmp_path):
    "accelerate launch --mixed_precision bf16 trains bf16; the first line of the run says so and why (full tier)."
    proc = run_cli([*ACCELERATE, "--config_file", str(ROOT / "configs/accelerate/cpu-1.yaml"), "--mixed_precision",
                    "bf16", "-m", "distcourse.train", *QUICK, "--output_dir", str(tmp_path / "run")], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert DEFAULTS_WARNING not in proc.stderr + proc.stdout
    lines = [l for l in proc.stdout.splitlines() if l.strip()]
    assert lines[0].startswith("chose: mixed precision bf16 (accelerate launch --mixed_precision bf16, the "
                               "launcher's choice)"), lines[:3]
    assert lines[-1] == lines[0]  # said again at the end
    assert json.loads((tmp_path / "run/run.json").read_text())["mixed_precision"] == "bf16"


def refused(tmp_path, processes):
    "A launch whose launcher precision (bf16) the trainer's flag (no) contradicts: its error lines, one per rank."
    proc = run_cli([*ACCELERATE, "--config_file", str(ROOT / f"configs/accelerate/cpu-{processes}.yaml"),
                    "--mixed_precision", "bf16", "--main_process_port", str(free_port()), "-m", "distcourse.train",
                    *QUICK, "--mixed_precision", "no", "--output_dir", str(tmp_path / "run")], timeout=300)
    assert proc.returncode != 0 and DEFAULTS_WARNING not in proc.stderr
    errors = [l for l in proc.stderr.splitlines() if l.startswith("distcourse.train: error:")]
    assert len(errors) == processes and len(set(errors)) == 1, proc.stderr[-3000:]  # one line on each rank
    assert not (tmp_path / "run/run.json").exists()
    return errors


@pytest.mark.fast
def test_launcher_precision_against_the_trainers_is_refused(tmp_path):
    "A launcher precision that the trainer's flag contradicts: one line, exit 2, before any work."
    errors = refused(tmp_path, 1)
    assert "--mixed_precision no disagrees with the launcher's accelerate launch --mixed_precision bf16" in errors[0]


def test_launcher_precision_refused_on_every_rank(tmp_path):
    "The same refusal from two processes of cpu-2.yaml: every rank says it (full tier)."
    refused(tmp_path, 2)


def test_the_same_command_twice(tmp_path):
    "Run twice, a command naming no output directory: the second run goes to runs/default-2 and says so (full tier)."
    cmd = [PY, "-m", "distcourse.train", *QUICK, "--mixed_precision", "no"]
    first = run_cli(cmd, cwd=tmp_path, timeout=300)
    assert first.returncode == 0 and "holds an earlier run" not in first.stdout, first.stderr[-3000:]
    second = run_cli(cmd, cwd=tmp_path, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    said = second.stdout.splitlines()[0]
    assert said.startswith("runs/default holds an earlier run, so this one writes to runs/default-2"), said
    for d in ("default", "default-2"): assert (tmp_path / "runs" / d / "run.json").is_file(), d


def test_a_second_run_goes_to_a_new_directory(tmp_path):
    """With runs/default holding a run, the same command trains into runs/default-2 and says so in its first line;
    the directory named with --output_dir is refused as before."""
    (tmp_path / "runs/default").mkdir(parents=True)
    (tmp_path / "runs/default/run.json").write_text("{}")  # an earlier run's summary
    cmd = [PY, "-m", "distcourse.train", *QUICK, "--mixed_precision", "no"]
    second = run_cli(cmd, cwd=tmp_path, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    said = second.stdout.splitlines()[0]
    assert said == ("runs/default holds an earlier run, so this one writes to runs/default-2 (--output_dir chooses; "
                    "--overwrite replaces runs/default)"), said
    assert (tmp_path / "runs/default-2/run.json").is_file() and (tmp_path / "runs/default/run.json").read_text() == "{}"
    named = run_cli([*cmd, "--output_dir", "runs/default"], cwd=tmp_path, timeout=300)  # named: refused as before
    assert named.returncode == 2 and "already holds a run" in named.stderr
