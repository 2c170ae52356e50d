"""Flags that contradict each other are one ``mct: error:`` line naming both (exit 2, before
any work), or, where one is merely without effect, one warning line (``mct.cli.conflicts``)."""

from __future__ import annotations

import pytest

from mct.cli import build_parser, main
from mct.cli.conflicts import SOLVE_IGNORES, check_conflicts, given

SOLVE = ["plan", "--budget", "1GiB", "--solve"]

# (case id, argv after `mct`, the two flags the line names)
CONFLICTS: list[tuple[str, list[str], tuple[str, str]]] = [
    ("solve-policies", [*SOLVE, "--stages", "0", "--policies", "none", "--precisions", "bf16"],
     ("--solve", "--policies")),
    ("solve-offloads", [*SOLVE, "--offloads", "optimizer=cpu"], ("--solve", "--offloads")),
    ("solve-act-offloads", [*SOLVE, "--act-offloads", "cpu"], ("--solve", "--act-offloads")),
    ("solve-loss-chunks", [*SOLVE, "--loss-chunks=0,1024"], ("--solve", "--loss-chunks")),
    ("solve-mlp-tiles", [*SOLVE, "--mlp-tiles", "1024"], ("--solve", "--mlp-tiles")),
    ("solve-full-depth-abbreviated", [*SOLVE, "--full"], ("--solve", "--full-depth")),
    ("solve-several-precisions", [*SOLVE, "--precisions", "fp32,bf16"], ("--solve", "--precisions")),
    ("model-and-set-model-source", ["train", "--model", "gpt", "--set", "model.source=hf:x"],
     ("--model", "model.source")),
    ("init-from-and-set-init-from", ["verify", "--init-from", "a.safetensors", "--set", "train.init_from=b"],
     ("--init-from", "train.init_from")),
    ("plan-init-from-and-set-init-from", ["plan", "--init-from", "a", "--set", "train.init_from=b"],
     ("--init-from", "train.init_from")),  # plan takes train's --init-from, so a journey's flags carry over
    ("plan-model-and-set-model-source", ["plan", "--set", "model.source=hf:x", "--model", "gpt"],
     ("--model", "model.source")),
    ("rdzv-endpoint-one-node", ["train", "--rdzv-endpoint", "localhost:29400"], ("--rdzv-endpoint", "--nnodes 1")),
    ("rdzv-id-one-node", ["train", "--nnodes", "1", "--rdzv-id", "job"], ("--rdzv-id", "--nnodes 1")),
    ("export-hf-into-a-safetensors-name", ["export", "run", "--format", "hf", "--out", "w.safetensors"],
     ("--format hf", "--out")),
]


@pytest.mark.parametrize("argv,flags", [c[1:] for c in CONFLICTS], ids=[c[0] for c in CONFLICTS])
def test_contradicting_flags_are_one_error_line_naming_both(argv, flags, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # nothing may be written, here or anywhere
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mct: error: "), lines
    assert all(f in lines[0] for f in flags), lines[0]
    assert list(tmp_path.iterdir()) == []


def test_every_grid_flag_the_solver_ignores_is_refused_with_solve():
    parser = build_parser()
    for flag in SOLVE_IGNORES:
        argv = [*SOLVE, flag] if flag == "--full-depth" else [*SOLVE, flag, "0"]
        with pytest.raises(ValueError, match=f"--solve and {flag} contradict"):
            check_conflicts(parser.parse_args(argv), argv)


@pytest.mark.parametrize("argv", [
    [*SOLVE, "--stages", "0,3", "--precisions", "bf16", "--workers", "1"],  # what --solve reads (docs/planner.md)
    ["plan", "--precisions", "fp32,bf16", "--policies", "none", "--full-depth"],  # the grid, no --solve
    ["train", "--model", "gpt", "--set", "model.source=gpt"],  # the same value twice
    ["train", "--nnodes", "2", "--rdzv-endpoint", "localhost:29400", "--rdzv-id", "job"],
    ["export", "run", "--format", "hf", "--out", "exported"],
    ["export", "run", "--out", "w.safetensors", "--dtype", "fp32"],
    ["sample", "run", "--temperature", "0"],
], ids=["solve-reads", "grid", "same-value", "two-nodes", "export-hf-dir", "export-file", "greedy-no-seed"])
def test_flags_that_agree_pass_without_a_word(argv):
    assert check_conflicts(build_parser().parse_args(argv), argv) == []


def test_a_seed_with_greedy_sampling_is_a_warning_line(capsys):
    assert main(["sample", "no-such-run", "--temperature", "0", "--seed", "3"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0] == ("mct: warning: --seed 3 has no effect with --temperature 0 (greedy decoding draws no "
                        "random numbers)")
    assert len(lines) == 2 and lines[1].startswith("mct: error: ")  # then the command's own error


def test_plan_refuses_trains_nproc_in_one_line_naming_world_size(capsys):
    assert main(["plan", "--nproc", "2", "--budget", "1GiB"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["mct: error: mct plan has no --nproc: it plans 2 data-parallel ranks with --world-size 2 "
                     "(--nproc is mct train's); pass --world-size 2"]


def test_given_reads_flags_as_argparse_does():
    assert given(["plan", "--polic", "none"], "--policies") and given(["plan", "--policies=none"], "--policies")
    assert not given(["plan", "--plot", "p.png"], "--policies")
    assert not given(["sample", "run", "--", "--seed"], "--seed")
