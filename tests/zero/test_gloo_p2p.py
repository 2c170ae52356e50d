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
    out = []
    for stage in (2, 3) if world == 2 else (3,):  # at 3 ranks only the all-gathers are sends
        runs = []
        for p2p in (True, False):
            comm_mod.GLOO_P2P = p2p
            cfg = tiny_config(zero={"stage": stage, "bucket_mb": 0.002})  # several buckets in flight
            losses, state, *_ = engine_run(cfg, rank, 3, n_micro=2)
            runs.append((losses, state))
        comm_mod.GLOO_P2P = True
        (la, sa), (lb, sb) = runs
        out.append((stage, la == lb, sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)))
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 3])
def test_engine_trains_bit_identically_with_gloos_collectives(world):
    for stage, same_losses, same_params in run_distributed(_train, world)[0]:
        assert same_losses and same_params, stage
