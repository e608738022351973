"`python -m distcourse.generate` on a real trainer run: seeds, greedy, checkpoints, bad inputs; the Hub push refusing."
import hashlib
import io
import json
import shutil
import subprocess
from contextlib import redirect_stderr, redirect_stdout

import pytest

from conftest import PY, ROOT, free_port, run_cli

PROMPT = ["--prompt", "Return the", "--max_new_tokens", "24"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    "A 6-step tiny run of the trainer with checkpoints at steps 3 and 6 (the last one holds the final weights)."
    out = tmp_path_factory.mktemp("gen") / "run"
    proc = run_cli([PY, "-m", "distcourse.train", "--config", str(ROOT / "configs/tiny.yaml"), "--max_steps", "6",
                    "--save_every", "3", "--eval_every", "0", "--output_dir", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def generate_cli(*args):
    "`python -m distcourse.generate` in a process of its own: its exit code and its whole stdout and stderr."
    return run_cli([PY, "-m", "distcourse.generate", *map(str, args)])


def generate(*args):
    """The same command line through `main` in this process (no interpreter start, no imports: ~8 s less a call):
    its exit code and what it printed. The checks that need a process of its own use `generate_cli`."""
    from distcourse.generate import main
    out, err, code = io.StringIO(), io.StringIO(), 0
    with redirect_stdout(out), redirect_stderr(err):
        try: main(list(map(str, args)))
        except SystemExit as e: code = e.code if isinstance(e.code, int) else int(e.code is not None)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def text(proc) -> str:
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("Return the")
    return proc.stdout


def test_seed_decides_the_sample(run):
    sample = ["--run", run, *PROMPT, "--temperature", "1.0", "--top_k", "200", "--top_p", "0.95"]
    a = text(generate_cli(*sample, "--seed", 1))
    b, c = (text(generate(*sample, "--seed", s)) for s in (1, 2))
    assert a == b        # same seed, same text, in two different processes
    assert a != c


def test_greedy_ignores_seed_and_knobs(run):
    a = text(generate("--run", run, *PROMPT, "--greedy", "--seed", "1"))
    b = text(generate("--run", run / "model", *PROMPT, "--greedy", "--seed", "2", "--temperature", "5"))
    assert a == b


def test_checkpoint_of_last_step_is_the_final_model(run):
    "checkpoints/step_6 of a 6-step run holds the weights of model/: the same greedy text."
    ckpt = run / "checkpoints/step_6"
    assert (ckpt / "COMPLETE").is_file(), "the trainer wrote no COMPLETE marker (see distcourse.checkpoint)"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert "config" in state, "trainer_state.json has no \"config\" (load_model falls back to run.json)"
    sample = [*PROMPT, "--temperature", "1.0", "--seed", "5"]  # every token drawn from the model's distribution
    final = text(generate("--run", run, *sample))
    assert text(generate("--checkpoint", ckpt, *sample)) == final
    assert text(generate("--run", run, "--checkpoint", "latest", *sample)) == final


def test_checkpoints_load_their_own_weights(run):
    import torch
    from distcourse.generate import load_model, prompt_ids
    logits = {}
    for where in ("model", "checkpoints/step_6", "checkpoints/step_3"):
        model, tok = load_model(run / where)
        with torch.no_grad(): logits[where] = model(prompt_ids(tok, "Return the value of")).logits
    torch.testing.assert_close(logits["checkpoints/step_6"], logits["model"])
    assert (logits["checkpoints/step_3"] - logits["model"]).abs().max() > 1e-3  # three more steps changed the weights


def check_refused(proc, says):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout == ""
    assert proc.stderr.startswith("distcourse.generate: error:") and says in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_bad_inputs(run, tmp_path):
    check_refused(generate_cli("--run", tmp_path / "nowhere", *PROMPT), "no such directory")  # the real exit code
    check_refused(generate("--run", run, "--prompt", "x", "--max_new_tokens", "300"),
                  "exceed the model's 256 positions; pass --max_new_tokens 254 or less")
    check_refused(generate("--run", run, *PROMPT, "--temperature", "0"), "--temperature 0.0: must be positive")
    check_refused(generate("--run", run, *PROMPT, "--top_k", "many"), "argument --top_k: invalid int value")


@pytest.mark.parametrize("damage", ["truncated", "overwritten"])
def test_damaged_weights_refused(run, tmp_path, damage):
    "A copy whose model/ or checkpoint weights cannot be read: exit 2, one line naming the file and what to load."
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    for weights, instead in [(copy / "model/model.safetensors", f"pass --checkpoint {copy / 'checkpoints/step_6'}"),
                             (copy / "checkpoints/step_6/model.safetensors", f"pass --run {copy}")]:
        good = weights.read_bytes()
        weights.write_bytes(good[:len(good) // 2] if damage == "truncated" else b"\x00garbage" * 100)
        before = {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()}
        where = ["--run", copy] if weights.parent.name == "model" else ["--checkpoint", weights.parent]
        proc = (generate_cli if damage == "truncated" else generate)(*where, *PROMPT)  # one with its own stderr
        check_refused(proc, f"{weights} is damaged: its weights cannot be read")
        assert instead in proc.stderr, proc.stderr  # what to load instead: the run's other copy of the weights
        assert {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()} == before  # nothing written or lost
        weights.write_bytes(good)


def test_incomplete_checkpoint_names_newest_complete(run, tmp_path):
    torn = run / "checkpoints/step_9"
    shutil.copytree(run / "checkpoints/step_3", torn)
    (torn / "COMPLETE").unlink(missing_ok=True)  # a save that died before its marker
    try:
        check_refused(generate("--checkpoint", torn, *PROMPT),
                      f"is incomplete (no COMPLETE marker: its save was interrupted); use {run / 'checkpoints/step_6'}")
    finally:
        shutil.rmtree(torn)


def test_classifier_is_refused(tmp_path):
    from distcourse.data import get_tokenizer
    from distcourse.model import build_model
    tok = get_tokenizer("stdlib")
    build_model("tiny", "cls", tokenizer=tok, num_labels=2).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    check_refused(generate("--run", tmp_path, *PROMPT), "generation needs a causal LM")


def test_load_model_refusals(run, tmp_path):
    "load_model: a checkpoint without its config (run.json supplies it, else refused), weights for another model."
    from distcourse.checkpoint import STATE_FILE
    from distcourse.generate import load_model
    ckpts = run / "checkpoints"
    no_config = ckpts / "step_1001"
    shutil.copytree(ckpts / "step_6", no_config)
    wrong = ckpts / "step_1003"
    shutil.copytree(ckpts / "step_6", wrong)
    try:
        (no_config / STATE_FILE).write_text(json.dumps({"step": 1001}))
        load_model(no_config)  # the config comes from the run's run.json
        (run / "run.json").rename(run / "run.json.bak")
        try:
            with pytest.raises(ValueError, match='holds the run\'s "config"'): load_model(no_config)
        finally: (run / "run.json.bak").rename(run / "run.json")
        config = json.loads((run / "run.json").read_text())["config"]
        (wrong / STATE_FILE).write_text(json.dumps({"config": {**config, "model": "small"}}))
        with pytest.raises(ValueError, match="its weights do not fit the 'small' model"): load_model(wrong)
        with pytest.raises(ValueError, match="holds no model/"): load_model(tmp_path)
    finally:
        for p in (no_config, wrong): shutil.rmtree(p)


def digest(d) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_push_refused_offline_or_without_token(run, monkeypatch):
    from distcourse.outputs import push_to_hub
    before = digest(run / "model")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    with pytest.raises(ValueError, match="the Hub is offline"):
        push_to_hub(run / "model", "someone/tiny")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(ValueError, match="set HF_TOKEN"):
        push_to_hub(run / "model", "someone/tiny")
    assert digest(run / "model") == before


def test_push_that_fails_keeps_files(run):
    "Online, with a token, against an endpoint that refuses connections: a clear error, the files untouched."
    before = digest(run / "model")
    proc = run_cli([PY, "-c", "import sys; from distcourse.outputs import push_to_hub; push_to_hub(sys.argv[1], 'someone/tiny')",
                    str(run / "model")], timeout=120,
                   env={"HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0",
                        "HF_TOKEN": "hf_not_a_real_token", "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"})
    assert proc.returncode == 1
    assert "RuntimeError: pushing" in proc.stderr and "failed" in proc.stderr
    assert f"the model stays in {run / 'model'}" in proc.stderr
    assert digest(run / "model") == before
