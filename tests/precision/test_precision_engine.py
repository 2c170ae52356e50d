"""Mixed precision inside the engine: overflow-safe steps on every rank, working/master
dtypes and their bytes, convergence against fp32, the loss-scale floor stop, verify."""

from __future__ import annotations

import json
import math
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

from mct.cli import main as cli_main
from mct.config import EngineConfig
from mct.engine import Engine
from mct.models.gpt import GPT, gpt_loss, optimizer_groups
from mct.precision import LossScaleFloorError
from mct.run.schedule import lr_at
from mct.run.trainer import train
from mct.verify.compare import run_verify
from tests.distributed import run_distributed
from tests.helpers import adamw, batches, tiny_config

# Real text: a few stdlib modules (prose docstrings and code), copied as .txt files.
CORPUS_MODULES = ("textwrap", "string", "fnmatch", "glob", "shlex", "bisect", "heapq", "colorsys", "copy",
                  "keyword", "numbers", "operator", "queue", "sched", "secrets", "stat", "struct", "tokenize",
                  "types", "uuid", "weakref", "abc", "base64", "calendar")
TEXT_MODEL = {"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 32, "vocab_size": 256, "dropout": 0.0}


@pytest.fixture(autouse=True)
def one_thread():
    """The models here are tiny: a second thread only adds synchronization, which under
    load costs 100x the matmul itself (spawned ranks already run with one thread)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def text_corpus(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in CORPUS_MODULES:
        if (stdlib / f"{name}.py").is_file():
            shutil.copy(stdlib / f"{name}.py", out / f"{name}.txt")
    assert sum(f.stat().st_size for f in out.iterdir()) > 100_000
    return str(out)


def _text_config(corpus: str, precision: dict) -> EngineConfig:
    """50 steps of the tiny GPT at the default LR, untracked (the tracker's dispatch mode
    costs time and is not what these runs check)."""
    return EngineConfig.from_dict({"model": dict(TEXT_MODEL), "data": {"path": corpus, "micro_batch_size": 4},
                                   "train": {"steps": 50, "warmup_steps": 5, "eval_every": 49, "eval_batches": 4,
                                             "log_every": 1},
                                   "precision": precision, "memory": {"track": False}})


def _optimizer_state(engine: Engine) -> list[torch.Tensor]:
    return [v.clone() for s in engine.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def _bitwise_equal(a: list[torch.Tensor] | dict, b: list[torch.Tensor] | dict) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# ---- overflow on one rank: every rank skips, nothing changes ----

INJECT_CONFIGS = ((0, "fp32"), (0, "fp16"), (1, "bf16"), (2, "bf16"), (2, "fp16"), (3, "fp16"))
# At stages 1-3 this parameter lies in rank 1's shard of its unit only, so rank 0 sees a
# finite gradient shard: it skips only if the overflow decision is global.
POISONED = "blocks.1.mlp.proj.bias"


def _poison_one_gradient_element(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad.view(-1)[0] = math.inf
    return grad


def _in_rank0_shard(engine: Engine, name: str) -> bool:
    unit = next(u for u in engine.sharded.units if name in u.names)
    lo, hi = unit.layout.shard_range(0)
    off = unit.layout.offsets[unit.names.index(name)]
    return lo <= off < hi


def _inject_inf_on_rank_1(rank: int, world: int) -> dict:
    out = {}
    for stage, mode in INJECT_CONFIGS:
        cfg = tiny_config(zero={"stage": stage}, precision={"mode": mode})
        torch.manual_seed(0)
        model = GPT(cfg.model)
        engine = Engine(model, adamw, cfg, param_groups=optimizer_groups(model, 0.1))
        first = engine.train_step(batches(0, rank), gpt_loss)  # so optimizer state exists
        params, masters, opt = engine.full_state_dict(), [m.clone() for m in engine.sharded.masters()], \
            _optimizer_state(engine)
        hook = dict(model.named_parameters())[POISONED].register_hook(_poison_one_gradient_element) \
            if rank == 1 else None
        bad = engine.train_step(batches(1, rank), gpt_loss)
        if hook is not None:
            hook.remove()
        r = {"skipped": (first.skipped, bad.skipped), "loss_finite": math.isfinite(bad.loss),
             "poison_in_rank0_shard": _in_rank0_shard(engine, POISONED),
             "metrics_after_bad": {k: bad.metrics[k] for k in
                                   ("loss_scale", "overflows", "skipped_steps", "consecutive_skips")},
             "params_unchanged": _bitwise_equal(engine.full_state_dict(), params),
             "masters_unchanged": _bitwise_equal(list(engine.sharded.masters()), masters),
             "optimizer_unchanged": _bitwise_equal(_optimizer_state(engine), opt),
             "steps_done": engine.steps_done}
        clean = engine.train_step(batches(2, rank), gpt_loss)
        r["clean_skipped"] = clean.skipped
        r["clean_consecutive_skips"] = clean.metrics["consecutive_skips"]
        r["params_changed_after_clean"] = not _bitwise_equal(engine.full_state_dict(), params)
        out[(stage, mode)] = r
    return {"inject": out, "bytes": _stage2_bf16_bytes(world)}


def _stage2_bf16_bytes(world: int) -> dict:
    cfg = tiny_config(zero={"stage": 2}, precision={"mode": "bf16"})
    torch.manual_seed(0)
    engine = Engine(GPT(cfg.model), adamw, cfg)
    units = engine.sharded.units
    live = engine.tracker.live()
    return {"params": (live["params"], 2 * sum(u.layout.padded_numel for u in units)),
            "master": (live["master"], 4 * sum(u.layout.shard_numel for u in units)),
            "master_is_one_shard": all(u.master.numel() * world == u.layout.padded_numel for u in units)}


@pytest.fixture(scope="module")
def two_rank_results() -> list[dict]:
    """One spawn of 2 gloo ranks for every multi-rank check in this file."""
    return run_distributed(_inject_inf_on_rank_1, 2)


@pytest.mark.multirank
def test_inf_on_one_rank_skips_the_step_on_every_rank_and_leaves_state_bitwise_unchanged(two_rank_results):
    for rank, res in enumerate(two_rank_results):
        for (stage, mode), r in res["inject"].items():
            where = f"rank {rank}, stage {stage}, {mode}"
            assert r["skipped"] == (False, True), where
            assert r["loss_finite"], where  # the overflow is in one gradient element, not in the loss
            assert r["params_unchanged"] and r["masters_unchanged"] and r["optimizer_unchanged"], (where, r)
            assert r["steps_done"] == 1, where
            m = r["metrics_after_bad"]
            assert (m["skipped_steps"], m["consecutive_skips"]) == (1, 1), where
            # fp16 spends one unit of hysteresis (default 2) and keeps the scale; bf16/fp32 have none
            assert m["overflows"] == (1 if mode == "fp16" else 0), where
            assert m["loss_scale"] == (2.0**16 if mode == "fp16" else None), where
            assert r["clean_skipped"] is False and r["clean_consecutive_skips"] == 0, where
            assert r["params_changed_after_clean"], where
    # not vacuous: at stages 1-3 the poisoned element is outside rank 0's gradient shard
    assert not any(two_rank_results[0]["inject"][c]["poison_in_rank0_shard"] for c in INJECT_CONFIGS if c[0] > 0)


@pytest.mark.multirank
def test_stage2_master_bytes_are_one_fp32_shard_per_rank(two_rank_results):
    for res in two_rank_results:
        r = res["bytes"]
        assert r["params"][0] == r["params"][1]
        assert r["master"][0] == r["master"][1]
        assert r["master_is_one_shard"]


# ---- dtypes and bytes ----

@pytest.mark.parametrize("mode,reduce_dtype", [("bf16", "fp32"), ("fp16", "fp32"), ("bf16", "param")])
def test_working_params_are_low_precision_and_master_is_fp32_with_tracked_bytes(mode, reduce_dtype):
    cfg = tiny_config(precision={"mode": mode, "reduce_dtype": reduce_dtype})
    torch.manual_seed(0)
    model = GPT(cfg.model)
    engine = Engine(model, adamw, cfg, param_groups=optimizer_groups(model, 0.1))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[mode]
    assert {p.dtype for p in model.parameters()} == {dtype}
    units = engine.sharded.units
    assert all(u.master.dtype == torch.float32 and not u.master_is_view for u in units)
    padded = sum(u.layout.padded_numel for u in units)  # stage 0: one unit is one replicated shard
    assert padded >= sum(p.numel() for p in model.parameters())
    live = engine.tracker.live()
    assert live["params"] == 2 * padded
    assert live["master"] == 4 * sum(u.layout.shard_numel for u in units)
    # fp32 reduction: one fp32 buffer is both the all-reduced and the stepped gradient;
    # param-dtype reduction: a low-precision buffer plus the fp32 shard
    assert live["grads"] == (4 * padded if reduce_dtype == "fp32" else 6 * padded)
    engine.train_step(batches(0, 0), gpt_loss)
    for u in units:  # the working copy is the master re-cast after the step
        assert torch.equal(u.working, u.master.to(dtype))
    # ... and the master keeps what the working dtype rounds away
    assert any(not torch.equal(u.master, u.working.float()) for u in units)
    assert engine.tracker.live()["master"] == 4 * sum(u.layout.shard_numel for u in units)


def test_fp32_mode_has_no_separate_master_copy():
    cfg = tiny_config()
    torch.manual_seed(0)
    engine = Engine(GPT(cfg.model), adamw, cfg)
    assert all(u.master_is_view for u in engine.sharded.units)
    assert engine.tracker.live()["master"] == 0
    out = engine.train_step(batches(0, 0), gpt_loss)
    assert out.loss_scale is None and out.metrics["loss_scale"] is None


# ---- convergence on real text ----

def _metrics_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_bf16_and_fp16_train_within_2_percent_of_fp32_and_fp16_recovers_from_a_high_scale(text_corpus, tmp_path):
    runs = {"fp32": {"mode": "fp32"}, "bf16": {"mode": "bf16"}, "fp16": {"mode": "fp16"},
            "fp16_2^24": {"mode": "fp16", "initial_scale_power": 24}}
    summaries, rows = {}, {}
    for name, precision in runs.items():
        summaries[name] = train(_text_config(text_corpus, precision), tmp_path / name, progress=False)
        rows[name] = _metrics_rows(tmp_path / name)
    ref = summaries["fp32"]
    assert ref.final_val_loss < ref.first_val_loss - 1.0, "the model must actually learn for this to mean much"
    for name in ("bf16", "fp16"):
        s = summaries[name]
        assert all(math.isfinite(float(r["loss"])) for r in rows[name]), name
        assert abs(s.final_loss - ref.final_loss) <= 0.02 * ref.final_loss, (name, s.final_loss, ref.final_loss)
        assert abs(s.final_val_loss - ref.final_val_loss) <= 0.02 * ref.final_val_loss, name
        assert s.skipped_steps == 0, name
    # 2**24 overflows fp16 gradients: the scale backs off (a later probe may overflow once
    # more), then training runs clean
    high = rows["fp16_2^24"]
    skipped = [r["skipped"] for r in high]
    assert summaries["fp16_2^24"].skipped_steps == sum(skipped) > 0
    # skipped steps do not advance the LR schedule: step i runs at the LR of its optimizer step
    tcfg = _text_config(text_corpus, {"mode": "fp16"}).train
    assert [r["lr"] for r in high] == [lr_at(i - sum(skipped[:i]), tcfg) for i in range(len(high))]
    # the logged scale is the one each step used: hysteresis 2 spends step 0's overflow
    # without backing off, so step 1 still ran at 2**24
    assert skipped[:2] == [True, True] and high[0]["loss_scale"] == high[1]["loss_scale"] == 2.0**24
    assert not any(skipped[-25:]) and high[-1]["loss_scale"] < 2.0**24, skipped
    assert all(math.isfinite(float(r["loss"])) for r in high[-25:])
    assert abs(summaries["fp16_2^24"].final_val_loss - ref.final_val_loss) <= 0.05 * ref.final_val_loss


# ---- the loss-scale floor ----

@pytest.mark.parametrize("stage", [0, 3])
def test_overflow_at_the_scale_floor_raises_and_keeps_the_last_good_state(stage):
    # scale 8, floor 4, hysteresis 2: overflow 1 spends the hysteresis, 2 halves to 4, 3 raises
    cfg = tiny_config(zero={"stage": stage}, precision={"mode": "fp16", "initial_scale_power": 3,
                                                         "min_scale": 4.0, "hysteresis": 2})
    torch.manual_seed(0)
    engine = Engine(GPT(cfg.model), adamw, cfg)
    assert not engine.train_step(batches(0, 0), gpt_loss).skipped
    params, opt = engine.full_state_dict(), _optimizer_state(engine)

    def always_overflows(model, batch):
        return gpt_loss(model, batch) * math.inf

    assert [engine.train_step(batches(1, 0), always_overflows).skipped for _ in range(2)] == [True, True]
    with pytest.raises(LossScaleFloorError, match=r"min_scale.*bf16"):
        engine.train_step(batches(1, 0), always_overflows)
    assert _bitwise_equal(engine.full_state_dict(), params)
    assert _bitwise_equal(_optimizer_state(engine), opt)
    assert engine.scaler.metrics()["consecutive_skips"] == 3
    # the engine stays usable: no non-finite gradient is left behind for the next step
    out = engine.train_step(batches(2, 0), gpt_loss)
    assert not out.skipped and math.isfinite(out.grad_norm)
    assert not _bitwise_equal(engine.full_state_dict(), params)


def test_floor_stop_through_the_cli_is_a_clear_message_and_exit_code_3(text_corpus, tmp_path, capsys):
    # 2**40 overflows fp16 gradients on the first step, and it is also the floor
    code = cli_main(["train", "--run-dir", str(tmp_path / "run"), "--no-progress",
                     "--set", f"data.path={text_corpus}", "--set", "data.micro_batch_size=4",
                     *[f"--set=model.{k}={v}" for k, v in TEXT_MODEL.items()],
                     "--set", "train.steps=3", "--set", "train.eval_every=0",
                     "--set", "precision.mode=fp16", "--set", "precision.initial_scale_power=40",
                     "--set", f"precision.min_scale={2.0**40}", "--set", "precision.hysteresis=1"])
    err = capsys.readouterr().err
    assert code == 3
    assert "training stopped" in err and "min_scale" in err and "last good step (0)" in err, err


def test_min_scale_above_the_initial_scale_is_rejected_by_the_config():
    with pytest.raises(ValueError, match=r"precision.min_scale = 8.0 .* 2\*\*precision.initial_scale_power = 4"):
        EngineConfig.from_dict({"precision": {"mode": "fp16", "initial_scale_power": 2, "min_scale": 8.0}})


# ---- mct verify ----

@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_verify_passes_in_low_precision_with_its_documented_tolerances(text_corpus, mode):
    cfg = EngineConfig.from_dict({"model": dict(TEXT_MODEL), "data": {"path": text_corpus, "micro_batch_size": 8},
                                  "precision": {"mode": mode}})
    report = run_verify(cfg, 8)
    assert report.passed, report.table()
    assert (report.loss_tol, report.param_tol) == (2e-2, 5e-2)
    assert 0 < report.param_rel and 0 < report.max_loss_rel, "low precision must differ from the fp32 reference"
