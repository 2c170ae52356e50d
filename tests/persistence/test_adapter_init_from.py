"""`--init-from` with adapters: a peft directory (or an adapter run) continues its adapters
on the model source's base, giving the run's logits; a base alone leaves the adapters at
their initial values; rank, alpha and target mismatches are one line naming both values."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")

from mct.cli import main  # noqa: E402
from mct.config import EngineConfig  # noqa: E402
from mct.engine import Engine  # noqa: E402
from mct.persistence.init_from import load_pretrained  # noqa: E402
from mct.task import task_for  # noqa: E402
from tests.helpers import adamw  # noqa: E402
from tests.persistence.test_adapter_export import ALPHA, RANK, TARGETS, _max_diff, adapter_run  # noqa: E402,F401


def _engine(adapter_run: dict, **adapter) -> Engine:
    kind = adapter_run["kind"]
    cfg = EngineConfig.from_dict({"model": {"source": f"hf:{adapter_run['base']}", "seq_len": 16},
                                  "adapter": {"kind": "lora", "rank": RANK, "alpha": ALPHA, "targets": TARGETS[kind],
                                              **adapter}})
    return Engine(task_for(cfg).model_fn(), adamw, cfg)


def _peft_dir(adapter_run: dict):
    out = adapter_run["root"] / "peft_for_init"
    if not out.exists():
        assert main(["export", str(adapter_run["run"]), "--format", "peft", "--out", str(out)]) == 0
    return out


def _logits_diff(engine: Engine, adapter_run: dict) -> float:
    engine.model.eval()
    return _max_diff(engine.model, adapter_run["logits"])


def test_init_from_peft_dir_continues_the_adapters_on_the_model_sources_base(adapter_run):
    engine = _engine(adapter_run)
    before = _logits_diff(engine, adapter_run)
    load_pretrained(engine, _peft_dir(adapter_run))
    assert before > 1e-3  # a fresh adapted model (random base) is not the run's
    assert _logits_diff(engine, adapter_run) < 1e-5


def test_init_from_an_adapter_run_dir_continues_the_adapters(adapter_run):
    engine = _engine(adapter_run)
    load_pretrained(engine, adapter_run["run"])
    assert _logits_diff(engine, adapter_run) < 1e-5


def test_init_from_the_base_alone_keeps_the_adapters_initial_values(adapter_run):
    from transformers import AutoModelForCausalLM
    engine = _engine(adapter_run)
    initial = {n: t.clone() for n, t in engine.full_state_dict().items() if "lora_" in n}
    load_pretrained(engine, adapter_run["base"])
    got = engine.full_state_dict()
    assert all(torch.equal(got[n], t) for n, t in initial.items())
    assert any(n.endswith("lora_A.weight") and t.abs().max() > 0 for n, t in got.items())  # A kept, not zeroed
    base = AutoModelForCausalLM.from_pretrained(str(adapter_run["base"]), dtype=torch.float32).eval()
    engine.model.eval()
    x = torch.arange(12).view(1, 12)
    with torch.no_grad():  # B = 0: the adapted model is the base
        assert torch.equal(engine.model(input_ids=x).logits, base(input_ids=x).logits)


@pytest.mark.parametrize("key,value", [("rank", 8), ("alpha", 32.0)])
def test_rank_or_alpha_mismatch_names_the_key_and_both_values(adapter_run, key, value):
    engine = _engine(adapter_run, **{key: value})
    theirs = RANK if key == "rank" else ALPHA
    for source in (_peft_dir(adapter_run), adapter_run["run"]):
        with pytest.raises(ValueError, match=f"adapter.{key} = {theirs}, this run has adapter.{key} = {value}"):
            load_pretrained(engine, source)


def test_target_mismatch_names_a_layer_and_both_counts(adapter_run):
    one = TARGETS[adapter_run["kind"]][:1]
    engine = _engine(adapter_run, targets=one)
    with pytest.raises(ValueError, match=r"the source adapts .* which the other does not \(2 adapted layers here"):
        load_pretrained(engine, _peft_dir(adapter_run))


def test_peft_dir_into_a_model_without_adapters_says_set_the_adapter(adapter_run):
    cfg = EngineConfig.from_dict({"model": {"source": f"hf:{adapter_run['base']}", "seq_len": 16}})
    engine = Engine(task_for(cfg).model_fn(), adamw, cfg)
    with pytest.raises(ValueError, match="is a peft adapter: set adapter.kind = 'lora'"):
        load_pretrained(engine, _peft_dir(adapter_run))
