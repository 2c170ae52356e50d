"""Memory planner: dry runs of the engine against an independent count of live storage
on models it was not tuned for, published model-state numbers, `auto`, `mct plan`
(with a Hugging Face model), and the enforced budget."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import mct
from mct.cli import main
from mct.config import EngineConfig
from mct.engine import Engine
from mct.memory.tracker import MemoryBudgetExceeded, MemoryTracker
from mct.models.gpt import GPT, gpt_loss, optimizer_groups
from mct.planner import dry_run, resolve_auto, token_loss
from mct.task import gpt_task as planning_workload
from tests.distributed import run_distributed
from tests.helpers import TINY_MODEL, adamw, batches, tiny_config
from tests.planner_models import hf_gpt2, random_batch, tied_frozen_reused
from tests.storage_count import measure

B = 3
MODELS = {"hf_gpt2": hf_gpt2, "tied_frozen_reused": tied_frozen_reused}
# A sample of models x stages 0-3 x none/all/selective x fp32/bf16 on 1-3 ranks (3: nothing
# divides evenly), kept small for the suite's time; benchmarks/planner.py runs the whole grid
# (288 configurations, 1-4 ranks).
SAMPLE = {1: [("hf_gpt2", 0, "none", "bf16")],
          2: [("hf_gpt2", 3, "all", "bf16"), ("tied_frozen_reused", 1, "selective", "fp32")],
          3: [("tied_frozen_reused", 2, "all", "bf16")]}


def _cfg(stage: int, policy: str, precision: str) -> EngineConfig:
    return tiny_config(zero={"stage": stage}, checkpointing={"policy": policy}, precision={"mode": precision})


def _measure_sample(rank: int, world: int, sample: list) -> list[dict]:
    return [measure(MODELS[m], token_loss, lambda s, r: random_batch(s, r, B), _cfg(*c), rank, steps=3)
            for m, *c in sample]


@pytest.mark.multirank
def test_dry_run_within_2_percent_of_independently_counted_peaks_on_held_out_models():
    """Steady-state step, first step and initialization, per rank, against every live
    storage counted by a dispatch mode that knows nothing of the engine's categories."""
    for world, sample in SAMPLE.items():
        got = _measure_sample(0, 1, sample) if world == 1 else run_distributed(_measure_sample, world, sample)[0]
        for (m, *c), real in zip(sample, got):
            run = dry_run(MODELS[m], token_loss, random_batch(0, 0, B), _cfg(*c), world)
            # Steady state: the lower of two steady steps. Once in about five suite runs a
            # 3-rank stage-2 step counted 213,434 bytes against the usual 193,638 (same code):
            # a storage released late, not traced yet (a collective's thread is suspected).
            for name, pred, meas in (("steady", run.peak, min(real["steps"][1:])),
                                     ("first step", run.first_step_peak, real["steps"][0]),
                                     ("init", run.init_peak, real["init"])):
                assert abs(pred - meas) <= 0.02 * meas, (world, m, c, name, pred, meas)


def test_predict_peak_equals_the_engine_tracker_of_the_same_step():
    """The dry run is the engine's own code: its steady-state peak is the tracker's."""
    cfg = tiny_config(zero={"stage": 2}, checkpointing={"policy": "all"}, precision={"mode": "bf16"})
    torch.manual_seed(0)
    model = GPT(cfg.model)
    engine = Engine(model, adamw, cfg, param_groups=optimizer_groups(model, 0.1))
    peaks = [engine.train_step(batches(s, 0, 1, B=B), gpt_loss).metrics["peak_bytes"] for s in range(2)]
    pred = mct.predict_peak(lambda: GPT(cfg.model), gpt_loss, batches(0, 0, 1, B=B)[0], cfg, world_size=1,
                            optimizer=adamw, param_groups=lambda m: optimizer_groups(m, 0.1))
    assert pred == peaks[1]


class _Pairs(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.up1, self.down1 = nn.Linear(d, h, bias=False), nn.Linear(h, d, bias=False)
        self.up2, self.down2 = nn.Linear(d, h, bias=False), nn.Linear(h, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.down1(self.up1(x))
        return x + self.down2(self.up2(x))


class _Wide(nn.Module):
    """Shapes of a large model, for dry runs only (fake tensors: nothing is allocated):
    an embedding, then blocks of two (d -> h -> d) pairs."""

    def __init__(self, vocab: int, d: int, h: int, n_blocks: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(_Pairs(d, h) for _ in range(n_blocks))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return x


def _model_states(model_fn, world: int, stage: int, shared: bool = False) -> tuple[dict[str, int], int]:
    """Model-state bytes per category in the steady-state optimizer phase (its
    temporaries are 'other'), and the parameter count, from a bf16 dry run. ``shared``:
    gloo ranks on one host sharing memory (``distributed.shared_memory``: at stage 3 each
    keeps a bf16 cast of its master shard for its peers); off, the ranks send messages (as
    on the GPUs these figures are for)."""
    # one bucket per collective: model states do not depend on it, and a dry run costs per op
    cfg = EngineConfig.from_dict({"zero": {"stage": stage, "bucket_mb": 2.0**20}, "precision": {"mode": "bf16"},
                                  "distributed": {"shared_memory": shared}})
    loss = lambda m, x: m(x).float().square().mean()  # noqa: E731
    run = dry_run(model_fn, loss, torch.zeros(1, 1, dtype=torch.long), cfg, world)
    return run.phases["optimizer"], run.n_params


def test_zero_paper_model_states_within_1_percent():
    """Rajbhandari et al. 2020 (ZeRO), Table 1 / Figure 1: psi = 7.5B, N = 64, K = 12,
    mixed-precision Adam: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB per device at stages 0-3.
    The engine keeps its gradients in fp32 (4 bytes where the paper has 2: counted at
    half) and, at stage 3, no 16-bit parameter shard where ranks send messages (it gathers
    from the fp32 master: the paper's 2 psi / N added back); ranks of one host sharing
    memory keep it, as the paper does. Tolerance 1%, or the paper's own rounding where
    that is coarser (it prints 1.875 GB as 1.9 GB)."""
    paper = {0: 120e9, 1: 31.4e9, 2: 16.6e9, 3: 1.9e9}
    for stage, want in paper.items():
        states, psi = _model_states(lambda: _Wide(8, 4096, 65536, 7), 64, stage)
        assert abs(psi - 7.5e9) < 0.005 * 7.5e9
        got = states["params"] + states["master"] + states["optimizer"] + states["grads"] / 2
        got += 2 * psi / 64 if stage == 3 else 0
        assert abs(got - want) <= max(0.01 * want, 0.05e9), (stage, got, want)
    # ranks of one host sharing memory keep that 16-bit shard at stage 3, as the paper does
    states, psi = _model_states(lambda: _Wide(8, 4096, 65536, 7), 64, 3, shared=True)
    assert abs(states["params"] - 2 * psi / 64) <= 0.01 * 2 * psi / 64, (states, psi)
    got = states["params"] + states["master"] + states["optimizer"] + states["grads"] / 2
    assert abs(got - paper[3]) <= max(0.01 * paper[3], 0.05e9), (got, paper[3])


def test_deepspeed_memory_rst_zero2_and_zero3_worked_examples_within_1_percent():
    """DeepSpeed docs/code-docs/source/memory.rst, "API To Estimate Memory Usage": t5-3b,
    2851M params, 32M largest layer, 1 node x 8 GPUs, no offload:
    estimate_zero2_model_states_mem_needs_all_live -> 15.93GB per GPU (4 psi + 16 psi / N);
    estimate_zero3_model_states_mem_needs_all_live -> 6.10GB (cold estimate 6.09GB;
    4 x largest layer + 18 psi / N); GB there is 2**30 bytes.
    Differences from this engine, by design, added back: ZeRO-2 holds a full fp16
    gradient (2 psi) all live, this engine reduce-scatters each unit in backward and
    holds only fp32 shards; ZeRO-3 keeps a 16-bit parameter shard (2 psi / N) and counts
    a gathered largest layer with its gradient (4 x largest) as model state, this
    engine gathers from the fp32 master (ranks sending messages: no 16-bit shard; ranks
    of one host sharing memory keep it) and counts gathered blocks as transients."""
    model_fn = lambda: _Wide(32128, 1024, 57344, 12)  # noqa: E731  (t5-3b's size and embedding)
    largest = 32128 * 1024
    states2, psi = _model_states(model_fn, 8, 2)
    assert abs(psi - 2851e6) < 0.001 * 2851e6
    zero2 = sum(states2[c] for c in ("params", "master", "grads", "optimizer")) + 2 * psi
    assert abs(zero2 / 2**30 - 15.93) <= 0.01 * 15.93, zero2 / 2**30
    for shared in (False, True):  # ranks of one host sharing memory keep the 16-bit shard themselves
        states3, _ = _model_states(model_fn, 8, 3, shared=shared)
        zero3 = sum(states3[c] for c in ("params", "master", "grads", "optimizer")) + 4 * largest
        zero3 += 0 if shared else 2 * psi / 8
        assert abs(zero3 / 2**30 - 6.09) <= 0.01 * 6.09, (shared, zero3 / 2**30)


def test_plan_is_plain_data_with_a_recommendation():
    cfg = tiny_config(data={"micro_batch_size": B}, memory={"budget_counts": "tensors"})  # the budget: tensor bytes
    x = batches(0, 0, 1, B=B)[0]
    full = mct.plan(lambda: GPT(cfg.model), gpt_loss, x, cfg, world_size=2, stages=(0, 3), policies=("none", "all"),
                    precisions=("fp32",))
    assert full.recommended is None and "no budget" in full.advice
    budget = sorted(r["peak"] for r in full.rows)[1]  # only the two smallest fit
    plan = mct.plan(lambda: GPT(cfg.model), gpt_loss, x, cfg, world_size=2, budget=budget, stages=(0, 3),
                    policies=("none", "all"), precisions=("fp32",))
    fitting = [r for r in plan.rows if r["peak"] <= budget]
    assert plan.recommended in fitting and plan.recommended["step_s"] == min(r["step_s"] for r in fitting)
    row = json.loads(json.dumps(plan.to_dict()))["rows"][0]  # plain data all the way down
    assert set(row["breakdown"]) == {"params", "master", "grads", "optimizer", "frozen", "activations", "offload",
                                     "other"}
    assert row["offload"] == "none" and row["offloaded"] == {"cpu": 0, "disk": 0}
    assert row["peak"] == sum(row["breakdown"].values()) and row["phase"] in row["phases"]


@pytest.mark.slow  # in make test, not make test-fast
def test_mct_plan_plans_a_hugging_face_model_by_module_convention(capsys):
    """A Hugging Face GPT-2 by `--model module:factory`; a budget nothing fits: the table
    (JSON) is printed, then one line on stderr and exit 2."""
    assert main(["plan", "--model", "tests.planner_models:hf_gpt2", "--world-size", "2", "--json",
                 "--set", f"data.micro_batch_size={B}", "--budget", "100KB", "--stages", "0,3",
                 "--policies", "none,all"]) == 2
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["n_params"] == sum(p.numel() for p in hf_gpt2().parameters())
    assert [(r["stage"], r["policy"], r["precision"]) for r in out["rows"]] == [
        (s, p, q) for q in ("fp32", "bf16") for p in ("none", "all") for s in (0, 3)]
    assert all(r["peak"] > 0 and not r["fits"] for r in out["rows"])
    assert out["recommended"] is None
    err = captured.err.strip()
    assert err.count("\n") == 0 and "nothing fits" in err and "misses by" in err


def test_bad_model_path_or_grid_is_a_one_line_error(capsys):
    for args, word in ((["--model", "tests.planner_models:nothing_here"], "nothing_here"),
                       (["--stages", "0,4"], "'4'"), (["--policies", "some"], "'some'")):
        assert main(["plan", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and word in err, err


def test_auto_without_budget_is_a_clear_value_error():
    cfg = tiny_config(zero={"stage": "auto"})
    with pytest.raises(ValueError, match="memory.budget"):
        resolve_auto(cfg, 1, planning_workload(cfg))


def test_engine_given_auto_points_to_the_planner():
    cfg = tiny_config(checkpointing={"policy": "auto"}, memory={"budget": "1GiB"})
    with pytest.raises(ValueError, match="resolve_auto"):
        Engine(GPT(cfg.model), adamw, cfg)


def _write_corpus(tmp_path) -> str:
    text = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(3000))
    for i in range(4):
        (tmp_path / f"file{i}.py").write_text(text[i::4] * 2)
    return str(tmp_path)


@pytest.mark.slow
def test_auto_picks_a_fitting_configuration_and_trains_under_enforce(tmp_path):
    from mct.run.trainer import train
    (tmp_path / "data").mkdir()
    base = {"model": dict(TINY_MODEL), "data": {"path": _write_corpus(tmp_path / "data"), "micro_batch_size": 4},
            "train": {"steps": 3, "eval_every": 0, "warmup_steps": 1, "log_every": 1}}
    default = EngineConfig.from_dict(base)
    work = planning_workload(default)
    default_peak = dry_run(work.model_fn, work.loss_fn, work.batch, default, 1, optimizer=work.optimizer,
                           param_groups=work.param_groups).peak
    budget = int(default_peak * 0.8)  # the default run does not fit
    cfg = EngineConfig.from_dict({**base, "zero": {"stage": "auto"}, "checkpointing": {"policy": "auto"},
                                  "memory": {"budget": str(budget), "enforce": True, "budget_counts": "tensors"}})
    summary = train(cfg, tmp_path / "run", progress=False)
    assert summary.steps == 3
    meta = json.loads((tmp_path / "run" / "metadata.json").read_text())
    choice = meta["plan"]
    assert choice["predicted_peak_bytes"] <= budget
    assert (choice["zero.stage"], choice["checkpointing.policy"]) != (0, "none")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["predicted_peak_bytes"] == choice["predicted_peak_bytes"] for r in rows)
    assert max(r["peak_bytes"] for r in rows) <= budget


@pytest.mark.slow
def test_impossible_budget_fails_in_one_line_with_exit_2(capsys):
    tiny = [f"model.{k}={v}" for k, v in TINY_MODEL.items()]
    args = [a for kv in tiny for a in ("--set", kv)] + ["--set", "data.micro_batch_size=4"]
    assert main(["train", *args, "--set", "zero.stage=auto", "--set", "checkpointing.policy=all",
                 "--set", "memory.budget=20KB", "--set", "memory.budget_counts=tensors"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("mct: error: nothing fits") and "misses by" in err


def test_budget_exceeded_in_the_optimizer_step_modifies_nothing():
    """The first step's Adam state does not fit, forward and backward do: the step must
    fail before any master, parameter or optimizer state changes, and succeed later."""
    probe = tiny_config(checkpointing={"policy": "all"}, data={"micro_batch_size": 4})
    torch.manual_seed(0)
    m = GPT(probe.model)
    peaks = Engine(m, adamw, probe, param_groups=optimizer_groups(m, 0.1)).train_step(
        batches(0, 0, 1, B=4), gpt_loss).metrics["peaks"]
    budget = (max(peaks["forward"]["total"], peaks["backward"]["total"]) + peaks["optimizer"]["total"]) // 2
    assert peaks["optimizer"]["total"] > budget
    cfg = tiny_config(checkpointing={"policy": "all"}, data={"micro_batch_size": 4},
                      memory={"budget": str(budget), "enforce": True, "budget_counts": "tensors"})
    torch.manual_seed(0)
    model = GPT(cfg.model)
    engine = Engine(model, adamw, cfg, param_groups=optimizer_groups(model, 0.1))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(MemoryBudgetExceeded) as info:
        engine.train_step(batches(0, 0, 1, B=4), gpt_loss)
    assert info.value.phase == "optimizer" and "mct plan" in str(info.value)
    assert not engine.optimizer.state, "the optimizer's lazy state was created"
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    engine.tracker.budget_bytes = None
    assert not engine.train_step(batches(0, 0, 1, B=4), gpt_loss).skipped
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_stage_peak_records_growth_below_an_earlier_global_peak():
    tracker = MemoryTracker("cpu")
    with tracker.phase("big"):
        x = torch.zeros(1000)
        del x
    with tracker.phase("small"):
        y = torch.zeros(100)
    assert tracker.peaks()["small"]["total"] == y.untyped_storage().nbytes()


# ---- depth extrapolation ----

def _gpt_work(n_layer: int, d_model: int = 16):
    from mct.task import gpt_task
    cfg = EngineConfig.from_dict({"model": {"n_layer": n_layer, "d_model": d_model, "n_head": 2, "vocab_size": 101,
                                            "seq_len": 13}, "data": {"micro_batch_size": B}})
    return gpt_task(cfg), cfg


def _llama_work():
    from mct.task import Task
    from tests.planner_models import hf_llama
    return Task(model_fn=hf_llama, loss_fn=token_loss, batch=random_batch(0, 0, B)), tiny_config()


# (model, stage, policy, precision, world): stage 1 on 3 ranks is the case where the
# backward's peak moves from its start (activations) to its end (the reduction of every
# gradient) as depth grows; sqrt plans its segments from the depth.
EXTRAPOLATED = [("llama", 1, "all", "bf16", 3), ("llama", 3, "selective", "bf16", 2),
                ("gpt21", 3, "sqrt", "bf16", 2)]


@pytest.mark.slow  # three full dry runs of deep models: in make test, not make test-fast
@pytest.mark.parametrize("name, stage, policy, precision, world", EXTRAPOLATED)
def test_depth_extrapolation_equals_the_full_dry_run_to_the_byte(name, stage, policy, precision, world):
    """Two shallow copies, extended per window, against the dry run of the whole model:
    the steady-state step, the first step, initialization and each phase, equal."""
    from mct.planner.depth import extrapolated, shape_for
    from mct.planner.plan import with_choice
    from mct.planner.depth import Prepared
    from mct.planner.dry_run import DryRunHooks
    from mct.planner.grid import micro_batches, prepare_work
    from mct.task import builds_on_meta
    work, base = _llama_work() if name == "llama" else _gpt_work(21)
    cfg = with_choice(base, stage, policy, precision)
    planned = prepare_work(work, cfg)
    assert isinstance(planned, Prepared) and planned.stack is not None, name
    batch, meta_init = micro_batches(work.batch, cfg.data.grad_accum), builds_on_meta(cfg)
    ext = extrapolated(planned, cfg, world, batch, meta_init=meta_init,
                       shape=shape_for(planned.stack, cfg, cheaper_only=False))  # sqrt of 21: not cheaper
    full = dry_run(work.model_fn, work.loss_fn, batch, cfg, world, optimizer=work.optimizer,
                   param_groups=work.param_groups, hooks=DryRunHooks(meta_init=meta_init))
    assert ext is not None, (name, stage, policy)
    assert (ext.peak, ext.phase, ext.first_step_peak, ext.init_peak, ext.n_params) == \
        (full.peak, full.phase, full.first_step_peak, full.init_peak, full.n_params), (name, stage, policy)
    assert ext.phases == full.phases and ext.first_step_phases == full.first_step_phases, (name, stage, policy)
    # what the process model adds: a rollback snapshot's host bytes, a forward's churn
    assert ext.snapshot == full.snapshot and ext.churn["forward"] == full.churn["forward"] > 0, (name, stage, policy)


def test_dry_run_keeps_its_meta_init_keyword():
    """``dry_run(..., meta_init=True)`` (the spelling docs/planner.md gave before
    ``DryRunHooks``) still builds on meta: the same bytes as the hooks form, and a
    lower initialization peak than building the model whole."""
    from mct.planner.dry_run import DryRunHooks
    work, cfg = _gpt_work(2)
    cfg = EngineConfig.from_dict({**cfg.to_dict(), "zero": {"stage": 3}})
    args = (work.model_fn, work.loss_fn, work.batch, cfg, 2)
    old, new, whole = (dry_run(*args, meta_init=True), dry_run(*args, hooks=DryRunHooks(meta_init=True)),
                       dry_run(*args))
    assert (old.peak, old.init_peak, old.phases) == (new.peak, new.init_peak, new.phases)
    assert old.init_peak < whole.init_peak


def test_models_without_a_clean_repeated_stack_get_full_dry_runs():
    """A block run twice per forward, too few blocks, blocks of different shapes: the
    planner does not extrapolate them (prepare leaves the task as it is)."""
    from mct.planner.grid import prepare_work
    from mct.task import Task

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(101, 8)
            self.blocks = nn.ModuleList(nn.Linear(8, 8, bias=i != 2) for i in range(5))

        def forward(self, x):
            h = self.embed(x)
            for b in self.blocks:
                h = b(h)
            return h
    cfg = tiny_config()
    for model_fn in (tied_frozen_reused, lambda: _Wide(8, 4, 8, 2), Mixed):
        work = Task(model_fn=model_fn, loss_fn=lambda m, b: m(b[0]).float().mean(), batch=random_batch(0, 0, B))
        assert prepare_work(work, cfg) is work, model_fn
    gpt, gcfg = _gpt_work(4)
    assert prepare_work(gpt, gcfg) is not gpt  # the control: a clean stack is extrapolated


def _measure_built_on_meta(rank: int, world: int, cfg: EngineConfig) -> int:
    """Peak live storage of what `mct train` does before its first step at stage 3:
    the GPT recorded on meta, then the engine materializing it a unit at a time."""
    from mct.task.init_program import record_init
    from mct.task.gpt import make_optimizer, param_groups
    from tests.storage_count import LiveStorage
    torch.manual_seed(0)
    counter = LiveStorage()
    with counter:
        model, program = record_init(lambda: GPT(cfg.model))
        engine = Engine(model, make_optimizer(cfg), cfg, param_groups=param_groups(model, cfg), init_program=program)
    engine.close()
    return counter.peak


@pytest.mark.multirank
def test_stage3_init_peak_is_what_mct_train_builds_on_meta():
    """At stage 3 `mct train` never holds the whole model: the plan's init peak is the
    real meta-device construction's (within 2%), far below the whole fp32 model."""
    from mct.planner.plan import predict
    from mct.task import gpt_task
    cfg = tiny_config(zero={"stage": 3}, precision={"mode": "bf16"}, model={"n_layer": 4, "d_model": 48},
                      data={"micro_batch_size": B})
    measured = run_distributed(_measure_built_on_meta, 2, cfg)[0]
    work = gpt_task(cfg)
    predicted = predict(work, cfg, 2).init_peak
    assert abs(predicted - measured) <= 0.02 * measured, (predicted, measured)
    whole = dry_run(work.model_fn, work.loss_fn, work.batch, cfg, 2, optimizer=work.optimizer,
                    param_groups=work.param_groups).init_peak  # the model built whole first
    model_bytes = sum(p.numel() * 4 for p in {id(p): p for p in GPT(cfg.model).parameters()}.values())
    # each rank keeps its fp32 master shard and (ranks sharing memory) its bf16 cast: (4 + 2) / 2
    # = 3 bytes a parameter, 0.75 of the fp32 model's 4; never the model whole
    assert whole >= model_bytes and predicted <= 0.76 * model_bytes, (whole, predicted, model_bytes)


def _measure_bucketed(rank: int, world: int, cfgs: list) -> list[dict]:
    return [measure(tied_frozen_reused, token_loss, lambda s, r: random_batch(s, r, B), c, rank, steps=3)
            for c in cfgs]


@pytest.mark.multirank
def test_collectives_split_into_many_buckets_are_predicted_as_measured(monkeypatch):
    """A dry run allocates a many-bucket collective's temporaries as one tensor of their
    total size (mct.zero.comm): the same DryRun, to the byte, as allocating them bucket by
    bucket the way the real run does; and against a real 2-rank run with buckets of a few
    hundred bytes (dozens per collective), within 5% of the real engine tracker's peaks
    (an independent count of storages also sees gloo's own copies, made on its thread for
    a varying time; docs/planner.md)."""
    from mct.zero import comm
    cfgs = [tiny_config(zero={"stage": s, "bucket_mb": 0.0005}, checkpointing={"policy": p},
                        precision={"mode": "bf16"}) for s, p in ((1, "all"), (2, "none"), (3, "none"), (3, "all"))]
    for cfg in cfgs:  # 5 ranks: no shard or bucket divides evenly
        one = dry_run(tied_frozen_reused, token_loss, random_batch(0, 0, B), cfg, 5)
        monkeypatch.setattr(comm, "BUCKETS_AS_ONE", False)
        each = dry_run(tied_frozen_reused, token_loss, random_batch(0, 0, B), cfg, 5)
        monkeypatch.setattr(comm, "BUCKETS_AS_ONE", True)
        assert one == each, (cfg.zero.stage, cfg.checkpointing.policy)
    got = run_distributed(_measure_bucketed, 2, cfgs[1:3])[0]
    for cfg, real in zip(cfgs[1:3], got):
        run = dry_run(tied_frozen_reused, token_loss, random_batch(0, 0, B), cfg, 2)
        # 5%: at stage 3 with buckets this small the real run's tracker itself varies from
        # run to run (1.2-2.4% above the prediction seen), with the order in which gloo
        # completes and releases the async collectives
        for name, pred, meas in (("steady", run.peak, min(real["tracker"][1:])),
                                 ("first step", run.first_step_peak, real["tracker"][0]),
                                 ("init", run.init_peak, real["init"])):
            assert abs(pred - meas) <= 0.05 * meas, (cfg.zero.stage, name, pred, meas)


def _wide_vocab_llama() -> nn.Module:
    """Untied embedding and head of 8192 x 32 each: the root unit is 8x a block."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging
    logging.set_verbosity_error()
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                        intermediate_size=44, vocab_size=8192, max_position_embeddings=16,
                                        use_cache=False, attn_implementation="sdpa", tie_word_embeddings=False))


@pytest.mark.slow
def test_root_unit_holds_its_gradients_and_two_buckets_not_a_flat_fp32_copy(monkeypatch):
    """Stage 3, bf16, 4 ranks, 10 KiB buckets: the root unit (untied embedding and head,
    2 MiB as a flat fp32 gradient, ~200 buckets) keeps its parameters' bf16 gradients as
    they arrive and reduce-scatters them at the end of backward with at most
    IN_FLIGHT_BUCKETS buckets' copies alive (mct.zero.flat.HeldGrads, mct.zero.comm). It
    used to hold the flat fp32 gradient from the head's gradient on (the whole backward)
    and copies of all of it at the end: 'grads' and 'other' of the backward peak were
    1.0x and 1.25x of it. The dry run's one-tensor shortcut still equals allocating
    bucket by bucket, to the byte."""
    from mct.zero import comm
    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, 8192, (1, 16), generator=g), torch.randint(0, 8192, (1, 16), generator=g))
    # native bf16 matmuls on any CPU (a dry run computes nothing): on one without native bf16,
    # auto's fp32 kernels put the peak at the head's upcast temporaries, which are not under test
    cfg = tiny_config(zero={"stage": 3, "bucket_mb": 0.01}, checkpointing={"policy": "all"},
                      precision={"mode": "bf16", "cpu_matmul": "native"})
    root_fp32 = 4 * (2 * 8192 * 32 + 32)
    run = dry_run(_wide_vocab_llama, token_loss, batch, cfg, 4)
    monkeypatch.setattr(comm, "BUCKETS_AS_ONE", False)
    assert dry_run(_wide_vocab_llama, token_loss, batch, cfg, 4) == run
    peak = run.phases["backward"]
    # held: the bf16 gradients (0.5x); other: this rank's fp32 shard (0.25x) + two buckets
    assert peak["grads"] < 0.6 * root_fp32 and peak["other"] < 0.3 * root_fp32, (peak, root_fp32)


@pytest.mark.slow  # in make test, not make test-fast
def test_grid_in_worker_processes_equals_the_grid_in_one_process(monkeypatch):
    """mct.planner.pool: the same rows from forked workers as from this process, and a
    worker's ValueError raised here with its message."""
    import os

    from mct.planner import Grid, make_plan, pool
    monkeypatch.setattr(pool, "MIN_PARALLEL_S", 0.0)  # tiny models: fork anyway
    work, cfg = _gpt_work(5)
    grid = Grid(stages=(1, 3), policies=("none", "all"), precisions=("bf16",))
    one = make_plan(work, cfg, 3, None, grid, advise=False, workers=1)
    two = make_plan(work, cfg, 3, None, grid, advise=False, workers=2)
    assert one.rows == two.rows and len(two.rows) == 4
    pids = pool.run_jobs(lambda i: os.getpid(), 4, workers=2)
    assert pids[0] == os.getpid() and set(pids[1:]) - {os.getpid()}

    def job(i: int) -> int:
        if i == 2:
            raise ValueError("row 2 is wrong: fix it")
        return i
    with pytest.raises(ValueError, match="row 2 is wrong: fix it"):
        pool.run_jobs(job, 4, workers=2)
    with pytest.raises(ValueError, match=r"workers \(mct plan --workers\) must be an integer >= 1"):
        mct.plan(work.model_fn, work.loss_fn, work.batch, cfg, workers=0)


def test_hugging_face_llama_is_planned_as_its_real_run_holds():
    """On fake tensors transformers cannot see that the position ids it makes itself pack
    no sequences, and would build an explicit causal mask a real run never holds (3-5%
    over the measured peak before the token loss told it): within 2% of the real run."""
    from mct.planner.plan import predict
    from mct.planner.grid import prepare_work
    from mct.task import Task
    from tests.planner_models import hf_llama
    cfg = _cfg(0, "none", "fp32")
    real = measure(hf_llama, token_loss, lambda s, r: random_batch(s, r, B), cfg, 0, steps=3)
    run = predict(prepare_work(Task(model_fn=hf_llama, loss_fn=token_loss, batch=random_batch(0, 0, B)), cfg), cfg, 1)
    for name, pred, meas in (("steady", run.peak, min(real["steps"][1:])),
                             ("first step", run.first_step_peak, real["steps"][0])):
        assert abs(pred - meas) <= 0.02 * meas, (name, pred, meas)


def test_a_grid_of_one_other_precision_recommends_in_it():
    """`mct plan --precisions bf16` with the config's fp32: the bf16 rows are what was asked."""
    from mct.planner import Grid, make_plan
    work, cfg = _gpt_work(2)
    assert cfg.precision.mode == "fp32"
    plan = make_plan(work, cfg, 2, 2**40, Grid(stages=(3,), policies=("all",), precisions=("bf16",)))
    assert plan.precision == "bf16" and plan.recommended is not None and plan.recommended["precision"] == "bf16"
    assert "precision.mode=bf16" in plan.advice


def test_a_planner_worker_that_dies_is_an_error_not_a_hang(monkeypatch):
    """A worker killed mid-plan (the OOM killer, a signal) ends the plan with one line."""
    import os
    import signal

    from mct.planner import pool
    monkeypatch.setattr(pool, "MIN_PARALLEL_S", 0.0)

    def job(i: int) -> int:
        if i == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return i
    with pytest.raises(pool.WorkerDied, match="planner worker process died.*--workers 1"):
        pool.run_jobs(job, 4, workers=2)


def test_an_interrupted_plan_stops_its_workers_without_finishing_the_queue(monkeypatch):
    """Ctrl-C during a forked grid: KeyboardInterrupt at once, the workers ended, the
    queued dry runs not waited for."""
    import multiprocessing
    import os
    import signal
    import threading
    import time

    from mct.planner import pool
    monkeypatch.setattr(pool, "MIN_PARALLEL_S", 0.0)

    def job(i: int) -> int:
        if i:
            time.sleep(30)
        return i
    timer = threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT))
    t0 = time.monotonic()
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        pool.run_jobs(job, 6, workers=2)
    assert time.monotonic() - t0 < 15
    assert not multiprocessing.active_children()


def test_task_and_grid_form_plans_exactly_as_the_keyword_form():
    """`mct.planner.plan_task(task, config, world, budget, Grid(...))` and `predict_task`
    give the rows and peak of `mct.plan(model_fn, loss_fn, batch, ...)` / `mct.predict_peak`."""
    from mct.planner import Grid, plan_task, predict_task
    work, cfg = _gpt_work(2)
    old = mct.plan(work.model_fn, work.loss_fn, work.batch, cfg, world_size=2, budget="1GiB",
                   optimizer=work.optimizer, param_groups=work.param_groups, stages=(0, 3), policies=("none",),
                   precisions=("bf16",), workers=1)
    new = plan_task(work, cfg, 2, "1GiB", Grid(stages=(0, 3), policies=("none",), precisions=("bf16",)), workers=1)
    assert new.rows == old.rows and new.recommended == old.recommended and new.advice == old.advice
    assert len(new.rows) == 2
    assert predict_task(work, cfg, 2) == mct.predict_peak(work.model_fn, work.loss_fn, work.batch, cfg, world_size=2,
                                                          optimizer=work.optimizer, param_groups=work.param_groups)


def test_a_cuda_plan_dry_runs_native_matmuls_whatever_this_cpu_has():
    """``precision.cpu_matmul`` is for CPU devices: a bf16 run whose CPU matmuls take fp32
    kernels (forced here with 'fp32', as 'auto' does on a CPU without native bf16) holds
    their fp32 copies, and its CPU plan counts them; a CUDA run never takes them, so its
    plan (and ``auto``'s solve) is the native one's, whatever CPU plans it."""
    from mct.planner import Grid, make_plan
    from mct.planner.plan import for_device
    from mct.task.spec import Task
    grid = Grid((3,), ("all",), ("bf16",))  # the peak at the head's backward: the wide vocabulary's matmuls
    upcast = tiny_config(zero={"bucket_mb": 0.01}, precision={"mode": "bf16", "cpu_matmul": "fp32"})
    native = tiny_config(zero={"bucket_mb": 0.01}, precision={"mode": "bf16", "cpu_matmul": "native"})
    g = torch.Generator().manual_seed(0)
    task = Task(_wide_vocab_llama, token_loss, (torch.randint(0, 8192, (1, 16), generator=g),
                                                torch.randint(0, 8192, (1, 16), generator=g)))

    def peak(cfg, device):
        return make_plan(task, cfg, 4, None, grid, device=device, measure=False, advise=False).rows[0]["peak"]
    assert peak(upcast, "cpu") > peak(native, "cpu")  # the fp32 copies of the matmuls' operands
    # a CUDA plan's ranks are NCCL ranks: no shared-memory gathers of gloo ranks on one host
    assert peak(upcast, "cuda") == peak(native, "cuda") < peak(native, "cpu")
    assert for_device(upcast, "cpu") is upcast and for_device(upcast, "cuda").precision.cpu_matmul == "native"
    from mct.planner.plan import planned_device
    nccl = tiny_config(distributed={"backend": "nccl"})
    assert planned_device(nccl) == "cuda" and planned_device(upcast) == "cpu"  # what `mct plan` plans for


def test_construction_peak_at_depth_is_the_larger_of_a_build_moment_and_what_the_engine_keeps():
    """``mct.planner.depth._extend_init``: a shallow copy's construction may peak while a
    unit is built (a depth-independent moment) and a deeper one at the end, where what
    the engine keeps (``DryRun.init_end``: shards, shared-memory casts) grows with the
    depth. Each is extrapolated from the copies where they agree; never a line through two
    different moments (which could fall below zero)."""
    from mct.planner.depth import Copy, _extend_init
    from mct.planner.dry_run import DryRun

    def run(peak: int, end: int) -> DryRun:
        cats = lambda total: {"params": total, "total": total}  # noqa: E731
        return DryRun(peak=0, phase="forward", phases={}, first_step_peak=0, first_step_phases={},
                      init_peak=peak, init=cats(peak), n_params=0, offloaded={}, init_end=cats(end))

    def ext_of(copies):
        return lambda x, get, key: x + sum(c.m * (get(c.run).get(key, 0) - x) for c in copies)

    def at_depth(a: DryRun, b: DryRun, m: int = 10) -> int | None:
        copies = [Copy(b, None, m, lambda k: [k])]  # type: ignore[arg-type]
        got = _extend_init(a, copies, ext_of(copies))
        return None if got is None else got["total"]
    # (construction peak, kept at the end) of a smaller copy and a larger one, m = 10 more periods
    assert at_depth(run(100, 50), run(100, 54)) == 100  # both early; the end (90) stays below the build peak
    assert at_depth(run(100, 70), run(100, 90)) == 70 + 10 * 20  # both early; at the full depth the end is above
    assert at_depth(run(100, 70), run(110, 110)) == 70 + 10 * 40  # early, then the end: the end's line
    assert at_depth(run(120, 120), run(140, 140)) == 120 + 10 * 20  # both at the end
    assert at_depth(run(100, 100), run(120, 90)) is None  # the end first, then an earlier moment: no line
