"""What the parallel code refuses instead of doing something silently wrong: splitters on a
length they cannot cut evenly (zig-zag used to drop the remainder), and dropout under --cp or --pp
(ranks seeded alike would draw the same masks where one process draws them afresh). --tp draws its split
heads' masks from a random state per rank and takes dropout (tests/test_tp_dropout.py proves it)."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing._internal.distributed.fake_pg import FakeStore

from conftest import PY, ROOT, run_cli
from distcourse.config import ConfigError, parse_args
from distcourse.context_parallel import seq_positions, zigzag_split, zigzag_unsplit
from distcourse.mesh import Mesh
from distcourse.sequence_parallel import _reduce_scatter

pytestmark = pytest.mark.fast  # every test here is quick: in the fast tier

TINY = ["--config", str(ROOT / "configs/tiny.yaml")]


def test_zigzag_split_refuses_a_length_it_would_truncate():
    "T=10, cp=2 used to hand out positions 0-7 and drop 8 and 9; now it says so, and the fix."
    x = torch.arange(10)[None]  # (1, T)
    want = (r"T=10 tokens do not cut into 4 equal chunks .* the last 2 would be dropped; "
            r"use a multiple of 4, e.g. 12")
    for rank in range(2):
        with pytest.raises(ValueError, match=want): zigzag_split(x, rank, 2)
    with pytest.raises(ValueError, match="T=3 tokens do not cut into 2 equal chunks"):
        seq_positions(3, 0, 2, "contiguous")
    even = torch.arange(12)[None]  # a multiple of 2·cp: every token held once, and back in order
    pieces = [zigzag_split(even, r, 3) for r in range(3)]
    assert sorted(torch.cat(pieces, 1).flatten().tolist()) == list(range(12))
    assert torch.equal(zigzag_unsplit(pieces), even)


def test_zigzag_unsplit_refuses_pieces_of_odd_length():
    "Pieces of 3 tokens on 2 ranks make T=6, which zig-zag cannot have cut: refused."
    with pytest.raises(ValueError, match="T=6 tokens do not cut into 4 equal chunks"):
        zigzag_unsplit([torch.zeros(1, 3), torch.zeros(1, 3)])


@pytest.fixture
def fake_group():
    "A 2-rank process group of the fake backend (no peers, no traffic), gone after the test."
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_sequence_parallel_scatter_refuses_an_uneven_sequence(fake_group):
    "The reduce-scatter along the sequence: T=5 on tp=2 is refused before any collective."
    with pytest.raises(ValueError, match="seq_len=5 is not divisible by tp=2: .* multiple of 2"):
        _reduce_scatter(torch.zeros(2, 5, 4), fake_group, "forward", None)  # (B, T, C)
    assert _reduce_scatter(torch.zeros(2, 6, 4), fake_group, "forward", None).shape == (2, 3, 4)


def test_mesh_rows_refuse_a_batch_dp_cannot_split():
    "`Mesh.rows` cuts the global micro-batch over dp: 3 rows on 2 replicas would give 2 and 1."
    mesh = Mesh.__new__(Mesh)  # only what `rows` reads: the degrees, this replica, the device
    mesh.d, mesh.dp_rank, mesh.device = {"dp": 2}, 1, torch.device("cpu")
    batch = {"input_ids": torch.arange(12).view(3, 4), "labels": torch.arange(12).view(3, 4)}
    with pytest.raises(ValueError, match="3 rows does not split evenly over dp=2 replicas"):
        mesh.rows(batch)
    x, y = mesh.rows({k: v[:2] for k, v in batch.items()})
    assert x.tolist() == [[4, 5, 6, 7]] and y.tolist() == [[5, 6, 7, -100]]


DROPOUT = [(["--cp", "2"], "--cp 2 with --model base (dropout 0.1): ring and Ulysses "
                           "attention have no attention dropout"),
           (["--pp", "2", "--grad_accum", "2"], "--pp 2 with --model base (dropout 0.1): every "
                                                "pipeline stage starts from the same seed")]


@pytest.mark.parametrize("flags,msg", DROPOUT, ids=["cp", "pp"])
def test_dropout_refused_on_the_mesh(flags, msg, monkeypatch, tmp_path):
    "--model base keeps GPT-2's dropout 0.1: refused by parsing alone, naming the presets that do."
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = ["--output_dir", str(tmp_path / "x")]
    with pytest.raises(ConfigError) as e: parse_args([*TINY, "--model", "base", *flags, *out])
    assert str(e.value).startswith(msg), e.value
    assert "use a preset without dropout (tiny, small)" in str(e.value)
    assert not dist.is_initialized()
    assert parse_args([*TINY, "--model", "small", *flags, *out]).model == "small"  # dropout 0


def test_dropout_accepted_under_tp(monkeypatch, tmp_path):
    "--model base --tp 2 (dropout 0.1) passes: its heads' masks come from a random state per tp rank."
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = parse_args([*TINY, "--model", "base", "--tp", "2", "--output_dir", str(tmp_path / "x")])
    assert (cfg.model, cfg.tp) == ("base", 2)
    with pytest.raises(ConfigError, match="--cp 2 with --model base"):  # tp composed with cp: still refused
        parse_args([*TINY, "--model", "base", "--tp", "2", "--cp", "2", "--output_dir", str(tmp_path / "y")])


def test_dropout_would_repeat_across_stages():
    "Why --pp is refused too: two processes seeded alike draw the same mask, whatever its shape."
    torch.manual_seed(0)
    first = F.dropout(torch.ones(4, 8, 64), 0.1) == 0  # stage 0's first dropout: (b, T, C)
    torch.manual_seed(0)
    other = F.dropout(torch.ones(4, 2, 8, 8), 0.1) == 0  # stage 1's first: another layer and shape
    shared = first.flatten()[:other.numel()]
    assert other.any() and torch.equal(shared, other.flatten())  # one process: drawn afresh


def test_cli_refuses_base_cp2_before_any_process_group(tmp_path):
    "`--model base --cp 2`: exit 2 with the reason; nothing written, no process group."
    out = tmp_path / "x"
    argv = [PY, "-m", "distcourse.train", *TINY, "--model", "base", "--cp", "2"]
    proc = run_cli([*argv, "--output_dir", str(out)], timeout=300,
                   env={"WORLD_SIZE": "2"})  # as a 2-process launch sets it; no peer is up
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--cp 2 with --model base (dropout 0.1)" in proc.stderr and "or --cp 1" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()
