"""fp32 masters start as the model's exact fp32 values, whatever the init path: resident,
meta-device init, offloaded to cpu or disk, every ZeRO stage, bf16 and fp16 (a master
cloned from the low-precision working buffer would start the optimizer from rounded
weights); the working parameters are the cast of those values."""

from __future__ import annotations

import pytest
import torch

from mct.engine import Engine
from mct.models.gpt import GPT
from mct.offload import record_init
from tests.distributed import run_distributed
from tests.helpers import adamw, tiny_config


def _build(stage: int, mode: str, offload: dict, meta: bool, tmp: str) -> tuple[dict, Engine]:
    """(the fp32 init of a normal construction, the engine built from the same seed)."""
    sections = {"zero": {"stage": stage, "persistent_numel": 0}, "precision": {"mode": mode}}
    if offload:
        sections["offload"] = {"dir": tmp, "chunk_mb": 0.002, **offload}
    cfg = tiny_config(**sections)
    torch.manual_seed(0)
    init = {n: p.detach().clone() for n, p in GPT(cfg.model).named_parameters()}
    torch.manual_seed(0)
    model, program = record_init(lambda: GPT(cfg.model)) if meta else (GPT(cfg.model), None)
    return init, Engine(model, adamw, cfg, init_program=program)


def _mismatches(init: dict, engine: Engine) -> list[str]:
    """Names whose master is not bit-identical to the fp32 init, or whose resident
    working parameter is not its cast (collective: every rank calls it)."""
    masters = engine.full_state_dict()
    bad = [n for n, v in init.items() if masters[n].dtype != torch.float32 or not torch.equal(masters[n], v)]
    low = engine.precision.param_dtype
    for u in engine.sharded.units:
        if u.persistent:
            bad += [f"{n} (working)" for n, p in zip(u.names, u.params) if not torch.equal(p, init[n].to(low))]
    return bad


CASES = [(stage, mode, {}, False) for stage in (0, 1, 2, 3) for mode in ("bf16", "fp16", "fp32")] + [
    (0, "bf16", {}, True), (3, "fp16", {}, True),
    (0, "bf16", {"optimizer": "cpu"}, False), (2, "fp16", {"optimizer": "disk"}, False),
    (3, "bf16", {"optimizer": "disk", "params": "disk"}, True),
    (3, "bf16", {"optimizer": "cpu", "params": "cpu"}, False)]


@pytest.mark.parametrize("stage,mode,offload,meta", CASES)
def test_masters_are_the_exact_fp32_init(stage, mode, offload, meta, tmp_path):
    init, engine = _build(stage, mode, offload, meta, str(tmp_path))
    try:
        assert _mismatches(init, engine) == []
    finally:
        engine.close()


def _two_ranks(rank: int, world: int, tmp: str) -> dict:
    out = {}
    for stage, mode, offload, meta in ((3, "bf16", {}, False), (3, "fp16", {}, True), (1, "bf16", {}, False),
                                       (3, "bf16", {"optimizer": "disk", "params": "disk"}, True)):
        init, engine = _build(stage, mode, offload, meta, f"{tmp}/{stage}{mode}")
        out[(stage, mode, bool(offload), meta)] = _mismatches(init, engine)
        engine.close()
    return out


@pytest.mark.multirank
def test_masters_are_the_exact_fp32_init_on_two_ranks(tmp_path):
    for rank_result in run_distributed(_two_ranks, 2, str(tmp_path), timeout=300):
        assert rank_result and all(bad == [] for bad in rank_result.values()), rank_result
