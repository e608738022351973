"The CLI contract of `distcourse.train`: outputs, 1 vs 2 processes, bad inputs."
import json
import shutil

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import ACCELERATE, PY, ROOT, free_port, grads_diff, run_cli, worst_rel

TINY = ["--config", str(ROOT / "configs/tiny.yaml"), "--max_steps", "12", "--log_every", "1",
        "--eval_every", "6", "--save_every", "6"]


def records(out):
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    "The same tiny run, 1 process × batch 8 and 2 processes × batch 4 (step 1's gradients kept)."
    tmp = tmp_path_factory.mktemp("runs")
    one = run_cli([PY, "-m", "distcourse.train", *TINY, "--batch_size", "8", "--grads_at", "1",
                   "--output_dir", str(tmp / "one")])
    assert one.returncode == 0, one.stderr[-3000:]
    two = run_cli([*ACCELERATE, "--multi_gpu", "--num_processes", "2", "--main_process_port", str(free_port()),
                   "-m", "distcourse.train", *TINY, "--batch_size", "4", "--grads_at", "1",
                   "--output_dir", str(tmp / "two")])
    assert two.returncode == 0, two.stderr[-3000:]
    return {"one": (tmp / "one", one), "two": (tmp / "two", two)}


def test_outputs(runs):
    out, proc = runs["one"]
    run = json.loads((out / "run.json").read_text())
    for key in ("world_size", "distributed_type", "mixed_precision", "device", "num_parameters", "val_size",
                "config", "wall_time_s", "final"):
        assert key in run, key
    assert run["world_size"] == 1 and run["config"]["model"] == "tiny"
    assert run["parallel"] == {"dp": 1, "tp": 1, "pp": 1, "cp": 1, "cp_impl": None}
    assert run["memory"]["activation_bytes"] > 0 and run["memory"]["grads_bytes"] > 0
    assert [r["optimizer_bytes"] for r in run["memory"]["per_rank"]] == [run["memory"]["optimizer_bytes"]]
    peak, mem = run["memory"]["peak_first_step"]["cpu"], run["memory"]  # measured (PeakMemory) beside counted
    assert peak["PARAM"] == mem["params_bytes"] and peak["GRAD"] == mem["grads_bytes"], (peak, mem)
    logits = 8 * 64 * 8192 * 4  # (B, T, V) fp32: alive beside the log-softmax, then two gradients of that size
    assert peak["TEMP"] == 2 * logits and 0 < peak["ACT"] - mem["activation_bytes"] - logits < 32 * 8 * 64, peak
    assert mem["optimizer_bytes"] < peak["OPT"] < mem["optimizer_bytes"] + 2 * 4 * 8192 * 64  # + AdamW's temporaries
    u = run["utilisation"]
    assert 0 < u["mm_utilisation_median"] <= 1 and u["metric"] == "mm_utilisation"  # a measured matmul rate, not MFU
    assert u["tokens_processed"] == 12 * 8 * 64  # every input token of 12 steps of 8 blocks (the loss has 8 × 63)
    assert u["peak_per_rank"]["used"] == "measured" and "torch.mm" in u["peak_per_rank"]["what"]
    recs = records(out)
    train = [r for r in recs if "split" not in r]
    assert [r["step"] for r in train] == list(range(1, 13))
    assert all(set(r) >= {"step", "loss", "lr", "tokens", "tokens_per_s", "mm_utilisation", "rss_mb", "rss_mb_max",
                          "rss_mb_min"} and "mfu" not in r for r in train)
    assert all(0 < r["mm_utilisation"] <= 1 and r["rss_mb_min"] <= r["rss_mb"] <= r["rss_mb_max"] for r in train)
    evals = [r for r in recs if r.get("split") == "val"]
    assert [r["step"] for r in evals] == [0, 6, 12]
    assert all(r["samples"] == run["val_size"] and "perplexity" in r for r in evals)
    assert evals[-1]["loss"] < evals[0]["loss"]
    assert (out / "checkpoints/step_6").is_dir() and (out / "checkpoints/step_12").is_dir()
    assert (out / "metrics.png").stat().st_size > 0
    assert list((out / "distcourse").glob("events.out.tfevents.*"))  # --tracker auto: TensorBoard is installed
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    tok = AutoTokenizer.from_pretrained(out / "model")
    assert model.num_parameters() == run["num_parameters"] and len(tok) <= model.config.vocab_size


def test_two_processes_are_real_and_equal(runs):
    (o1, _), (o2, p2) = runs["one"], runs["two"]
    run2 = json.loads((o2 / "run.json").read_text())
    assert run2["world_size"] == 2 and run2["distributed_type"] == "MULTI_CPU"
    assert run2["utilisation"]["tokens_processed"] == 12 * 8 * 64  # both ranks' tokens, summed
    train2 = [r for r in records(o2) if "split" not in r]  # every rank's memory, not rank 0's alone
    assert all(r["rss_mb_min"] <= r["rss_mb_max"] for r in train2) and run2["parallel"] == {"dp": 2, "tp": 1, "pp": 1, "cp": 1, "cp_impl": None}
    assert run2["memory"]["rss_mb_max_all_ranks"] >= run2["memory"]["rss_mb_min_all_ranks"] > 0
    for r in run2["memory"]["per_rank"]:  # each rank's own first step, measured: whole weights and gradients (DDP)
        assert r["peak_first_step"]["cpu"]["PARAM"] == r["params_bytes"] == r["grads_bytes"], r
    assert p2.stdout.count("outputs in") == 1  # only the main process prints the summary
    evals = [r for r in records(o2) if r.get("split") == "val"]
    assert all(r["samples"] == run2["val_size"] for r in evals)
    # 1 process × 8 and 2 processes × 4 see the same examples per step: same losses.
    l1 = [r["loss"] for r in records(o1) if "split" not in r]
    l2 = [r["loss"] for r in records(o2) if "split" not in r]
    assert len(l1) == len(l2) == 12
    worst = max(abs(a - b) / abs(a) for a, b in zip(l1, l2))
    assert worst <= 1e-5, worst
    # AdamW and clipping hide a constant factor on gradients (x 4: losses moved 8.5e-8): compare
    norms = worst_rel(*([r["grad_norm"] for r in records(o) if "split" not in r] for o in (o1, o2)))
    grads = grads_diff(o1 / "grads_step1.pt", o2 / "grads_step1.pt")  # every parameter, whole
    print(f"1 x 8 vs 2 x 4: losses {worst:.1e}, pre-clip gradient norms {norms:.1e}, "
          f"step 1's gradients {grads:.1e}")
    assert norms <= 1e-5 and grads <= 1e-5, (norms, grads)  # measured: 1.5e-7 and 4.7e-8


def test_activation_checkpointing_same_losses_less_memory(runs, tmp_path):
    "--activation_checkpointing true: the same losses as the plain run, fewer bytes saved for backward."
    out = tmp_path / "ckpt"
    proc = run_cli([PY, "-m", "distcourse.train", *TINY, "--batch_size", "8", "--activation_checkpointing", "true",
                    "--save_every", "0", "--output_dir", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    plain, ckpt = (json.loads((d / "run.json").read_text()) for d in (runs["one"][0], out))
    assert ckpt["config"]["activation_checkpointing"] is True
    assert ckpt["memory"]["activation_bytes"] < plain["memory"]["activation_bytes"]
    l1, l2 = ([r["loss"] for r in records(d) if "split" not in r] for d in (runs["one"][0], out))
    assert len(l1) == len(l2) == 12 and max(abs(a - b) / abs(a) for a, b in zip(l1, l2)) <= 1e-6


def resume_copy(out, copy, *argv):
    "Resume a copy of the 1-process run `out` in `copy` with the extra flags `argv` (1 process, batch 8)."
    shutil.copytree(out, copy)
    return run_cli([PY, "-m", "distcourse.train", *TINY, "--batch_size", "8", "--output_dir", str(copy), *argv])


def test_resume_latest(runs, tmp_path):
    "Resuming from an earlier checkpoint of the run repeats its later steps exactly; metrics.jsonl holds each once."
    out, _ = runs["one"]
    again = tmp_path / "again"
    proc = resume_copy(out, again, "--resume", str(again / "checkpoints/step_6"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    train = [r for r in records(again) if "split" not in r]
    assert [r["step"] for r in train] == list(range(1, 13))  # the first run's steps 7-12 replaced, not appended
    assert [r["loss"] for r in train] == [r["loss"] for r in records(out) if "split" not in r]  # exact


def test_resume_on_another_number_of_processes(runs, tmp_path):
    "The 2-process run (4 x 1 x 2) resumed at step 6 on 1 process with --batch_size 8: its losses within 1e-5."
    out, _ = runs["two"]
    again = tmp_path / "again"
    proc = resume_copy(out, again, "--resume", str(again / "checkpoints/step_6"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads((again / "run.json").read_text())
    assert run["world_size"] == 1 and run["resumed_from"]["step"] == 6
    l2, l1 = ([r["loss"] for r in records(d) if "split" not in r] for d in (out, again))
    assert len(l1) == len(l2) == 12 and l1[:6] == l2[:6]  # steps 1-6 are the 2-process run's own records
    worst = max(abs(a - b) / abs(a) for a, b in zip(l2[6:], l1[6:]))
    assert worst <= 1e-5, worst
    n2, n1 = ([r["grad_norm"] for r in records(d) if "split" not in r] for d in (out, again))
    norms = worst_rel(n2[6:], n1[6:])
    print(f"2 -> 1 process at step 6: losses {worst:.1e}, pre-clip gradient norms {norms:.1e}")
    assert norms <= 1e-5, norms  # the pre-clip gradient norms of steps 7-12 too


def test_resume_refuses_another_schedule(runs, tmp_path):
    "--max_steps (or --lr, --warmup_steps) other than the checkpoint's: refused, naming the flag and the fix."
    out, _ = runs["one"]
    run = tmp_path / "run"
    msg = error_line(resume_copy(out, run, "--resume", "latest", "--max_steps", "14", "--lr", "1e-3"))
    assert "--max_steps saved 12, now 14" in msg and "--lr saved 0.003, now 0.001" in msg, msg
    assert "Resume with --lr 0.003 --max_steps 12" in msg and "train longer in a new run" in msg, msg
    assert max(r["step"] for r in records(run)) == 12  # nothing was trained or logged


BAD = [
    (["--bogus", "1"], "unknown flag: --bogus"),
    (["--config", "no/such.yaml"], "--config"),
    (["--task", "seq2seq"], "--task"),
    (["--model", "tinny"], "--model"),
    (["--model", "someone/some-model"], "--model"),
    (["--seq_len", "100000"], "--seq_len"),
    (["--batch_size", "0"], "--batch_size"),
    (["--lr", "-1"], "--lr"),
    (["--grad_accum", "0"], "--grad_accum"),
    (["--mixed_precision", "fp8"], "--mixed_precision"),
    (["--resume", "no/such/checkpoint"], "--resume"),
    (["--zero_stage", "4"], "--zero_stage"),
    (["--tracker", "bogus"], "--tracker"),
    (["--push_to_hub", "someone/model"], "--push_to_hub someone/model: the Hub is offline"),
]


@pytest.mark.fast
@pytest.mark.parametrize("argv,flag", BAD, ids=[b[1] for b in BAD])
def test_bad_inputs(argv, flag, tmp_path, capsys):
    "Each bad input: exit code 2, one line naming the flag, no traceback, nothing written."
    from distcourse.train import main
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        main(["--model", "tiny", "--output_dir", str(out), *argv])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"distcourse.train: error: {flag}"), err
    assert not out.exists()


def test_bad_input_every_rank_same_message(tmp_path):
    "Under a 2-process launch both ranks fail before any work, with the same one-line message."
    out = tmp_path / "out"
    proc = run_cli([*ACCELERATE, "--multi_gpu", "--num_processes", "2", "--main_process_port", str(free_port()),
                    "-m", "distcourse.train", "--model", "tiny", "--batch_size", "0", "--output_dir", str(out)])
    assert proc.returncode != 0
    lines = [l for l in proc.stderr.splitlines() if l.startswith("distcourse.train: error:")]
    assert len(lines) == 2 and len(set(lines)) == 1 and "--batch_size" in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr.split("distcourse.train: error:")[0] and not out.exists()


def two_procs(*argv):
    return run_cli([*ACCELERATE, "--multi_gpu", "--num_processes", "2", "--main_process_port", str(free_port()),
                    "-m", "distcourse.train", *TINY, "--batch_size", "4", *argv])


def error_line(proc):
    "The one error line every rank printed (the same on each), checking that nothing else went wrong."
    lines = {l for l in proc.stderr.splitlines() if l.startswith("distcourse.train: error:")}
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr.split("distcourse.train: error:")[0], proc.stderr[-3000:]
    return lines.pop()


def test_two_process_resume_is_exact(runs, tmp_path):
    "A 2-process run that lost its last checkpoint resumes from the one before and repeats the losses exactly."
    out, _ = runs["two"]
    again = tmp_path / "again"
    shutil.copytree(out, again)
    shutil.rmtree(again / "checkpoints/step_12")
    proc = two_procs("--output_dir", str(again), "--resume", "latest")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads((again / "run.json").read_text())
    assert run["resumed_from"] == {"path": str(again / "checkpoints/step_6"), "step": 6}
    steps = [r["step"] for r in records(again) if "split" not in r]
    assert steps == list(range(1, 13))  # the lost steps' records were dropped at the resume, then written again
    first = [r["loss"] for r in records(out) if "split" not in r]
    assert [r["loss"] for r in records(again) if "split" not in r] == first  # exact float equality
    assert run["before"] == json.loads((out / "run.json").read_text())["before"]  # read back, not re-measured


def test_resume_refuses_what_does_not_fit(runs, tmp_path):
    "Incomplete checkpoint, other settings, other number of processes: one clear line, exit 2, nothing trained."
    out, _ = runs["two"]
    run = tmp_path / "run"
    shutil.copytree(out, run)
    torn = run / "checkpoints/step_6"
    (torn / "COMPLETE").unlink()
    msg = error_line(two_procs("--output_dir", str(run), "--resume", str(torn)))
    assert "incomplete checkpoint" in msg and "step_12" in msg, msg  # names the newest complete one
    msg = error_line(two_procs("--output_dir", str(run), "--resume", "latest", "--seq_len", "32"))
    assert "seq_len saved 64, now 32" in msg, msg
    proc = run_cli([PY, "-m", "distcourse.train", *TINY, "--batch_size", "4", "--output_dir", str(run),
                    "--resume", "latest"])
    msg = error_line(proc)
    assert msg.startswith("distcourse.train: error: --resume"), msg
    assert "saved global batch 8 = 4 x 1 x 2" in msg and "now 4 x 1 x 1 = 4" in msg, msg  # the numbers, then
    assert "resume with --batch_size 8 or --grad_accum 2 or 2 processes" in msg, msg  # the flags that match
    assert max(r["step"] for r in records(run)) == 12  # nothing was trained or logged


def test_output_dir_that_cannot_be_written(tmp_path):
    (tmp_path / "a_file").write_text("")
    out = tmp_path / "a_file" / "run"
    proc = run_cli([PY, "-m", "distcourse.train", *TINY, "--output_dir", str(out)])
    msg = error_line(proc)
    assert msg.startswith("distcourse.train: error: --output_dir") and "not writable" in msg, msg


def test_keep_checkpoints(tmp_path):
    out = tmp_path / "keep"
    proc = run_cli([PY, "-m", "distcourse.train", *TINY, "--max_steps", "8", "--save_every", "2",
                    "--keep_checkpoints", "2", "--eval_every", "0", "--output_dir", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_6", "step_8"]
    state = json.loads((out / "checkpoints/step_8/trainer_state.json").read_text())
    assert state["step"] == 8 and state["config"]["model"] == "tiny" and state["fingerprint"]["global_batch"] == 4  # 4 x 1 x 1


def test_push_failure_loses_nothing(tmp_path):
    "Online but the Hub unreachable: the run trains and saves, the push fails with one line, exit 1, files intact."
    out = tmp_path / "run"
    env = {"HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0", "HF_TOKEN": "hf_not_a_token",
           "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}  # nothing listens there: connection refused
    proc = run_cli([PY, "-m", "distcourse.train", *TINY, "--max_steps", "3", "--eval_every", "0", "--save_every", "0",
                    "--tracker", "none", "--push_to_hub", "someone/model", "--output_dir", str(out)], env=env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [l for l in proc.stderr.splitlines() if l.startswith("distcourse.train: error: --push_to_hub")]
    assert len(errors) == 1 and "the model stays in" in errors[0], proc.stderr[-3000:]
    run = json.loads((out / "run.json").read_text())
    assert "push_error" in run and "pushed_to" not in run
    assert AutoModelForCausalLM.from_pretrained(out / "model").num_parameters() == run["num_parameters"]
    assert not (out / "distcourse").exists()  # --tracker none: metrics.jsonl only


@pytest.mark.fast
@pytest.mark.parametrize("name", ["zero2.yaml", "zero3_offload.yaml"])
def test_deepspeed_configs_refuse_accumulation(name):
    "Accelerate's DeepSpeed plugin steps at every backward: --grad_accum > 1 is refused with these configs."
    import yaml
    from types import SimpleNamespace
    from accelerate.utils import DistributedType
    from distcourse.config import ConfigError
    from distcourse.train import check_deepspeed
    ds_config = yaml.safe_load((ROOT / "configs/accelerate" / name).read_text())["deepspeed_config"]
    acc = SimpleNamespace(distributed_type=DistributedType.DEEPSPEED,
                          state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(deepspeed_config=ds_config)))
    with pytest.raises(ConfigError, match="--grad_accum 2 under DeepSpeed"): check_deepspeed(acc, 2)
    check_deepspeed(acc, 1)  # no accumulation: allowed
