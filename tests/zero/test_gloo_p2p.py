"""On gloo, mct's all-gathers and 2-rank reduce-scatters are point-to-point sends and
receives (``mct.zero.comm.TorchCollectives``), not gloo's collectives: the same bits, in
the same outputs, at any world size, with collectives of both kinds in flight at once."""

from __future__ import annotations

import pytest
import torch

from mct.zero import comm as comm_mod
from mct.zero.comm import TorchCollectives
from tests.distributed import run_distributed
from tests.helpers import engine_run, tiny_config

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _inputs(rank: int, world: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """A rank's [world * n] input: random values of mixed scale with signed zeros,
    infinities and values whose sums round (the bits a different sum would change)."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(world * n, generator=g) * torch.exp(4 * torch.randn(world * n, generator=g))
    x[::7] = 0.0
    x[3::11] = -0.0
    x[5::97] = float("inf") if rank == 0 else 1.0
    return x.to(dtype)


def _bits(t: torch.Tensor) -> list[int]:
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()]).tolist()


def _collect(rank: int, world: int, p2p: bool) -> dict:
    """Every kind and dtype, issued together (async) and waited on in reverse order."""
    ops = TorchCollectives(p2p=p2p)
    out, pending = {}, []
    for dtype in DTYPES:
        for n in (1, 37, 4096):
            inp = _inputs(rank, world, n, dtype)
            rs = torch.empty(n, dtype=dtype)
            pending.append(ops.reduce_scatter(rs, inp))
            flat = torch.empty(world * n, dtype=dtype)  # contiguous output
            shard = _inputs(rank, 1, n, dtype)
            pending.append(ops.all_gather(flat, shard))
            wide = torch.full((world, n + 5), 7.0, dtype=dtype)  # a bucket's columns of a wider buffer
            pending.append(ops.all_gather(wide[:, 2:2 + n], shard))
            out[str(dtype), n] = (rs, flat, wide)
    for p in reversed(pending):
        p.wait()
    return {k: tuple(_bits(t) for t in v) for k, v in out.items()}


def _both(rank: int, world: int) -> tuple[dict, dict]:
    return _collect(rank, world, True), _collect(rank, world, False)


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 3])
def test_point_to_point_collectives_give_gloos_bits(world):
    results = run_distributed(_both, world)
    for rank, (p2p, gloo) in enumerate(results):
        assert p2p.keys() == gloo.keys()
        for k in p2p:
            assert p2p[k] == gloo[k], (rank, k)
        # and they are the sums and the gathers, not merely equal to each other
        for (dtype, n), (rs, flat, wide) in p2p.items():
            if dtype == str(torch.float32) and n == 37:
                ins = [_inputs(r, world, n, torch.float32) for r in range(world)]
                want = ins[0].view(world, n)[rank].clone()
                for r in range(1, world):
                    want = want + ins[r].view(world, n)[rank]
                got = torch.tensor(rs, dtype=torch.int32).view(torch.float32)
                assert torch.allclose(got, want, rtol=1e-6, equal_nan=True)
                shards = torch.cat([_inputs(r, 1, n, torch.float32) for r in range(world)])
                assert torch.equal(torch.tensor(flat, dtype=torch.int32).view(torch.float32), shards)
                w = torch.tensor(wide, dtype=torch.int32).view(torch.float32).view(world, n + 5)
                assert torch.equal(w[:, 2:2 + n].reshape(-1), shards)
                assert (w[:, :2] == 7).all() and (w[:, 2 + n:] == 7).all()  # nothing written outside


def _train(rank: int, world: int) -> list:
    """At 2 ranks the reduce-scatters send the held gradients as they are (a tiled MLP's
    parts summed as they come); gloo's collectives reduce the flat buffers."""
    out = []
    for stage, tiles in ((2, 0), (3, 0), (3, 8)) if world == 2 else ((3, 0),):  # 3 ranks: all-gathers only
        runs = []
        for p2p in (True, False):
            comm_mod.GLOO_P2P = p2p
            cfg = tiny_config(zero={"stage": stage, "bucket_mb": 0.002},  # several buckets in flight
                              checkpointing={"mlp_tile_tokens": tiles},
                              distributed={"shared_memory": False})  # gathers by messages, not mct.zero.shm
            losses, state, *_ = engine_run(cfg, rank, 3, n_micro=2)
            runs.append((losses, state))
        comm_mod.GLOO_P2P = True
        (la, sa), (lb, sb) = runs
        same = sa.keys() == sb.keys() and all(torch.equal(sa[k].view(torch.int32), sb[k].view(torch.int32)) for k in sa)
        out.append(((stage, tiles), la == lb, same))
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 3])
def test_engine_trains_bit_identically_with_gloos_collectives(world):
    for stage, same_losses, same_params in run_distributed(_train, world)[0]:
        assert same_losses and same_params, stage


SHAPES = [torch.Size([37, 21]), torch.Size([5]), torch.Size([3, 300]), torch.Size([1]), torch.Size([661])]


def _held(rank: int) -> list[tuple[int, torch.Tensor]]:
    """Rank ``rank``'s gradients of a unit of ragged parameters (alignment gaps, one across
    the shard edge and across buckets, tail padding), in an arrival order that is not the
    layout's. Missing gradients: b (rank 0's row) and e (rank 1's) on rank 1, d (rank
    1's row) on rank 0: sent as zeros, or nothing to add."""
    g = torch.Generator().manual_seed(7 + rank)
    grads = []
    for i in (4, 0, 2, 1, 3):
        if (i, rank) in ((1, 1), (3, 0), (4, 1)):
            continue
        n = SHAPES[i].numel()
        x = torch.randn(n, generator=g) * torch.exp(4 * torch.randn(n, generator=g))
        x[::5] = -0.0  # on both ranks: -0.0 + -0.0 must come out as the flat buffers' +0.0
        x[1::9] = 0.0
        x[2::13] = 1.5 if rank else -1.5  # sums that cancel
        grads.append((i, x.view(SHAPES[i])))
    return grads


def _flat(layout, grads) -> torch.Tensor:
    flat = torch.zeros(layout.padded_numel)
    for i, x in grads:
        flat[layout.offsets[i]:layout.offsets[i] + x.numel()].add_(x.reshape(-1))
    return flat


def _held_exchange(rank: int, world: int) -> dict:
    """One unit's held gradients reduce-scattered between two ranks, sent as they are
    (``Comm._exchange``), against the same gradients added into a zeroed flat buffer and
    reduce-scattered (with sends, and with gloo's all-reduce)."""
    from mct.dist import DistContext
    from mct.zero.flat import HeldGrads
    from mct.zero.partition import build_layout
    layout = build_layout(list("abcde"), SHAPES, world)
    grads, S = _held(rank), layout.shard_numel
    comm = comm_mod.Comm(DistContext.current(), bucket_bytes=64 * 2 * 4)  # 64 columns a bucket
    calls = []
    exchange = comm.ops.exchange
    comm.ops.exchange = lambda recvs, sends: calls.append(len(sends)) or exchange(recvs, sends)
    got = torch.full((S,), float("nan"))
    accumulated = []
    comm.reduce_scatter(HeldGrads(layout, grads, torch.float32, torch.device("cpu"), sendable=True), got,
                        async_op=True, then=lambda: accumulated.append(got.clone())).wait()
    out = {"got": _bits(got), "then": len(accumulated) == 1 and torch.equal(accumulated[0], got), "calls": calls}
    for p2p in (True, False):
        comm.ops.p2p = p2p
        want = torch.empty(S)
        comm.reduce_scatter(_flat(layout, grads), want)
        out[p2p] = _bits(want)
    return out


@pytest.mark.multirank
def test_two_ranks_send_held_gradients_as_they_are_with_the_flat_buffers_bits():
    """The exchange reads every rank's gradients in place: a parameter with none on one
    rank counts as zeros there, gaps and padding come out zero, signed zeros and
    cancelling sums have the bits the flat buffer's reduce-scatter gives (sends or gloo)."""
    from mct.zero.partition import build_layout
    layout = build_layout(list("abcde"), SHAPES, 2)
    flats = [_flat(layout, _held(r)) for r in range(2)]
    total = (flats[0] + flats[1]).view(2, -1)
    for rank, out in enumerate(run_distributed(_held_exchange, 2)):
        assert out["got"] == out[True] == out[False], rank
        got = torch.tensor(out["got"], dtype=torch.int32).view(torch.float32)  # plain lists between processes
        assert torch.equal(got, total[rank])  # the sums, every column written
        assert not torch.signbit(got[got == 0]).any()  # no -0.0: the flat buffer's zeros
        assert out["then"] and len(out["calls"]) > 3 and sum(out["calls"]) > len(out["calls"]), out["calls"]
