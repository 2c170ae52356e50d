"""``model.source = 'hf:DIR'`` and ``train.init_from`` with transformers' Llama (GQA, RoPE,
SwiGLU, untied head) and GPT-2 (tied head, dropout) from tiny configs saved with
save_pretrained: verify at the fp32 tolerance on 2 ranks, stages 0-3, every
checkpointing policy, bf16, offload; meta construction equal to a normal one; the first
loss after --init-from equal to plain transformers'; one-line errors."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from mct.config import EngineConfig  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402

SEQ = 16


def save_tiny(kind: str, path: Path, weights: bool = True) -> Path:
    """A tiny HF causal LM directory: config.json (and model.safetensors, seed 7)."""
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig
    from transformers.utils import logging
    logging.set_verbosity_error()
    if kind == "llama":
        config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                             tie_word_embeddings=False)
    else:
        config = GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                            eos_token_id=0)  # dropout 0.1 everywhere (the default)
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    if weights:
        torch.manual_seed(7)
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hf")
    corpus = root / "corpus.txt"
    rnd = random.Random(0)
    corpus.write_text("".join(rnd.choice("abcdefgh ijkl\n") for _ in range(100_000)))
    return {"llama": str(save_tiny("llama", root / "llama")), "gpt2": str(save_tiny("gpt2", root / "gpt2")),
            "corpus": str(corpus), "two_ranks": str(root / "two_ranks"), "one_rank": str(root / "one_rank")}


def _cfg(d: dict, kind: str, **sections) -> EngineConfig:
    base = {"model": {"source": f"hf:{d[kind]}", "seq_len": SEQ},
            "data": {"path": d["corpus"], "micro_batch_size": 2, "grad_accum": 2}, "train": {"warmup_steps": 0}}
    for k, v in sections.items():
        base.setdefault(k, {}).update(v)
    return EngineConfig.from_dict(base)


CASES = [  # every stage, every policy, bf16, offload and init-from, each model at least twice
    ("llama", {"zero": {"stage": 0}}),
    ("llama", {"zero": {"stage": 1}, "checkpointing": {"policy": "every_k"}}),
    ("llama", {"zero": {"stage": 2}, "checkpointing": {"policy": "sqrt"}, "offload": {"optimizer": "cpu"}}),
    ("llama", {"zero": {"stage": 3}, "checkpointing": {"policy": "selective"}, "train": {"init_from": "WEIGHTS"}}),
    ("llama", {"zero": {"stage": 1}, "precision": {"mode": "bf16"}, "checkpointing": {"policy": "selective"}}),
    ("gpt2", {"zero": {"stage": 0}, "checkpointing": {"policy": "selective"}}),
    ("gpt2", {"zero": {"stage": 2}}),
    ("gpt2", {"zero": {"stage": 3}, "checkpointing": {"policy": "all"},
              "offload": {"optimizer": "cpu", "params": "cpu"}}),
    ("gpt2", {"zero": {"stage": 3}, "precision": {"mode": "bf16"}, "checkpointing": {"policy": "selective"}}),
]


def run_config(d: dict, steps: int, **data) -> dict:
    """A `mct train` run of the tiny Llama from its weights, stage 3, selective checkpointing."""
    return {"seed": 3, "model": {"source": f"hf:{d['llama']}", "seq_len": SEQ},
            "data": {"path": d["corpus"], "micro_batch_size": 2, **data},
            "train": {"steps": steps, "warmup_steps": 1, "eval_every": 0, "checkpoint_every": 1, "grad_clip": 1.0,
                      "init_from": d["llama"]},
            "zero": {"stage": 3}, "checkpointing": {"policy": "selective"}}


def _verify_cases(rank: int, world: int, d: dict) -> list:
    from mct.run.trainer import train
    from mct.verify.compare import run_verify
    out = []
    for kind, sections in CASES:
        sections = json.loads(json.dumps(sections).replace("WEIGHTS", d[kind]))
        out.append(run_verify(_cfg(d, kind, **sections), 2))
    train(EngineConfig.from_dict(run_config(d, 2)), d["two_ranks"], progress=False)  # resharded below
    return out


@pytest.fixture(scope="module")
def reports(hf_dirs) -> list:
    return run_distributed(_verify_cases, 2, hf_dirs, timeout=300)[0]


@pytest.mark.multirank
@pytest.mark.parametrize("i", range(len(CASES)), ids=[f"{k}-{json.dumps(s)}" for k, s in CASES])
def test_verify_hf_models_match_the_reference(reports, i):
    report = reports[i]
    assert report.passed, report.table()
    if report.mode == "fp32":
        assert report.max_loss_rel <= 1e-5 and report.param_rel <= 1e-5


@pytest.mark.multirank
def test_hf_run_of_two_ranks_resumes_on_one(hf_dirs, reports):
    """2 ranks for 2 steps, then 1 rank (2 micro-batches: the same global batch) to step 3,
    equals 1 rank from the start up to the order of the fp32 sums."""
    from safetensors.torch import load_file
    from mct.persistence.export import consolidated_state
    from mct.persistence.hf_export import export_hf
    from mct.persistence.resume import resume_config
    from mct.run.trainer import train
    # the HF export reads each rank's stored chunk of a unit: the same values as the whole-unit export
    step2 = Path(hf_dirs["two_ranks"]) / "checkpoints" / "step_00000002"
    export_hf(step2, Path(hf_dirs["two_ranks"]).parent / "hf_two_ranks", max_shard_bytes=30_000)
    exported = {}
    for f in sorted((Path(hf_dirs["two_ranks"]).parent / "hf_two_ranks").glob("*.safetensors")):
        exported.update(load_file(str(f)))
    whole = consolidated_state(step2)
    assert set(exported) == set(whole) and all(torch.equal(exported[k], whole[k]) for k in whole)
    train(resume_config(hf_dirs["two_ranks"], ["train.steps=3"], 1), hf_dirs["two_ranks"], progress=False,
          resume=True)
    train(EngineConfig.from_dict(run_config(hf_dirs, 3, grad_accum=2)), hf_dirs["one_rank"], progress=False)
    got = load_file(str(Path(hf_dirs["two_ranks"]) / "model.safetensors"))
    want = load_file(str(Path(hf_dirs["one_rank"]) / "model.safetensors"))
    start = load_file(str(Path(hf_dirs["llama"]) / "model.safetensors"))
    assert set(got) == set(want) == set(start)
    diff = sum(float((got[k] - want[k]).double().norm()) ** 2 for k in want) ** 0.5
    moved = sum(float((want[k] - start[k]).double().norm()) ** 2 for k in want) ** 0.5
    assert moved > 0.01 and diff <= 1e-5 * moved, (diff, moved)


def _engine(d: dict, kind: str, **sections):
    import mct
    from mct.task import build_model, task_for
    cfg = _cfg(d, kind, **sections)
    task = task_for(cfg)
    model, program = build_model(task, cfg, on_meta=cfg.zero.stage == 3 or cfg.offload.enabled)
    return mct.Engine(model, lambda g: torch.optim.SGD(g, lr=0.0), cfg, init_program=program), task


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_meta_construction_gives_the_values_of_a_normal_one(hf_dirs, kind):
    from mct.task import build_model, task_for
    cfg = _cfg(hf_dirs, kind)
    normal, _ = build_model(task_for(cfg), cfg, on_meta=False)
    engine, _ = _engine(hf_dirs, kind, zero={"stage": 3}, offload={"optimizer": "cpu"})
    got = engine.full_state_dict()
    want = dict(normal.named_parameters())
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("kind,sections", [("llama", {}), ("gpt2", {"zero": {"stage": 3},
                                                                   "offload": {"optimizer": "cpu"}})])
def test_init_from_first_loss_equals_transformers(hf_dirs, kind, sections):
    from transformers import AutoModelForCausalLM
    from mct.persistence.init_from import load_pretrained
    plain = AutoModelForCausalLM.from_pretrained(hf_dirs[kind]).eval()
    x = torch.randint(0, 256, (2, SEQ + 1), generator=torch.Generator().manual_seed(3))
    want = plain(input_ids=x, labels=x).loss.item()  # transformers shifts the labels itself
    engine, task = _engine(hf_dirs, kind, **sections)
    load_pretrained(engine, hf_dirs[kind])
    got = engine.eval_loss((x[:, :-1], x[:, 1:]), task.loss_fn)
    assert abs(got - want) <= 1e-6 * abs(want), (got, want)


def test_init_from_refuses_weights_of_another_model(hf_dirs):
    from mct.persistence.init_from import load_pretrained
    engine, _ = _engine(hf_dirs, "gpt2")
    before = engine.full_state_dict()
    with pytest.raises(ValueError, match="missing: .*transformer"):
        load_pretrained(engine, hf_dirs["llama"])
    assert all(torch.equal(before[k], v) for k, v in engine.full_state_dict().items())


def test_hf_source_mistakes_are_one_line(hf_dirs, tmp_path, capsys):
    from mct.cli import main
    custom = save_tiny("llama", tmp_path / "custom", weights=False)
    cfg = json.loads((custom / "config.json").read_text())
    (custom / "config.json").write_text(json.dumps({**cfg, "model_type": "my_remote_arch",
                                                    "auto_map": {"AutoModelForCausalLM": "x.Y"}}))
    cases = [(["--model", f"hf:{tmp_path / 'nowhere'}"], "no such directory"),
             (["--model", f"hf:{tmp_path}"], "config.json is missing"),
             (["--model", f"hf:{custom}"], "trust_remote_code"),
             (["--model", f"hf:{hf_dirs['llama']}", "--set", "model.n_layer=8"], "only the built-in GPT reads it"),
             (["--model", f"hf:{hf_dirs['gpt2']}", "--set", "model.seq_len=64"], "longer than the 32 positions"),
             (["--model", f"hf:{hf_dirs['gpt2']}", "--init-from", hf_dirs["llama"]], "missing"),
             (["--model", f"hf:{hf_dirs['gpt2']}", "--init-from", str(tmp_path / "x.bin")], "no such directory"),
             (["--model", "tests.planner_models:hf_gpt2"], "embeds 101")]  # byte ids >= its vocabulary
    for args, words in cases:
        code = main(["verify", "--steps", "1", "--set", f"data.path={hf_dirs['corpus']}",
                     "--set", "model.seq_len=16" if "model.seq_len=64" not in args else "seed=1", *args])
        err = capsys.readouterr().err.strip()
        assert code == 2 and err.startswith("mct: error: ") and "\n" not in err and words in err, (args, err)


def cached_gpt2():
    """A factory for --model: GPT-2 as from_config builds it, KV cache on (use_cache=True)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                      bos_token_id=0, eos_token_id=0))


def test_selective_checkpointing_of_a_cached_hf_model_matches_no_checkpointing():
    """The crash 'aten.slice.Tensor encountered during backward but not found in storage'
    came from the KV cache growing between forward and recompute: the default loss of
    a pkg.module:factory model turns it off, in the engine and the planner alike."""
    import mct
    from mct.planner import dry_run
    from mct.task.tokens import token_loss
    x = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(0))
    batch = (x, torch.roll(x, -1, 1))
    states = {}
    for policy in ("none", "selective"):
        torch.manual_seed(0)
        cfg = EngineConfig.from_dict({"checkpointing": {"policy": policy}})
        engine = mct.Engine(cached_gpt2(), lambda g: torch.optim.SGD(g, lr=0.1), cfg)
        torch.manual_seed(1)
        engine.train_step(batch, token_loss)
        states[policy] = engine.full_state_dict()
    assert all(torch.equal(states["none"][k], v) for k, v in states["selective"].items())
    run = dry_run(cached_gpt2, token_loss, batch, EngineConfig.from_dict({"checkpointing": {"policy": "selective"}}), 1)
    assert run.peak > 0
