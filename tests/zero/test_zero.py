"""ZeRO stages 0-3 (fp32, gloo on CPU) against the reference trainer and torch's FSDP2.

Metric. Parameters are compared per tensor as ||p - p_ref|| / ||p_ref|| after 10 steps
of grad accumulation 2 with clipping, and must agree within 1e-6 for SGD with momentum
at every stage and rank count. SGD's update is linear in the gradient, so a wrong
averaging factor (ranks, micro-batches, loss scale) shows at once.

AdamW is compared at 1e-6 against the reference that sums in the *same order* as the
stage does. Stages 0/1 keep the accumulated gradient and reduce once, as the reference
trainer does (rank-major). Stages 2/3 reduce-scatter after every backward, so they sum
over ranks first and then over micro-batches (micro-major): the same numbers, summed
in another order, differ in the last bits. Adam divides by sqrt(v): where the true
gradient is zero that rounding noise becomes a step of about the learning rate. The
attention key bias is such a parameter (softmax is invariant to adding the same
q.b to every key's score, so its gradient is exactly zero and it only ever sees
noise): measured at 2 ranks, stage 2, the key third of `qkv.bias` is 5.8e-4 apart
between the two orders, and the noise it injects moves `qkv.weight` by 7e-6, while
SGD stays within 2.4e-7 everywhere. Against the order-matched reference the engine
agrees exactly (0.0) at 2 ranks. With 4 ranks gloo's reduce-scatter sums in its own
order, which neither reference reproduces; there AdamW is held to the noise floor:
no worse than twice the distance between the two valid references, per tensor,
plus 1e-6. torch's FSDP2 (``fully_shard`` per block, then the root) trains the same
model on the same data; with SGD it lands within 1e-6 of both.
"""

from __future__ import annotations

import pytest
import torch

from mct.zero.partition import model_state_bytes
from tests.distributed import run_distributed
from tests.helpers import adamw, engine_run, max_rel_diff, reference_run, sgd_momentum, shared_work, tiny_config

STEPS = 10
N_MICRO = 2
OPTIMIZERS = {"adamw": adamw, "sgd": sgd_momentum}


def _cfg(stage: int, policy: str, **zero):
    return tiny_config(train={"grad_clip": 1.0}, zero={"stage": stage, **zero},
                       checkpointing={"policy": policy}, memory={"track": False})


def _references(rank: int, world: int) -> dict[tuple[str, str], dict[str, torch.Tensor]] | None:
    """(optimizer, order) -> reference state after STEPS steps (both orders), on rank 0."""
    cfg = _cfg(0, "none")
    return shared_work(rank, world, {
        (o, order): (lambda opt=opt, order=order: reference_run(cfg, world, STEPS, opt, N_MICRO, order=order)[1])
        for o, opt in OPTIMIZERS.items() for order in ("rank", "micro")})


def _stage3_facts(engine, out) -> dict:
    """What stage 3 must leave behind after a step: non-root units without storage."""
    held = [u.name for u in engine.sharded.units
            if not u.name.startswith("root/") and u.working.untyped_storage().nbytes() != 0]
    return {"held_after_step": held, "gathers": out.metrics["zero3_gathers"]}


def _memory_after_one_step(rank: int, world: int) -> dict:
    """(precision, stage) -> tracked live bytes by category after one AdamW step,
    the formula's bytes and the padding allowance (padded - unpadded elements)."""
    out = {}
    for mode in ("fp32", "bf16"):
        p_bytes, master_bytes = (4, 0) if mode == "fp32" else (2, 4)
        for stage in (0, 1, 2, 3):
            cfg = tiny_config(zero={"stage": stage}, precision={"mode": mode})
            _, _, engine, last = engine_run(cfg, rank, 1, adamw)
            live = engine.tracker.live()
            peaks = last.metrics["peaks"]
            after_step_grads = live["grads"]
            # stages 2/3 hold gradient shards only during a step: all of them exist at
            # the optimizer step, so measure gradients there
            live = {**live, "grads": peaks["optimizer"]["grads"]}
            n = sum(p.numel() for p in engine.model.parameters() if p.requires_grad)
            pad = sum(u.layout.padded_numel for u in engine.sharded.units) - n
            # gloo ranks of one host at stage 3, bf16: a shared cast of each master shard (mct.zero.shm)
            casts = any(u.published is not None for u in engine.sharded.units)
            assert casts == (mode == "bf16" and stage == 3 and engine.shared is not None)
            formula = model_state_bytes(n, world, stage, param_bytes=p_bytes, grad_bytes=4,
                                        master_bytes=master_bytes, optim_bytes_per_param=8, cast_shard=casts)
            per_elem = {"params": p_bytes, "master": master_bytes, "grads": 4, "optimizer": 8}
            out[(mode, stage)] = {"live": {k: live[k] for k in formula}, "formula": formula,
                                  "padding_bytes": {k: pad * per_elem[k] for k in formula},
                                  "reported": engine.model_state_bytes(),
                                  "grads_after_step": after_step_grads,
                                  "grads_in_forward": peaks["forward"].get("grads", 0)}
    return out


def _two_rank_checks(rank: int, world: int) -> tuple[dict, dict]:
    return _two_rank_matrix(rank, world), _memory_after_one_step(rank, world)


def _two_rank_matrix(rank: int, world: int) -> dict:
    refs = _references(rank, world)
    out: dict = {}
    for stage in (0, 1, 2, 3):
        for policy in ("none", "all"):
            for o, opt in OPTIMIZERS.items():
                _, state, engine, last = engine_run(_cfg(stage, policy), rank, STEPS, opt, N_MICRO)
                facts = _stage3_facts(engine, last) if stage == 3 else {}
                if stage == 3 and policy == "all" and o == "sgd":
                    _, no_prefetch, _, _ = engine_run(_cfg(3, "all", prefetch=False), rank, STEPS, opt, N_MICRO)
                    facts["prefetch_off_equal"] = all(torch.equal(state[k], no_prefetch[k]) for k in state)
                if refs is None:
                    continue
                order = "micro" if stage >= 2 else "rank"
                out[(stage, policy, o)] = {"rank_ref": max_rel_diff(state, refs[(o, "rank")]),
                                           "order_ref": max_rel_diff(state, refs[(o, order)]), **facts}
    return out


@pytest.fixture(scope="module")
def two_rank_results() -> tuple[dict, dict]:
    """One 2-rank spawn for the parity matrix and the memory measurements."""
    return run_distributed(_two_rank_checks, 2)[0]


@pytest.mark.multirank
def test_stages_0_to_3_match_reference_on_two_ranks_sgd_and_adamw(two_rank_results):
    results = two_rank_results[0]
    assert len(results) == 16
    for key, r in results.items():
        stage, policy, opt = key
        if opt == "sgd":
            assert r["rank_ref"][0] <= 1e-6, (key, r)
        assert r["order_ref"][0] <= 1e-6, (key, r)


@pytest.mark.multirank
def test_stage3_frees_block_storage_after_the_step_and_prefetch_changes_nothing(two_rank_results):
    results = two_rank_results[0]
    for policy in ("none", "all"):
        for opt in OPTIMIZERS:
            r = results[(3, policy, opt)]
            assert r["held_after_step"] == [], (policy, opt)
            assert r["gathers"] > 0
    assert results[(3, "all", "sgd")]["prefetch_off_equal"]


@pytest.mark.multirank
def test_model_state_bytes_per_rank_match_the_zero_formula(two_rank_results):
    """Tracked bytes (params/master/optimizer live after a step, gradients at the
    optimizer step's peak) and ``Engine.model_state_bytes()`` against Rajbhandari et
    al.'s per-stage formula, within 5% plus padding."""
    measured = two_rank_results[1]
    assert len(measured) == 8
    for (mode, stage), m in measured.items():
        for cat in ("params", "master", "grads", "optimizer"):
            want, slack = m["formula"][cat], 0.05 * m["formula"][cat] + m["padding_bytes"][cat]
            assert abs(m["live"][cat] - want) <= slack, (mode, stage, cat, m)
            assert abs(m["reported"][cat] - want) <= slack, (mode, stage, cat, m)


@pytest.mark.multirank
def test_stages_2_and_3_hold_no_gradients_in_forward_or_between_steps(two_rank_results):
    """Stages 2/3 create each gradient shard in backward and drop it after the
    optimizer step; stages 0/1 keep their gradient buffers."""
    for (mode, stage), m in two_rank_results[1].items():
        if stage >= 2:
            assert m["grads_after_step"] == 0 and m["grads_in_forward"] == 0, (mode, stage, m)
        else:
            assert m["grads_after_step"] == m["live"]["grads"] > 0, (mode, stage, m)


def _fsdp2_run(rank: int, world: int, optimizer) -> dict[str, torch.Tensor]:
    """The same model, data, grad accumulation and clipping under torch's fully_shard."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from mct.models.gpt import GPT, gpt_loss, optimizer_groups
    from tests.helpers import batches
    cfg = _cfg(3, "none")
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = optimizer(optimizer_groups(model, 0.1))
    for step in range(STEPS):
        for mb in batches(step, rank, N_MICRO):
            (gpt_loss(model, mb) / N_MICRO).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad()
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _four_rank_stage3(rank: int, world: int) -> dict:
    refs = _references(rank, world)
    fsdp = _fsdp2_run(rank, world, sgd_momentum)  # SGD: linear in the gradient, so scale bugs show
    out: dict = {}
    for o, opt in OPTIMIZERS.items():
        # checkpointing "none" runs at 2 ranks; recompute under stage 3 is the harder case
        _, state, engine, last = engine_run(_cfg(3, "all"), rank, STEPS, opt, N_MICRO)
        facts = _stage3_facts(engine, last)
        if refs is None:
            continue
        floor = {k: max_rel_diff({k: refs[(o, "micro")][k]}, {k: refs[(o, "rank")][k]})[0] for k in state}
        per_tensor = {k: max_rel_diff({k: state[k]}, {k: refs[(o, "rank")][k]})[0] for k in state}
        out[o] = {"rank_ref": max_rel_diff(state, refs[(o, "rank")]), "floor": floor, "per_tensor": per_tensor,
                  "fsdp2": max_rel_diff(state, fsdp) if o == "sgd" else None, **facts}
    if refs is not None:
        out["fsdp2_vs_ref"] = max_rel_diff(fsdp, refs[("sgd", "rank")])
    return out


@pytest.mark.multirank
def test_stage3_on_four_ranks_matches_reference_and_fsdp2():
    results = run_distributed(_four_rank_stage3, 4)[0]
    sgd, adam = results["sgd"], results["adamw"]
    assert sgd["rank_ref"][0] <= 1e-6, sgd["rank_ref"]
    assert sgd["fsdp2"][0] <= 1e-6, sgd["fsdp2"]
    assert results["fsdp2_vs_ref"][0] <= 1e-6, results["fsdp2_vs_ref"]
    for k, rel in adam["per_tensor"].items():
        assert rel <= 2 * adam["floor"][k] + 1e-6, (k, rel, adam["floor"][k])
    for r in (sgd, adam):
        assert r["held_after_step"] == [] and r["gathers"] > 0
