"""The command lines people expect (lessons 09, 01 and 09c): --help in sections with each fixed set of choices, a
boolean flag alone means true, a typo of a flag, a preset or a choice names the nearest one, an unknown bare model name
is refused before any Hub call, --print_config prints YAML that --config reads back, and the planner's table speaks
a unit a column (microseconds to seconds, MiB to GiB per rank), its ties ordered by what it prints, and its --explain
says why the first row beats the second, term by term."""
import json
import re
import time
from dataclasses import asdict, fields

import pytest
import transformers
import yaml

import distcourse.config as config
import distcourse.plan as plan
import distcourse.planner as planner
from conftest import PY, run_cli
from distcourse.config import Config, ConfigError, parse_args
from distcourse.machine import PROFILES
from distcourse.model import build_model

pytestmark = pytest.mark.fast  # every test here is quick: in the fast tier

TINY = ["--model", "tiny", "--seq_len", "32"]


def printed(argv, capsys) -> str:
    "What parse_args prints before it exits 0 (--help, --print_config)."
    with pytest.raises(SystemExit) as e: parse_args(argv)
    assert e.value.code in (0, None), e.value.code
    return capsys.readouterr().out


def test_help_in_sections_with_choices(capsys):
    text = printed(["--help"], capsys)
    sections = re.findall(r"^(\w+):$", text, re.M)
    assert sections == ["options", "data", "model", "optimisation", "parallelism", "checkpoints", "tracking", "run"]
    for flag in ("--task {clm,mlm,cls}", "--zero_stage {0,1,2,3}", "--pp_schedule {gpipe,1f1b,interleaved,",
                 "--tracker {auto,tensorboard,wandb,none}", "--overwrite [BOOL]", "--config FILE", "--print_config"):
        assert flag in text, flag
    names = [k for group in config._GROUPS.values() for k in group.split()]
    assert sorted(names) == sorted(f.name for f in fields(Config))  # every field in one section, once
    for name in names:  # each flag: its own help line, its default
        assert re.search(rf"--{name} .*\S", text) or re.search(rf"--{name}.*\n\s+\S", text), name


def test_bare_boolean_flag_is_true():
    assert parse_args(TINY).overwrite is False
    assert parse_args([*TINY, "--overwrite"]).overwrite is True
    assert parse_args([*TINY, "--overwrite", "--activation_checkpointing"]).activation_checkpointing is True
    for value, want in (("true", True), ("false", False), ("1", True), ("off", False)):  # existing scripts
        assert parse_args([*TINY, "--overwrite", value]).overwrite is want
    with pytest.raises(ConfigError, match="argument --overwrite: invalid bool value: 'maybe'"):
        parse_args([*TINY, "--overwrite", "maybe"])


@pytest.mark.parametrize("argv,says", [
    (["--batch-size", "4"], "unknown flag: --batch-size 4 (did you mean --batch_size?)"),
    (["--max_step", "3"], "(did you mean --max_steps?)"),
    (["--batchsize=4"], "unknown flag: --batchsize=4 (did you mean --batch_size?)"),
    (["--bogus", "1"], "unknown flag: --bogus 1; python -m distcourse.train --help"),  # nothing near: no guess
    (["--pp_schedule", "1f1"], "--pp_schedule '1f1' (did you mean 1f1b?): choose one of gpipe, 1f1b,"),
    (["--tracker", "tensorbord"], "--tracker 'tensorbord' (did you mean tensorboard?): choose one of"),
])
def test_typo_names_the_nearest(argv, says):
    with pytest.raises(ConfigError) as e: parse_args([*TINY, *argv])
    assert says in str(e.value), str(e.value)
    if "bogus" in says: assert "did you mean" not in str(e.value)


def test_a_yaml_value_outside_its_set_is_refused_too(tmp_path):
    (tmp_path / "run.yaml").write_text("model: tiny\ncompile: yes please\n")
    with pytest.raises(ConfigError, match="--compile 'yes please': choose one of auto, true, false"):
        parse_args(["--config", str(tmp_path / "run.yaml")])


def online(monkeypatch):
    "An online Hub (as outside the tests) whose every download fails the test."
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    def no_download(*args, **kwargs): raise AssertionError("the Hub was asked")
    monkeypatch.setattr(config.AutoConfig, "from_pretrained", no_download)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_download)


@pytest.mark.parametrize("name,says", [
    ("smal", "--model 'smal' (did you mean small?): not one of tiny, small, base, tiny-moe, small-moe"),
    ("tiny_moe", "--model 'tiny_moe' (did you mean tiny-moe?)"),
    ("gpt2", "--model 'gpt2': not one of tiny, small, base, tiny-moe, small-moe and not an existing path, nor a Hub "
             "id (owner/name)"),
])
def test_unknown_preset_refused_before_the_hub(name, says, monkeypatch):
    "Online, a name that is no preset, no path and no owner/name is refused at once: the Hub is never asked."
    online(monkeypatch)
    with pytest.raises(ConfigError) as e: parse_args(["--model", name])
    assert says in str(e.value), str(e.value)
    with pytest.raises(ValueError, match=r"not a preset|did you mean"): build_model(name, vocab_size=64)


def test_an_owner_name_id_still_goes_to_the_hub(monkeypatch):
    "The rule is no wider than it says: someone/model (online) is a Hub id, and from_pretrained is asked."
    online(monkeypatch)
    asked = []
    def missing(name, *args, **kwargs): asked.append(name); raise OSError(f"{name} is not a valid model identifier")
    monkeypatch.setattr(config.AutoConfig, "from_pretrained", missing)
    with pytest.raises(ConfigError, match="--model 'someone/model': not a preset and from_pretrained failed"):
        parse_args(["--model", "someone/model"])
    assert asked == ["someone/model"]


def test_unknown_preset_from_the_command_line_makes_no_request(tmp_path):
    """The trainer's own process, online, its Hub at a port that answers nothing: `--model smal` exits 2 with the
    nearest preset, and the Hub client never retries (it did, five times, before any answer). Its time is printed."""
    start = time.perf_counter()
    proc = run_cli([PY, "-m", "distcourse.train", "--model", "smal", "--output_dir", str(tmp_path / "x")], timeout=120,
                   env={"HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"})
    print(f"--model smal refused in {time.perf_counter() - start:.1f} s (imports included)")
    assert proc.returncode == 2 and "(did you mean small?)" in proc.stderr, proc.stderr[-2000:]
    assert "Retrying" not in proc.stderr and "127.0.0.1" not in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "x").exists()


def test_print_config_is_a_config_file(tmp_path, capsys):
    "--print_config: the file, then the flags, checked, as YAML; --config reads it back to the same Config; exit 0."
    (tmp_path / "base.yaml").write_text("model: tiny\nlr: 1e-3\nmixed_precision: 'no'\n")
    out = tmp_path / "run"
    argv = ["--config", str(tmp_path / "base.yaml"), "--seq_len", "64", "--overwrite", "--output_dir", str(out)]
    text = printed([*argv, "--print_config"], capsys)
    assert yaml.safe_load(text) == asdict(parse_args(argv))
    assert "mixed_precision: 'no'" in text and "lr: 0.001" in text and "overwrite: true" in text
    (tmp_path / "printed.yaml").write_text(text)
    assert parse_args(["--config", str(tmp_path / "printed.yaml")]) == parse_args(argv)
    assert not out.exists()  # printed, nothing run
    with pytest.raises(ConfigError, match="--seq_len 4096 exceeds"):  # a bad configuration is refused, not printed
        parse_args([*argv, "--seq_len", "4096", "--print_config"])


def test_plan_help_and_table(capsys):
    "One help line per flag; a unit a column, named in its header (no e-notation); equal steps by the smaller memory."
    with pytest.raises(SystemExit): plan.main(["--help"])
    text = capsys.readouterr().out
    for flag in ("model", "n_layer", "world", "global_batch", "seq_len", "profile", "top", "explain", "memory",
                 "published"):
        line = re.search(rf"--{flag}\b[^\n]*\n?[^\n-]*", text).group(0)
        assert "(default: " in text and not re.fullmatch(r"--\w+ \S+\s+default \S+\s*", line), line
    assert "{tiny,small,base,tiny-moe,small-moe}" in text
    rows = plan.main(["--model", "tiny", "--profile", "h100-node", "--world", "8", "--top", "12"])
    out = capsys.readouterr().out
    assert "equal step times: the smaller memory per rank" in out
    head = next(l for l in out.splitlines() if l.split()[:2] == ["#", "layout"])
    mem_unit, step_unit = re.search(r"(\S+)/rank\s+step (\S+)", head).groups()
    assert (mem_unit, step_unit) == ("MiB", "µs")  # tiny on H100s: tens of microseconds a step
    table = [l.split() for l in out.splitlines() if re.match(r"\s+\d+ dp\d", l)]
    assert len(table) == 12 and not any("e-" in l or "e+" in l for l in out.splitlines() if re.match(r"\s+\d", l))
    mib, us = [float(w[-5].replace(",", "")) for w in table], [float(w[-4].replace(",", "")) for w in table]
    assert us == sorted(us) and us[0] / 1e3 == pytest.approx(plan.printed_ms(rows[0]), rel=1e-12)
    assert mib[0] == round(rows[0]["memory"]["total"] / 2**20, 1)
    for i in range(1, len(us)):
        if us[i] == us[i - 1]: assert mib[i] >= mib[i - 1], (table[i - 1], table[i])
    assert any(us[i] == us[i - 1] for i in range(1, len(us)))  # a tie to order is in this table


def test_plan_units_follow_the_column():
    "Seconds and GiB for Llama 3 405B on H100s, one unit a column, the digits plan() ranks on; counts stay whole."
    h100 = PROFILES["h100-node"]
    L = planner.Layout(64, 1, 8, 16, "interleaved", 32, activation_checkpointing="selective")
    rows = [planner.predict(planner.LLAMA3_405B, L, 8192, h100), planner.predict(planner.LLAMA3_405B,
            planner.Layout(64, 1, 8, 16, "1f1b", 32, activation_checkpointing=True), 8192, h100)]
    head, *lines = plan.table(rows).splitlines()
    assert "GiB/rank" in head and "step s" in head and "M tokens/s" in head
    for r, line in zip(rows, lines):
        w = line.split()
        assert float(w[-4]) == float(f"{r['step_s']:.4g}") and float(w[-5]) == round(r["memory"]["total"] / 2**30, 1)
    assert [plan.sig4(x) for x in (12345.6, 0.6143, 4.205e-05)] == ["12,350", "0.6143", "0.00004205"]
    assert plan.unit_of([0.0421, 12.3], "seconds")[0] == "ms" and plan.unit_of([3334, 1e6], "count")[0] == ""
    assert plan.readable(3 * 2**30, "bytes", 1) == "3.0 GiB"


def test_plan_memory_bars(capsys):
    "--memory: a bar a pipeline stage, each family's letters in proportion, the fullest the bar's width."
    rows = plan.main(["--model", "small", "--n_layer", "4", "--world", "4", "--global_batch", "16", "--top", "1",
                      "--memory"])
    out = capsys.readouterr().out
    L, s = rows[0]["layout"], plan.shape_of("small", 4)
    bars = re.findall(r"stage +(\d+) \|(.{48})\| +([\d,.]+) MiB", out)
    assert [int(k) for k, _, _ in bars] == list(range(L.pp)) and L.pp > 1
    full = max(planner.memory(s, L, 128, "fp32", k)["total"] for k in range(L.pp))
    for k, bar, mib in bars:
        m = planner.memory(s, L, 128, "fp32", int(k))
        assert float(mib.replace(",", "")) == round(m["total"] / 2**20, 1)
        assert sum(plan.families(m).values()) == m["total"]  # every term of memory() in one family
        for letter, v in plan.families(m).items():
            assert abs(bar.count(letter) - v * 48 / full) <= 1, (k, letter, bar)
    assert max(len(bar.rstrip()) for _, bar, _ in bars) == 48
    assert "L" in bars[-1][1] and "L" not in bars[0][1]  # the logits on the last stage


def explained(argv, capsys):
    "plan.main's rows with --explain, and the lines it printed between the table and the command."
    rows = plan.main([*argv, "--explain"])
    return rows, capsys.readouterr().out.split("\n\n")[1].splitlines()


def shown(line) -> dict:
    "{term: (difference, decimals)} of an --explain line: 'name +1.25 ms; other -0.5 ms', {} for 'no term differs'."
    body = line.split("#2 minus #1: ")[1]
    if body == "no term differs": return {}
    terms = [t.rsplit(" ", 2) for t in body.split("; ")]
    return {k: (float(v.replace(",", "")), len(v.partition(".")[2])) for k, v, _unit in terms}


def agrees_with_the_breakdown(rows, lines):
    "Each difference printed is step_time's or memory's own term, #2's minus #1's, rounded; largest first; none left."
    a, b = rows[:2]
    for line, key, scale in ((lines[2], "time", 1e3), (lines[3], "memory", 2**-20)):
        want = {k: (b[key][k] - v) * scale for k, v in a[key].items() if k not in ("total", "first_step")}
        got = shown(line)
        assert set(got) <= set(want), (got, want)
        for k, (v, decimals) in got.items(): assert v == round(want[k], decimals) != 0, (k, v, want[k])
        assert [abs(v) for v, _ in got.values()] == sorted((abs(v) for v, _ in got.values()), reverse=True)
        smallest = min([abs(v) for v, _ in got.values()], default=1e-9)
        assert all(abs(want[k]) <= smallest for k in want if k not in got), (line, want)  # the rest print as 0


def test_plan_explain_names_the_terms_that_differ(capsys):
    "One process, one sequence: the first layout is faster (no recomputation), by the terms --explain names."
    rows, lines = explained(["--model", "small", "--n_layer", "4", "--world", "1", "--global_batch", "1"], capsys)
    a, b = rows[:2]
    assert lines[0] == f"why #1 {a['layout']} and not #2 {b['layout']}:" and b["layout"].activation_checkpointing
    margin = plan.printed_ms(b) - plan.printed_ms(a)
    assert margin > 0 and lines[1].startswith(f"  #1's step is {margin:,.2f} ms shorter")
    agrees_with_the_breakdown(rows, lines)
    step, memory = shown(lines[2]), shown(lines[3])
    assert step["compute"][0] > 0 and memory["activations"][0] < 0  # recomputation: a second forward, less kept
    assert sum(v for v, _ in step.values()) == pytest.approx(margin, abs=0.02)  # the terms add up to the margin
    assert f"memory per rank {a['memory']['total'] / 2**20:,.1f} vs {b['memory']['total'] / 2**20:,.1f} MiB" in lines[3]


def test_plan_explain_says_when_memory_or_the_name_decided(capsys):
    "The lesson's example: the first two print the same step, so the smaller memory per rank ranks first."
    rows, lines = explained(["--model", "small", "--n_layer", "4", "--world", "4", "--global_batch", "16", "--top", "3"],
                            capsys)
    a, b = rows[:2]
    assert plan.printed_ms(a) == plan.printed_ms(b) and a["memory"]["total"] < b["memory"]["total"]
    assert lines[1] == f"  equal steps as printed ({plan.printed_ms(a):,} ms), so the smaller memory per rank decided"
    agrees_with_the_breakdown(rows, lines)
    assert shown(lines[3])  # where the memory differs
    same = next(i for i in range(len(rows) - 1) if plan.printed_ms(rows[i]) == plan.printed_ms(rows[i + 1])
                and rows[i]["memory"]["total"] == rows[i + 1]["memory"]["total"])  # a tie on both
    assert "memory per rank, so the name decided" in plan.explain(rows[same:])
    assert str(rows[same]["layout"]) < str(rows[same + 1]["layout"])


def test_plan_explain_with_one_feasible_layout(capsys, tmp_path):
    "A device with memory for recomputation's layout only: --explain says it is the only one."
    shape, h100 = plan.shape_of("tiny"), PROFILES["h100-node"]
    peaks = [planner.predict(shape, L, 128, h100)["memory"]["total"] for L in planner.layouts(shape, 1, 1, 128, h100)]
    assert len(peaks) == 2
    (tmp_path / "gpu.json").write_text(json.dumps(asdict(h100) | {"name": "gpu", "mem_bytes": sum(peaks) / 2}))
    rows, lines = explained(["--model", "tiny", "--world", "1", "--global_batch", "1", "--profile",
                             str(tmp_path / "gpu.json")], capsys)
    assert len(rows) == 1 and rows[0]["layout"].activation_checkpointing
    assert lines == [f"why #1 {rows[0]['layout']}: the only feasible layout, nothing to compare it with"]
