"""Bad inputs to `python -m distcourse.train`: a clear error, nothing lost.

Every case is its own process running `python -m distcourse.train` (forked, with a deadline, from one
interpreter that imported the trainer once; the launches below are real command lines) that must exit 2 with one line
`distcourse.train: error: ...` on stderr naming the problem and the fix, and no traceback. Under
`accelerate launch`, torch elastic (the launcher) exits 1 and reports its children's exit codes with
its own `ChildFailedError` traceback: there every rank must print its line and exit 2, and the
launcher's report must be the only traceback. `python -m pytest -s tests/test_bad_inputs.py` prints
the table of every case: the case, processes, exit code and the whole error line.

Cases (input -> what the error line says):
- YAML not valid / a number / a list / an unknown key / 1.5 for an int / `no` unquoted / no file ->
  not valid YAML (line, column) / holds 3 (int), not a mapping / holds [1, 2] (list) / unknown keys
  ['modle'] (did you mean model?) / seq_len: 1.5 is not a valid int / quote it / no such file
- --bogus 1, --seq_len abc, --overwrite maybe -> unknown flag / invalid int / invalid bool;
  --help lists the flags
- --batch_size 0, --lr -1, --save_every -1 -> must be at least 1 / positive / 0 or more
- --seq_len 100000 -> exceeds the model's 256 positions; pass --seq_len 256
- --model DIR without a model / with a config.json but no weights -> from_pretrained failed / holds
  no loadable model; pass a preset or a directory saved with save_pretrained
- --dataset missing / .xyz / an empty file / no text column -> not an existing path / unsupported
  file type / could not be loaded, check the file / text column not found, --text_column
- --zero_stage 1 on one process -> shards across processes but this run has 1: launch several
- mesh: --tp 4 (2 heads), --tp 2 on 1 process, --pp 4 (2 layers), --cp 2 --seq_len 30,
  --pp 2 --cp 2, --pp 2 with grad_accum 1 (1f1b), --cp 2 --model base, --pp_schedule zb -> each
  names the numbers and its fix
- --mixed_precision fp16 on CPU, --tracker bogus, --output_dir under a file, --push_to_hub offline
- --push_to_hub online without HF_TOKEN -> refused before training: export HF_TOKEN=...
- --resume: no such dir, latest with no checkpoint, an incomplete one, another seq_len, another
  global batch, with --overwrite, trainer_state.json truncated / missing -> the checkpoint to use
- a fresh run into a directory that holds one -> already holds a run; --resume latest, --overwrite
- a full disk while saving (RLIMIT_FSIZE) -> saving checkpoint step_4 failed ...; --resume latest
  continues from step_2, which is intact (and it does)
- --overwrite true over a longer run with checkpoints -> exit 0: the old run's files are gone, other
  files stay, and --resume latest resumes the new run
- 2 processes: YAML not valid, --tp 2 --pp 2 (4 does not divide 2), a damaged checkpoint -> both
  ranks print the line and exit 2
"""

import json
import os
import resource
import shutil
import signal
import subprocess

import pytest

from conftest import ACCELERATE, PY, ROOT, free_port

ERR = "distcourse.train: error: "
BASE = ["--model", "tiny", "--seq_len", "32", "--batch_size", "4", "--max_examples", "200",
        "--max_steps", "6", "--warmup_steps", "1", "--eval_every", "0", "--log_every", "1",
        "--tracker", "none", "--mixed_precision", "no", "--compile", "false"]
ONLINE = {"HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0"}
TABLE = []  # (case, processes, exit code, error line): printed at the end of the module


def run(argv, env=None, timeout=300, preexec_fn=None, procs=1):
    "`python -m distcourse.train BASE argv`, under accelerate launch if procs > 1; a hang fails."
    env = {k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None}  # None: unset
    launch = [PY] if procs == 1 else [*ACCELERATE, "--multi_gpu", "--num_processes", str(procs),
                                      "--main_process_port", str(free_port())]
    return subprocess.run([*launch, "-m", "distcourse.train", *BASE, *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, preexec_fn=preexec_fn)


def launcher_report(proc, procs):
    "Torch elastic's report of a refused launch: the one traceback; every rank exited 2."
    assert proc.returncode != 0 and proc.stderr.count("Traceback") == 1, proc.stderr[-3000:]
    report = proc.stderr[proc.stderr.index("Traceback"):]
    assert "ChildFailedError" in report and "accelerate/commands/launch.py" in report, report
    codes = [l.split(":", 1)[1].split()[0] for l in report.splitlines()
             if l.strip().startswith("exitcode")]
    root = report[report.index("Root Cause"):]
    # -15: a rank the launcher stopped after the first exit; it had printed its line (counted above)
    assert "exitcode  : 2 " in root and set(codes) <= {"2", "-15"}, report


def refused(proc, case, what, procs=1) -> str:
    "The one error line of a refused run: exit 2, no traceback, every rank's line; `what` in it."
    lines = [l for l in proc.stderr.splitlines() if l.startswith(ERR)]
    if procs == 1:
        assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr[-3000:])
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    else:  # every rank printed the same line; the launcher's report is the only traceback
        assert len(lines) == procs and len(set(lines)) == 1, proc.stderr[-3000:]
        launcher_report(proc, procs)
    for part in what:
        assert part in lines[0], (part, lines[0])
    TABLE.append((case, procs, 2 if procs == 1 else "2 each", lines[0][len(ERR):]))
    return lines[0]


@pytest.fixture(scope="module", autouse=True)
def print_table():
    yield
    print(f"\n{len(TABLE)} bad inputs (case, processes, exit code, the error line):")
    for case, procs, code, line in TABLE: print(f"{case:<24} {procs} {code}  {line}")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    "One tiny run: 6 steps, checkpoints at steps 2, 4 and 6."
    out = tmp_path_factory.mktemp("trained") / "run"
    proc = run(["--save_every", "2", "--output_dir", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2", "step_4", "step_6"]
    return out


def copy_run(trained, dest):
    shutil.copytree(trained, dest)
    return dest


def files(d):
    "The bad files the cases point at, under `d`."
    texts = {"bad.yaml": "model: [tiny\n", "number.yaml": "3\n", "list.yaml": "- 1\n- 2\n",
             "key.yaml": "modle: tiny\n", "float.yaml": "seq_len: 1.5\n",
             "no.yaml": "mixed_precision: no\n", "data.xyz": "some text\n", "empty.txt": "",
             "nocol.jsonl": '{"body": "a b c"}\n' * 50, "a_file": "", "nomodel/notes.txt": "none\n"}
    for name, text in texts.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(text)
    (d / "noweights").mkdir()
    config = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 256}
    (d / "noweights/config.json").write_text(json.dumps(config))  # and no weights


# (case, the flags after BASE, what the line must say); {d}: the bad files, {run}: a trained run
CASES = [
    ("yaml_not_valid", "--config {d}/bad.yaml", ["not valid YAML", "line 2", "fix the file"]),
    ("yaml_number", "--config {d}/number.yaml", ["holds 3 (int), not a mapping", "flag: value"]),
    ("yaml_list", "--config {d}/list.yaml", ["holds [1, 2] (list), not a mapping", "flag: value"]),
    ("yaml_unknown_key", "--config {d}/key.yaml", ["unknown keys ['modle']", "mean model?"]),
    ("yaml_float_for_int", "--config {d}/float.yaml", ["seq_len: 1.5 is not a valid int",
                                                        "write e.g. `seq_len: 128`"]),
    ("yaml_unquoted_no", "--config {d}/no.yaml", ["mixed_precision", "as a boolean; quote it"]),
    ("config_missing", "--config {d}/none.yaml", ["no such file", "configs/tiny.yaml"]),
    ("unknown_flag", "--bogus 1", ["unknown flag: --bogus 1", "--help"]),
    ("bad_int", "--seq_len abc", ["--seq_len: invalid int value: 'abc'", "--help"]),
    ("bad_bool", "--overwrite maybe", ["--overwrite: invalid bool value: 'maybe'", "--help"]),
    ("zero_batch", "--batch_size 0", ["--batch_size 0: must be at least 1"]),
    ("negative_lr", "--lr -1", ["--lr -1.0: must be a positive number, e.g. 1e-3"]),
    ("negative_save_every", "--save_every -1", ["--save_every -1: must be 0 or more"]),
    ("seq_len_too_long", "--seq_len 100000", ["exceeds the model's 256 positions",
                                              "--seq_len 256"]),
    ("model_dir_no_model", "--model {d}/nomodel", ["from_pretrained failed", "save_pretrained"]),
    ("model_dir_no_weights", "--model {d}/noweights", ["holds no loadable model",
                                                        "save_pretrained"]),
    ("dataset_missing", "--dataset {d}/missing.txt", ["not an existing path", "pass one of"]),
    ("dataset_file_type", "--dataset {d}/data.xyz", ["unsupported file type '.xyz'",
                                                     "use one of .txt"]),
    ("dataset_empty", "--dataset {d}/empty.txt", ["could not be loaded", "check the file"]),
    ("dataset_no_text_column", "--dataset {d}/nocol.jsonl", ["column 'text' not found",
                                                             "--text_column"]),
    ("zero_stage_one_process", "--zero_stage 1", ["this run has 1: launch several",
                                                  "or use zero_stage=0"]),
    ("tp_not_dividing_heads", "--tp 4", ["n_head=2 is not divisible by tp=4", "pick tp in"]),
    ("tp_world_size", "--tp 2", ["does not divide the world size 1", "launch a multiple of 2"]),
    ("pp_deeper_than_layers", "--pp 4 --grad_accum 4", ["n_layer=2 is fewer than pp=4",
                                                        "use pp in"]),
    ("cp_seq_len", "--cp 2 --seq_len 30", ["seq_len=30 is not divisible by 2 x cp = 4"]),
    ("cp_ulysses_heads", "--cp 4 --cp_impl ulysses", ["n_head/tp = 2 heads do not split over cp=4",
                                                      "or --cp_impl ring"]),
    ("pp_1f1b_accum", "--pp 2", ["micro_batches=1 < pp=2", "micro-batches are --grad_accum"]),
    ("mesh_dropout", "--cp 2 --model base", ["--cp 2 with --model base (dropout 0.1): ring and Ulysses",
                                             "use a preset without dropout (tiny, small), or --cp 1"]),
    ("pp_schedule", "--pp_schedule zigzag", ["--pp_schedule 'zigzag'", "choose one of gpipe, 1f1b, interleaved"]),
    ("fp16_on_cpu", "--mixed_precision fp16", ["needs a CUDA GPU", "use bf16 or no"]),
    ("tracker", "--tracker bogus", ["--tracker 'bogus'", "choose one of"]),
    ("output_dir_under_file", "--output_dir {d}/a_file/run", ["not writable",
                                                              "another output_dir"]),
    ("push_offline", "--push_to_hub me/m", ["the Hub is offline", "push model/ later"]),
    ("resume_missing", "--resume {d}/no/checkpoints/step_2", ["no such checkpoint directory"]),
    ("resume_latest_none", "--resume latest", ["no complete checkpoint", "without --resume"]),
    ("already_holds_a_run", "--output_dir {run}", ["already holds a run", "--resume latest",
                                                    "--overwrite true"]),
    ("resume_incomplete", "--output_dir {run} --resume {run}/checkpoints/step_6",
     ["incomplete checkpoint", "resume from {run}/checkpoints/step_4"]),
    ("resume_other_seq_len", "--output_dir {run} --resume latest --seq_len 64",
     ["--seq_len saved 32, now 64", "Resume with --seq_len 32"]),
    ("resume_other_batch", "--output_dir {run} --resume latest --batch_size 8",
     ["saved global batch 4 = 4 x 1 x 1", "resume with --batch_size 4"]),
    ("resume_and_overwrite", "--output_dir {run} --resume latest --overwrite true",
     ["--overwrite deletes the run that --resume continues", "pass only one"]),
    ("state_truncated", "--output_dir {run} --resume latest",
     ["trainer_state.json is not valid JSON", "--resume {run}/checkpoints/step_4"]),
    ("state_missing", "--output_dir {run} --resume latest",
     ["trainer_state.json is missing", "--resume {run}/checkpoints/step_4"]),
]
STATE_6 = "checkpoints/step_6/trainer_state.json"
SPECIAL = {  # a case's environment, or the damage done to its copy of the trained run
    "push_offline": {"env": {"HF_TOKEN": "hf_x"}},
    "resume_incomplete": {"damage": lambda run: (run / "checkpoints/step_6/COMPLETE").unlink()},
    "state_truncated": {"damage": lambda run: (run / STATE_6).write_text('{"step": 6, "tok')},
    "state_missing": {"damage": lambda run: (run / STATE_6).unlink()},
}


# One interpreter imports the trainer once, then forks a process per case: each case is still its own process
# (running what `python -m distcourse.train` runs, its exit code and stderr its own), without paying
# torch's and transformers' imports 42 times. (tests/test_refusals.py and the cases below run the real command.)
FORKED_CLI = """
import io, json, os, signal, sys, traceback
from distcourse.train import main  # imported once, before the forks; what `python -m distcourse.train` calls
cases, out = json.load(open(sys.argv[1])), {}
for case, (argv, env) in cases.items():
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the case's process: stdout and stderr into the pipe, as a subprocess's would be
        os.close(r); os.dup2(w, 1); os.dup2(w, 2)
        sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", 0), line_buffering=True)
        sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", 0), line_buffering=True)
        os.environ.update(env); sys.argv = ["distcourse.train", *argv]
        try: main(); code = 0
        except SystemExit as e: code = e.code if isinstance(e.code, int) else (e.code is not None)
        except BaseException: traceback.print_exc(); code = 1  # as Python itself reports an uncaught error
        sys.stdout.flush(); sys.stderr.flush(); os._exit(code)
    os.close(w)
    signal.alarm(120)  # a case that hangs fails the whole run (the caller's timeout says so)
    with os.fdopen(r, "rb") as f: text = f.read().decode()
    _, status = os.waitpid(pid, 0); signal.alarm(0)
    out[case] = {"returncode": os.waitstatus_to_exitcode(status), "stderr": text}
json.dump(out, open(sys.argv[2], "w"))
"""


@pytest.fixture(scope="module")
def results(request, trained, tmp_path_factory):
    "The selected cases of CASES, each a forked `python -m distcourse.train`: {case: (proc, dir)}."
    chosen = {item.callspec.params["case"] for item in request.session.items
              if getattr(item, "originalname", "") == "test_refused"}
    d = tmp_path_factory.mktemp("bad")
    files(d)
    jobs = {}
    for case, argv, _ in CASES:
        if case not in chosen: continue
        out, run_dir = d / "out" / case, d / "runs" / case
        if "{run}" in argv: copy_run(trained, run_dir)
        if "damage" in SPECIAL.get(case, {}): SPECIAL[case]["damage"](run_dir)
        args = argv.format(d=d, run=run_dir).split()
        args = args if "--output_dir" in args else [*args, "--output_dir", str(out)]
        jobs[case] = ([*BASE, *args], SPECIAL.get(case, {}).get("env", {}))
    (d / "cases.json").write_text(json.dumps(jobs))
    proc = subprocess.run([PY, "-c", FORKED_CLI, str(d / "cases.json"), str(d / "got.json")], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads((d / "got.json").read_text())
    return {c: (subprocess.CompletedProcess([], r["returncode"], "", r["stderr"]), d) for c, r in got.items()}


@pytest.mark.parametrize("case,argv,what", CASES, ids=[c[0] for c in CASES])
def test_refused(case, argv, what, results):
    "Exit 2, one line naming the problem and the fix, no traceback; nothing trained or written."
    proc, d = results[case]
    run_dir = d / "runs" / case
    refused(proc, case, [w.format(d=d, run=run_dir) for w in what])
    assert not (d / "out" / case / "metrics.jsonl").exists()  # refused before any work
    if run_dir.exists():  # the run it pointed at is as it was: nothing trained, logged or pruned
        assert max(json.loads(l)["step"] for l in open(run_dir / "metrics.jsonl")) == 6
        assert (run_dir / "checkpoints/step_2/COMPLETE").is_file()


def test_push_to_hub_without_token(tmp_path):
    "Online without HF_TOKEN: refused before training (not after it, at the push), exit 2."
    out = tmp_path / "run"
    proc = run(["--push_to_hub", "me/m", "--output_dir", str(out)],
               env={**ONLINE, "HF_TOKEN": None})
    refused(proc, "push_no_token", ["--push_to_hub me/m: no HF_TOKEN", "export HF_TOKEN="])
    assert not out.exists()


def no_bigger_files_than(limit):  # bytes
    "A preexec_fn: the child's files may not grow past `limit`; a write past it fails (EFBIG)."
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an error from write(), not a killed process
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_full_disk_during_save(trained, tmp_path):
    "A save the disk refuses: exit 2, one line; the checkpoint before is intact and resumes."
    run_dir = copy_run(trained, tmp_path / "run")
    for step in ("step_4", "step_6"): shutil.rmtree(run_dir / "checkpoints" / step)
    argv = ["--save_every", "2", "--output_dir", str(run_dir), "--resume", "latest"]
    proc = run(argv, preexec_fn=no_bigger_files_than(2**20))  # the weights alone are 2.5 MB
    ckpts = run_dir / "checkpoints"
    line = refused(proc, "full_disk_during_save", [
        "saving checkpoint step_4 failed", "File too large", "MiB free", "free some space",
        f"--resume latest continues from {ckpts}/step_2, which is intact"])
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_2"]  # the torn save is gone
    again = run(argv)
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads((run_dir / "run.json").read_text())
    assert summary["resumed_from"] == {"path": str(ckpts / "step_2"), "step": 2}
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_2", "step_4", "step_6"]


def test_overwrite_starts_a_clean_run(trained, tmp_path):
    "--overwrite over a longer run: its files go, others' stay; --resume finds the new run."
    run_dir = copy_run(trained, tmp_path / "run")
    (run_dir / "notes.txt").write_text("mine")
    shorter = ["--max_steps", "4", "--save_every", "2", "--output_dir", str(run_dir)]
    proc = run([*shorter, "--overwrite", "true"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_2", "step_4"]  # no old step_6
    for step in (2, 4):  # the new run's checkpoints, not the replaced run's
        state = json.loads((ckpts / f"step_{step}/trainer_state.json").read_text())
        assert state["config"]["max_steps"] == 4 and state["config"]["overwrite"]
    steps = [json.loads(l)["step"] for l in open(run_dir / "metrics.jsonl")]
    assert max(steps) == 4 and steps.count(1) == 1  # the old run's records are gone
    assert json.loads((run_dir / "run.json").read_text())["config"]["max_steps"] == 4
    assert (run_dir / "notes.txt").read_text() == "mine"  # not the run's: kept
    shutil.rmtree(ckpts / "step_4")
    again = run([*shorter, "--resume", "latest"])
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads((run_dir / "run.json").read_text())
    assert summary["resumed_from"] == {"path": str(ckpts / "step_2"), "step": 2}
    TABLE.append(("overwrite_with_ckpts", 1, 0, "(none: the old run's files replaced; "
                                                "--resume latest resumes the new run)"))


def test_two_processes_yaml_not_valid(tmp_path):
    (tmp_path / "bad.yaml").write_text("model: [tiny\n")
    out = tmp_path / "out"
    proc = run(["--config", str(tmp_path / "bad.yaml"), "--output_dir", str(out)], procs=2)
    refused(proc, "2proc_yaml_not_valid", ["not valid YAML", "fix the file"], procs=2)
    assert not out.exists()


def test_two_processes_mesh_world_size(tmp_path):
    argv = ["--tp", "2", "--pp", "2", "--grad_accum", "2", "--output_dir", str(tmp_path / "out")]
    proc = run(argv, procs=2)
    refused(proc, "2proc_tp2_pp2", ["tp x pp x cp = 4 does not divide the world size 2",
                                    "launch a multiple of 4 processes"], procs=2)


def test_two_processes_damaged_checkpoint(trained, tmp_path):
    run_dir = copy_run(trained, tmp_path / "run")
    (run_dir / STATE_6).write_text('{"step": 6, "tok')
    proc = run(["--batch_size", "2", "--output_dir", str(run_dir), "--resume", "latest"], procs=2)
    refused(proc, "2proc_state_truncated", ["trainer_state.json is not valid JSON",
                                            f"--resume {run_dir}/checkpoints/step_4"], procs=2)
