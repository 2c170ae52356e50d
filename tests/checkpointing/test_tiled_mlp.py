"""Token-tiled MLP (``checkpointing.mlp_tile_tokens``): the untiled loss and gradients to
1e-6 relative in fp32 (HF Llama, the built-in GPT; ZeRO stages 0 and 3, with checkpointing,
activation offload and gradient accumulation), every weight's gradient arriving at its
ZeRO unit once complete (never reduced early or twice), the dry run equal to a real
tracked run, the [tokens, intermediate] tensors gone from the backward peak, and one-line
errors for models with no MLP to tile."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from mct.planner import dry_run
from mct.checkpointing import apply_checkpointing
from mct.config import CheckpointingConfig, EngineConfig
from mct.engine import Engine
from mct.models.gpt import GPT, gpt_loss
from mct.task.tokens import causal_lm_loss
from tests.distributed import run_distributed
from tests.helpers import TINY_MODEL, batches

V, C, T = 256, 32, 16


def _llama(layers: int = 2) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging
    logging.set_verbosity_error()
    return LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=C, intermediate_size=88, num_hidden_layers=layers,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=False, use_cache=False))


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return GPT(EngineConfig.from_dict({"model": TINY_MODEL}).model) if kind == "gpt" else _llama()


def _one_step(kind: str, rank: int, tile: int, stage: int = 0, policy: str = "none", mode: str = "fp32",
              act_offload: str = "none", n_micro: int = 1, tmp: str = "") -> tuple[float, dict[str, torch.Tensor]]:
    """(loss, gradient) of one step: SGD with lr 1, so old - new parameters = gradient."""
    cfg = EngineConfig.from_dict({"zero": {"stage": stage}, "precision": {"mode": mode},
                                  "checkpointing": {"policy": policy, "mlp_tile_tokens": tile,
                                                    "offload": act_offload},
                                  "offload": {"dir": tmp} if tmp else {}})
    engine = Engine(_model(kind), lambda g: torch.optim.SGD(g, lr=1.0), cfg)
    before = engine.full_state_dict()
    out = engine.train_step(batches(0, rank, n_micro=n_micro, B=2, T=T), gpt_loss if kind == "gpt" else causal_lm_loss)
    if tile:
        assert out.metrics["mlp_tiled_modules"] == 2 and out.metrics["mlp_tiles"] > 2 * n_micro * 2
    after = engine.full_state_dict()
    engine.close()
    return out.loss, {k: before[k] - after[k] for k in before}


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||b|| over the whole gradient."""
    diff = sum(float((a[k].double() - b[k].double()).square().sum()) for k in b)
    return (diff / sum(float(b[k].double().square().sum()) for k in b)) ** 0.5


def _tiled_vs_untiled(rank: int, world: int, cases: list[tuple], tmp: str = "") -> list:
    rows = []
    for kind, stage, policy, act, n_micro in cases:
        ref_loss, ref = _one_step(kind, rank, 0, stage, policy, n_micro=n_micro)
        # 32 tokens per micro-batch: tiles of 7 tokens, the last one short
        loss, grad = _one_step(kind, rank, 7, stage, policy, act_offload=act, n_micro=n_micro, tmp=tmp)
        rows.append((kind, stage, policy, act, n_micro, abs(loss - ref_loss) / ref_loss, _rel(grad, ref)))
    return rows


CASES = [(kind, stage, policy, "none", 1) for kind in ("gpt", "llama") for stage in (0, 3) for policy in ("none", "all")]


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_tiled_mlp_equals_untiled_fp32_one_rank(kind):
    pytest.importorskip("transformers")
    cases = [c for c in CASES if c[0] == kind] + [(kind, 2, "selective", "none", 2), (kind, 1, "sqrt", "none", 1)]
    for row in _tiled_vs_untiled(0, 1, cases):
        assert row[-2] <= 1e-6 and row[-1] <= 1e-6, row


@pytest.mark.multirank
def test_tiled_mlp_equals_untiled_fp32_stages_0_and_3_two_ranks(tmp_path):
    """Stage 3 gathers the blocks and reduce-scatters each one's gradient as soon as it is
    complete: with tiles, the MLP's weights get a part per tile and the unit is reduced
    once, after the last (an early reduce would lose the later tiles: a large error)."""
    pytest.importorskip("transformers")
    cases = CASES + [("gpt", 3, "all", "disk", 1), ("llama", 3, "all", "disk", 2)]
    for row in run_distributed(_tiled_vs_untiled, 2, cases, str(tmp_path), timeout=900)[0]:
        assert row[-2] <= 1e-6 and row[-1] <= 1e-6, row


def test_tiled_mlp_in_bf16_tracks_untiled():
    pytest.importorskip("transformers")
    ref_loss, ref = _one_step("llama", 0, 0, 3, "all", mode="bf16")
    loss, grad = _one_step("llama", 0, 7, 3, "all", mode="bf16")
    assert abs(loss - ref_loss) <= 1e-2 * ref_loss and _rel(grad, ref) <= 2e-2, (loss, ref_loss, _rel(grad, ref))


def test_partial_tile_gradients_are_counted_once_per_parameter():
    """Each tile fires the weights' post-accumulate-grad hooks; the engine adds every part
    and counts only the last, so a stage-3 unit is reduced exactly once per backward."""
    pytest.importorskip("transformers")
    cfg = EngineConfig.from_dict({"zero": {"stage": 3}, "checkpointing": {"policy": "all", "mlp_tile_tokens": 5}})
    engine = Engine(_model("llama"), lambda g: torch.optim.SGD(g, lr=1.0), cfg)
    reduced: list[str] = []
    for unit in engine.sharded.units:
        original = unit.reduce

        def counting(comm, async_op, _u=unit, _orig=original):
            reduced.append(_u.name)
            return _orig(comm, async_op)
        unit.reduce = counting
    engine.train_step(batches(0, 0, B=2, T=T)[0], causal_lm_loss)
    assert sorted(reduced) == sorted(u.name for u in engine.sharded.units), reduced
    assert all(u.grads_seen == u.n_trainable for u in engine.sharded.units)


@pytest.mark.slow
def test_dry_run_equals_the_real_tracked_run_and_the_intermediates_leave_the_backward_peak():
    """The planner runs the tiled MLP itself on fake tensors: its peak equals the engine's
    own tracker in a real run to the byte; tiles of 8 tokens (of 128) lower the backward
    peak by at least the MLP's [tokens, 4 d] intermediates of one block, and its
    activations further (forward keeps only the MLP's input)."""
    model_cfg = {**TINY_MODEL, "seq_len": 64, "n_layer": 3}
    peaks = {}
    for tile in (0, 8):
        cfg = EngineConfig.from_dict({"model": model_cfg, "zero": {"stage": 3},
                                      "checkpointing": {"policy": "none", "mlp_tile_tokens": tile}})
        batch = batches(0, 0, B=2, T=64)[0]
        pred = dry_run(lambda: GPT(cfg.model), gpt_loss, batch, cfg, 1)
        torch.manual_seed(0)
        engine = Engine(GPT(cfg.model), None, cfg)
        for _ in range(2):
            out = engine.train_step(batch, gpt_loss)
        real = max(v["total"] for k, v in out.metrics["peaks"].items() if k in ("forward", "backward", "optimizer"))
        assert pred.peak == real, (tile, pred.peak, real)
        peaks[tile] = pred
    inner = 2 * 64 * 4 * 32 * 4  # one block's MLP hidden [B*T, 4d] fp32
    drop = peaks[0].phases["backward"]["total"] - peaks[8].phases["backward"]["total"]
    assert drop >= inner, (drop, inner)
    assert peaks[8].phases["forward"]["activations"] < peaks[0].phases["forward"]["activations"] - 3 * inner


class _NoMlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class _ExtraArgs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_model_without_an_mlp_or_with_an_untileable_one_is_a_one_line_error():
    with pytest.raises(ValueError, match=r"mlp_tile_tokens = 4: no block .* named mlp / feed_forward / ffn"):
        apply_checkpointing(_NoMlp(), CheckpointingConfig(mlp_tile_tokens=4))
    with pytest.raises(ValueError, match=r"mlp_tile_tokens = -1 is not allowed"):
        CheckpointingConfig(mlp_tile_tokens=-1)
    model = _ExtraArgs()
    state = apply_checkpointing(model, CheckpointingConfig(policy="all", mlp_tile_tokens=3))
    with pytest.raises(ValueError, match=r"layers.0.mlp was called with \(tensor \(4,\)\)"):
        model(torch.randn(4, requires_grad=True))
    state.remove()
    assert "forward" not in model.layers[0].mlp.__dict__


@pytest.mark.parametrize("mode,stage", [("fp32", 3), ("bf16", 0)])
def test_mct_verify_passes_with_tiled_mlps(tmp_path, mode, stage):
    """The reference is the untiled model (copied before the engine tiles it)."""
    import random
    from mct.verify.compare import run_verify
    rnd = random.Random(0)
    (tmp_path / "c.txt").write_text("".join(rnd.choice("abcdefgh ijkl\n") for _ in range(50_000)))
    cfg = EngineConfig.from_dict({"model": dict(TINY_MODEL), "data": {"path": str(tmp_path / "c.txt"),
                                                                      "micro_batch_size": 2, "grad_accum": 2},
                                  "train": {"warmup_steps": 0}, "zero": {"stage": stage}, "precision": {"mode": mode},
                                  "checkpointing": {"policy": "all", "mlp_tile_tokens": 5}})
    report = run_verify(cfg, 3)
    assert report.passed and report.mlp_tiles == 2 * 2 * 7, report.table()  # 2 MLPs x 2 micro-batches x 7 tiles
    assert "MLPs in tiles of 5 tokens: 28 tile(s)" in report.table()


@pytest.mark.slow
def test_plan_has_mlp_tile_rows_and_auto_chooses_tiling_when_nothing_fits_without():
    from mct.planner import Grid, make_plan, resolve_auto
    from mct.task import gpt_task
    cfg = EngineConfig.from_dict({"model": {**TINY_MODEL, "seq_len": 64, "n_layer": 3}, "data": {"micro_batch_size": 4},
                                  "memory": {"budget_counts": "tensors"}})  # the budgets below: tensor bytes
    grid = Grid((0,), ("none",), ("fp32",), mlp_tiles=(0, 8))
    off, on = make_plan(gpt_task(cfg), cfg, 1, None, grid).rows
    assert (off["mlp_tile_tokens"], on["mlp_tile_tokens"]) == (0, 8) and on["peak"] < off["peak"]
    roomy = make_plan(gpt_task(cfg), cfg, 1, off["peak"], grid)
    assert roomy.recommended["mlp_tile_tokens"] == 0  # equal cost: the untiled row (no extra MLP forward)
    # zero.stage = 'auto', policy 'none': nothing fits without tiling, tiles of AUTO_MLP_TILE do
    from mct.planner.plan import AUTO_MLP_TILE
    stages = Grid((0, 1, 2, 3), ("none",), ("fp32",), mlp_tiles=(0, AUTO_MLP_TILE))
    rows = make_plan(gpt_task(cfg), cfg, 1, None, stages).rows
    budget = min(r["peak"] for r in rows if r["mlp_tile_tokens"])
    assert budget < min(r["peak"] for r in rows if not r["mlp_tile_tokens"])
    auto = EngineConfig.from_dict({**cfg.to_dict(), "zero": {"stage": "auto"}, "memory": {"budget": str(budget),
                                                                                    "budget_counts": "tensors"}})
    resolved, choice = resolve_auto(auto, 1, gpt_task(auto))
    assert resolved.checkpointing.mlp_tile_tokens == choice["checkpointing.mlp_tile_tokens"] == AUTO_MLP_TILE
    assert choice["predicted_peak_bytes"] <= budget


@pytest.mark.slow
def test_llama3_8b_plan_with_tiles_of_1024_tokens(tmp_path):
    """The issue's example (config.json only; window 8192, micro-batch 1, 8 ranks, bf16,
    stage 3, all, loss chunks of 1024): tiles of 1024 tokens take the MLP's recompute out
    of the backward peak, and the RMSNorms' fp32 backward temporaries (0.63 GiB) with it
    (the same tiles run the norms). What is left in 'other' (0.53 GiB) is ZeRO-3's
    prefetch of the previous layer (its all-gather's receive buffers, 0.41 GiB) and two
    [tokens, hidden] bf16 gradients: docs/planner.md."""
    import json

    from mct.planner import Grid, make_plan
    from mct.task import task_for
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "hidden_act": "silu",
        "tie_word_embeddings": False}))
    cfg = EngineConfig.from_dict({"model": {"source": f"hf:{tmp_path}", "seq_len": 8192},
                                  "data": {"micro_batch_size": 1}, "precision": {"mode": "bf16"},
                                  "train": {"loss_chunk_tokens": 1024}})
    # an 8-GPU run: its dry run takes native bf16 matmuls whatever CPU plans it (planner.plan.for_device)
    plan = make_plan(task_for(cfg), cfg, 8, None, Grid((3,), ("all",), ("bf16",), mlp_tiles=(0, 1024)), workers=1,
                     device="cuda", measure=False)
    off, on = plan.rows
    gib = 2**30
    mlp_hidden = 8192 * 14336 * 2  # one [tokens, intermediate] bf16 tensor
    assert off["peak"] - on["peak"] >= 3 * mlp_hidden, (off["peak"] / gib, on["peak"] / gib)
    assert on["breakdown"]["activations"] <= off["breakdown"]["activations"] - 3 * mlp_hidden
    assert on["breakdown"]["other"] <= 1 * gib, on["breakdown"]["other"] / gib


@pytest.mark.parametrize("policy", ["none", "all"])
def test_dropout_inside_the_mlp_is_replayed_tile_by_tile(policy):
    """Each tile's backward restores the RNG state its forward started from, so the masks
    are the forward's (a different mask would change the gradient by far more than 1e-6);
    on CPU the tiles even draw the untiled masks (the generator's stream is per element)."""
    grads = {}
    for tile in (0, 7):
        torch.manual_seed(0)
        cfg = EngineConfig.from_dict({"model": {**TINY_MODEL, "dropout": 0.1},
                                      "checkpointing": {"policy": policy, "mlp_tile_tokens": tile}})
        engine = Engine(GPT(cfg.model), lambda g: torch.optim.SGD(g, lr=1.0), cfg)
        before = engine.full_state_dict()
        torch.manual_seed(5)
        out = engine.train_step(batches(0, 0, B=2, T=T)[0], gpt_loss)
        grads[tile] = out.loss, {k: v - engine.full_state_dict()[k] for k, v in before.items()}
    assert grads[7][0] == grads[0][0] and _rel(grads[7][1], grads[0][1]) <= 1e-6
