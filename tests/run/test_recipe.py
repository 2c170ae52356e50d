"""`mct train`'s recipes: a run from pretrained weights gets the fine-tune defaults, a value
the user set wins, the Python API keeps the field defaults, the summary and `--help` name
them, and a resumed run keeps the recipe it was recorded with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mct.cli import build_parser, main
from mct.config import CLI_RECIPE, EngineConfig, load_config
from mct.run.recipe import FINETUNE, SCRATCH, recipe_line, recipe_values, train_config


def test_a_run_from_pretrained_weights_gets_the_finetune_defaults():
    cfg = train_config(None, ["train.init_from=weights.safetensors", "train.steps=200"])
    t = cfg.train
    assert (t.lr, t.warmup_steps, t.weight_decay, t.min_lr_ratio, t.grad_clip) == (2e-5, 6, 0.01, 0.0, 1.0)
    assert cfg.optimizer.betas == [0.9, 0.999]
    assert train_config(None, ["train.init_from=w.safetensors", "train.steps=10"]).train.warmup_steps == 1


def test_a_value_the_user_set_wins_over_the_finetune_recipe(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[train]\nlr = 1e-4\ninit_from = "w.safetensors"\n[optimizer]\nbetas = [0.8, 0.9]\n')
    cfg = train_config(f, ["train.warmup_steps=0", "train.weight_decay=0.1"])
    assert (cfg.train.lr, cfg.train.warmup_steps, cfg.train.weight_decay) == (1e-4, 0, 0.1)
    assert cfg.optimizer.betas == [0.8, 0.9]
    assert cfg.train.min_lr_ratio == 0.0  # not set: the recipe's


def test_a_run_from_scratch_keeps_the_scratch_recipe():
    assert train_config(None, ["train.steps=50"]) == load_config(None, ["train.steps=50"], defaults=CLI_RECIPE)
    t = train_config(None, []).train
    assert (t.lr, t.warmup_steps, t.weight_decay, t.grad_clip) == (3e-3, 30, 0.1, 1.0)


def test_the_python_api_keeps_its_defaults_with_init_from():
    t = EngineConfig.from_dict({"train": {"init_from": "w.safetensors"}}).train
    assert (t.lr, t.warmup_steps, t.weight_decay, t.grad_clip) == (3e-3, 30, 0.1, 0.0)


def test_the_recipe_line_names_the_recipe_and_marks_what_the_user_set():
    line = recipe_line(train_config(None, ["train.init_from=w.safetensors", "train.lr=1e-4"]))
    assert line.startswith("fine-tune (train.init_from is set): lr 0.0001 (set), warmup_steps 9, ")
    assert "weight_decay 0.01, min_lr_ratio 0, grad_clip 1, betas [0.9, 0.999]" in line
    assert recipe_line(train_config(None, [])).startswith("from scratch: lr 0.003, warmup_steps 30, ")
    assert "(set)" not in recipe_line(train_config(None, []))


def test_train_help_lists_every_default_of_both_recipes(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in (SCRATCH, FINETUNE):
        values = recipe_values(name, 100)
        for key, value in values.items():
            if name == FINETUNE and key == "train.warmup_steps":
                assert "train.warmup_steps = 3% of train.steps" in text
                continue
            shown = f"[{value[0]:g}, {value[1]:g}]" if isinstance(value, list) else f"{value:g}"
            assert f"{key} = {shown}" in text, (name, key)


def _corpus(d: Path) -> Path:
    d.mkdir()
    for i in range(6):
        (d / f"f{i}.txt").write_text(f"file {i}: " + "the quick brown fox jumps over the lazy dog. " * 20)
    return d


def test_a_resumed_finetune_run_keeps_its_recipe(tmp_path, capsys):
    """Pretrained weights from a 2-step run; a 4-step fine-tune from them stopped at
    step 2 (train.steps=2), then resumed to 4: the recipe's values and its line stay."""
    f = tmp_path / "c.toml"
    f.write_text(f'seed = 3\n[model]\nn_layer = 1\nn_head = 2\nd_model = 16\nseq_len = 8\n'
                 f'[data]\npath = "{_corpus(tmp_path / "corpus")}"\nmicro_batch_size = 2\n'
                 f'[train]\nsteps = 2\neval_every = 0\ncheckpoint_every = 2\n')
    common = ["train", "--config", str(f), "--no-progress"]
    assert main([*common, "--run-dir", str(tmp_path / "base")]) == 0
    run = tmp_path / "ft"
    assert main([*common, "--run-dir", str(run), "--init-from", str(tmp_path / "base")]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--no-progress", "--set", "train.steps=4"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("recipe        fine-tune (train.init_from is set): lr 2e-05, warmup_steps 1, "), out
    config = json.loads((run / "checkpoints" / "step_00000004" / "trainer.json").read_text())["config"]
    assert (config["train"]["lr"], config["train"]["weight_decay"], config["optimizer"]["betas"]) == \
        (2e-5, 0.01, [0.9, 0.999])


def test_adapters_on_pretrained_weights_get_the_lora_recipe():
    from mct.run.recipe import LORA, LORA_LR, recipe_of
    cfg = train_config(None, ["train.init_from=w.safetensors", "adapter.kind=lora", "train.steps=100"])
    assert recipe_of(cfg) == LORA and cfg.train.lr == LORA_LR == 2e-4
    t = cfg.train
    assert (t.warmup_steps, t.weight_decay, t.min_lr_ratio, t.grad_clip) == (3, 0.01, 0.0, 1.0)
    assert recipe_line(cfg).startswith("LoRA fine-tune (train.init_from and adapter.kind are set): lr 0.0002, ")
    assert "(set)" not in recipe_line(cfg)
    assert train_config(None, ["train.init_from=w", "adapter.kind=lora", "train.lr=1e-4"]).train.lr == 1e-4
    assert train_config(None, ["adapter.kind=lora"]).train.lr == 3e-3  # new weights: from scratch


def test_train_help_names_the_lora_recipe(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    assert "LoRA fine-tune (--init-from and adapter.kind set): fine-tune's, with train.lr = 0.0002" in \
        " ".join(capsys.readouterr().out.split())
