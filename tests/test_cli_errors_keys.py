"""Every config key's hostile values, derived from the schema: wrong type, out of range and
empty for each key by its annotation (a key added later gets its rows without anyone
writing them), and a change on `--resume` refused for keys of every section. Each is one
``mct: error:`` line naming the key, exit 2, nothing written. Path-valued keys' links,
FIFOs and files are rows of tests/test_cli_errors.py."""

from __future__ import annotations

import types
import typing
from pathlib import Path

import pytest

from mct.cli import main
from mct.config import _SECTIONS, ByteSize, EngineConfig, Name, resume_rules
from mct.run.trainer import train

FREE_TEXT = {"data.path": "a path ('' = the stdlib sources)", "train.init_from": "a path ('' = none)",
             "offload.dir": "a path ('' = the temporary directory)",
             "checkpointing.blocks": "module class names, checked against the model (blocks-not-found)",
             "zero.units": "module class names, checked against the model (zero-units-not-found)"}
"""Keys whose text is any path or name: no out-of-range string; checked where they are used."""
EMPTY_IS_VALID = {"data.path", "train.init_from", "offload.dir", "memory.budget", "checkpointing.blocks",
                  "checkpointing.per_block", "zero.units", "memory.solver_allow", "optimizer.betas", "adapter.targets"}
"""Keys where '' means something (none, the default, a cleared list)."""


def _annotation(key: str) -> typing.Any:
    if key == "seed":
        return int
    section, name = key.split(".")
    return typing.get_type_hints(_SECTIONS[section])[name]


def hostile(key: str) -> dict[str, str]:
    """{what: --set text} the key must refuse, by its annotation."""
    t = _annotation(key)
    options = typing.get_args(t) if isinstance(t, types.UnionType) else (t,)
    origins = {typing.get_origin(o) for o in options}
    rows: dict[str, str] = {} if key in EMPTY_IS_VALID else {"empty": ""}
    if t is int:
        rows |= {"wrong type": "abc", "not an integer": "1.5", "out of range": "-1"}
    elif t is float:
        rows |= {"wrong type": "abc", "out of range": "-1", "not finite": "nan"}
    elif t is bool:
        rows |= {"wrong type": "maybe", "a number": "2"}
    elif t == int | str:  # zero.stage
        rows |= {"wrong type": "[1]", "out of range": "4"}
    elif t is str:
        rows |= {} if key in FREE_TEXT else {"out of range": "no-such-choice"}
    elif isinstance(t, type) and issubclass(t, Name):  # precision.mode: converted at load
        rows |= {"wrong type": "[fp32]", "out of range": "no-such-choice"}
    elif options == (ByteSize, type(None)):  # memory.budget: a size, converted at load
        rows |= {"wrong type": "[1]", "out of range": "-1", "not a size": "2 parsecs"}
    elif dict in origins:  # checkpointing.per_block
        rows |= {"wrong type": "[1, 2]", "out of range": "[all, most]", "malformed": "{all=1"}
    elif options == (list[float],):
        rows |= {"wrong type": "[a, b]", "out of range": "[0.9, 1.5]", "malformed": "[0.9"}
    elif list in origins:
        rows |= {"wrong type": "{a=1}", "malformed": "[a"} | ({} if key in FREE_TEXT else {"out of range": "[nope]"})
    else:
        raise AssertionError(f"{key}: no hostile values for {t}; add them here")
    return rows


CASES = [(key, what, text) for key in resume_rules() for what, text in hostile(key).items()]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    for i in range(8):
        (d / f"f{i}.txt").write_text(f"file {i}: " + "the quick brown fox jumps over the lazy dog. " * 30)
    return d


def _one_error_line(argv: list[str], capsys) -> str:
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and "Traceback" not in err, err
    errors = [line for line in lines if line.startswith("mct: error:")]
    assert len(errors) == 1 and all(line.startswith("mct: warning:") for line in lines if line not in errors), err
    return errors[0]


def test_every_key_of_the_schema_has_hostile_rows():
    """The paths' rows (a link, a FIFO, a file for a directory) are in tests/test_cli_errors.py."""
    paths = {"data.path", "train.init_from", "offload.dir"}
    assert {key for key, _, _ in CASES} == set(resume_rules()) - paths


@pytest.mark.parametrize("key,what,text", CASES, ids=[f"{k}-{w}" for k, w, _ in CASES])
def test_a_hostile_value_of_any_key_is_one_line_naming_it(key, what, text, corpus, tmp_path, capsys):
    run = tmp_path / "run"
    argv = ["train", "--no-progress", "--run-dir", str(run), "--set", f"data.path={corpus}",
            "--set", "train.steps=1", "--set", f"{key}={text}"]
    line = _one_error_line(argv, capsys)
    assert key in line, (what, line)
    assert not run.exists(), "a refused command wrote its run dir"


# ---- a change on --resume, a key of every section that declares it fixed ----
RESUME_REFUSED = ["seed=9", "model.d_model=64", "model.attention=explicit", "data.micro_batch_size=4",
                  "data.grad_accum=2", "train.lr=0.5", "train.lr_schedule=wsd", "train.init_from=w.safetensors",
                  "precision.mode=bf16", "optimizer.eps=0.5", "optimizer.betas=[0.8, 0.9]",
                  "optimizer.state_dtype=int8", "optimizer.state_dtype=bf16", "adapter.kind=lora"]


@pytest.fixture(scope="module")
def a_run(corpus, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("resume") / "run"
    cfg = {"model": {"n_layer": 1, "n_head": 2, "d_model": 32, "seq_len": 16},
           "data": {"path": str(corpus), "micro_batch_size": 2}, "train": {"steps": 2, "eval_every": 0}}
    train(EngineConfig.from_dict(cfg), run, progress=False)
    return run


def test_every_fixed_declaration_is_exercised_by_a_section_here():
    fixed_sections = {k.split(".")[0] for k, r in resume_rules().items() if not r.allowed}
    assert fixed_sections <= {s.split("=")[0].split(".")[0] for s in RESUME_REFUSED}


@pytest.mark.parametrize("change", RESUME_REFUSED)
def test_a_forbidden_change_on_resume_is_one_line_with_both_values_and_the_fix(change, a_run, capsys):
    before = sorted((p.relative_to(a_run), p.stat().st_mtime_ns) for p in a_run.rglob("*"))
    key = change.split("=")[0]
    line = _one_error_line(["train", "--resume", str(a_run), "--no-progress", "--set", change], capsys)
    assert line.startswith(f"mct: error: --resume cannot change {key} from "), line
    assert resume_rules()[key].fix.split("{")[0] in line
    assert sorted((p.relative_to(a_run), p.stat().st_mtime_ns) for p in a_run.rglob("*")) == before


def test_calibrate_says_which_world_size_it_did_not_measure(capsys):
    """`mct calibrate --world-size 1000` on a small machine: one warning line saying the
    collectives were measured at fewer ranks and the 1000-rank ones are scaled."""
    from types import SimpleNamespace

    from mct.cli.plan import _warn_unmeasured_world
    from mct.planner.steptime import measured_world
    profile = SimpleNamespace(device="cpu")
    here = measured_world(profile, 1000)
    _warn_unmeasured_world(profile, 1000)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"mct: warning: --world-size 1000: collectives were measured at "
                                               f"{here} ranks"), err
    assert "not 1000" in err[0] and "scaled" in err[0]
    _warn_unmeasured_world(profile, here)  # a world it measured: nothing to say
    _warn_unmeasured_world(profile, 1)
    assert capsys.readouterr().err == ""
