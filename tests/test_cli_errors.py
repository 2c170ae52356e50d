"""Bad invocations: each one exits 2 with exactly one ``mct: error:`` line on stderr
naming the value, no traceback, and writes nothing.

Most cases call ``mct.cli.main`` in-process (fast); a few run the real console entry
point in a subprocess to prove the same holds end to end. ``python tests/test_cli_errors.py``
prints the table (command, exit code, message) as the tests run it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mct.cli import _config_warnings, main
from mct.config import load_config

REPO = Path(__file__).resolve().parents[1]
TINY = ["--set", "model.n_layer=1", "--set", "model.n_head=2", "--set", "model.d_model=32",
        "--set", "model.seq_len=16", "--set", "data.micro_batch_size=2", "--set", "train.steps=2",
        "--set", "train.eval_every=0", "--set", "data.path={corpus}"]
TRAIN = ["train", "--no-progress", "--run-dir", "{run}", *TINY]
HF_TRAIN = ["train", "--no-progress", "--run-dir", "{run}", "--set", "model.seq_len=16", "--set",
            "data.micro_batch_size=2", "--set", "train.steps=2", "--set", "train.eval_every=0", "--set",
            "data.path={corpus}", "--model"]  # + hf:{tmp}/hf_<name> (a config.json of HF_CONFIGS)
_GPT2 = {"model_type": "gpt2", "vocab_size": 256, "n_positions": 32, "n_embd": 32, "n_layer": 1, "n_head": 2}
_BERT = {"model_type": "bert", "vocab_size": 256, "hidden_size": 32, "num_hidden_layers": 1,
         "num_attention_heads": 2, "intermediate_size": 64, "max_position_embeddings": 32}
HF_CONFIGS: dict[str, object] = {
    "auto_map": {**_GPT2, "auto_map": {"AutoModelForCausalLM": "modeling_mine.MyModel"}},
    "bert": _BERT, "layers_negative": {**_GPT2, "n_layer": -1}, "width_null": {**_GPT2, "n_embd": None},
    "width_string": {**_GPT2, "n_embd": "32"}, "heads_3": {**_GPT2, "n_head": 3},
    "kv_heads_3": {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
                   "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 3},
    "eps_string": {**_GPT2, "layer_norm_epsilon": "x"}, "dropout_2": {**_GPT2, "resid_pdrop": 2},
    "act_int": {**_GPT2, "activation_function": 5}, "act_unknown": {**_GPT2, "activation_function": "nope"},
    "json_null": None,
}

# (case id, argv after `mct`, a fragment the one error line must contain)
CASES: list[tuple[str, list[str], str]] = [
    ("calibrate-unknown-device", ["calibrate", "--device", "gpu"], "invalid choice: 'gpu'"),
    ("calibrate-extra-argument", ["calibrate", "--force", "extra"], "unrecognized arguments: extra"),
    ("config-missing", [*TRAIN, "--config", "{tmp}/missing.toml"], "no such file"),
    ("config-directory", [*TRAIN, "--config", "{tmp}"], "is a directory"),
    ("config-dev-null", [*TRAIN, "--config", "/dev/null"], "not a regular file"),
    ("config-fifo", [*TRAIN, "--config", "{tmp}/fifo"], "not a regular file"),
    ("config-binary", [*TRAIN, "--config", "{tmp}/binary.toml"], "not UTF-8"),
    ("config-invalid-toml", [*TRAIN, "--config", "{tmp}/broken.toml"], "not valid TOML"),
    ("config-section-not-table", [*TRAIN, "--config", "{tmp}/section.toml"], "[model] must be a table"),
    ("config-nan-in-toml", [*TRAIN, "--config", "{tmp}/nan.toml"], "train.lr = nan"),
    ("set-no-equals", [*TRAIN, "--set", "train.steps"], "section.key=value"),
    ("set-unknown-section", [*TRAIN, "--set", "foo.bar=1"], "unknown section 'foo'"),
    ("set-unknown-key", [*TRAIN, "--set", "model.width=1"], "unknown key model.width"),
    ("set-wrong-type-int", [*TRAIN, "--set", "model.n_layer=2.5"], "model.n_layer = '2.5' has the wrong type"),
    ("set-wrong-type-bool", [*TRAIN, "--set", "train.tensorboard=maybe"], "train.tensorboard"),
    ("lr-nan", [*TRAIN, "--set", "train.lr=nan"], "train.lr = nan"),
    ("lr-inf", [*TRAIN, "--set", "train.lr=inf"], "train.lr = inf"),
    ("lr-negative", [*TRAIN, "--set", "train.lr=-1"], "train.lr = -1.0"),
    ("grad-clip-nan", [*TRAIN, "--set", "train.grad_clip=nan"], "train.grad_clip = nan"),
    ("lr-schedule-unknown", [*TRAIN, "--set", "train.lr_schedule=step"],
     "train.lr_schedule = 'step' is not allowed: must be one of cosine, linear, constant, wsd"),
    ("min-lr-ratio-above-1", [*TRAIN, "--set", "train.min_lr_ratio=2"], "train.min_lr_ratio = 2"),
    ("dropout-one", [*TRAIN, "--set", "model.dropout=1"], "model.dropout = 1.0"),
    ("seed-negative", [*TRAIN, "--set", "seed=-1"], "seed = -1"),
    ("seed-huge", [*TRAIN, "--set", "seed=99999999999999999999"], "seed = 99999999999999999999"),
    ("n-layer-zero", [*TRAIN, "--set", "model.n_layer=0"], "model.n_layer = 0"),
    ("n-head-not-divisor", [*TRAIN, "--set", "model.n_head=3"], "divisible by model.n_head = 3"),
    ("vocab-too-small", [*TRAIN, "--set", "model.vocab_size=10"], "model.vocab_size = 10"),
    ("seq-len-beyond-corpus", [*TRAIN, "--set", "model.seq_len=100000"], "model.seq_len"),
    ("data-path-missing", [*TRAIN, "--set", "data.path={tmp}/nope"], "does not exist"),
    ("data-path-dev-null", [*TRAIN, "--set", "data.path=/dev/null"], "not a regular file or directory"),
    ("data-path-fifo", [*TRAIN, "--set", "data.path={tmp}/fifo"], "not a regular file or directory"),
    ("data-path-binary", [*TRAIN, "--set", "data.path={tmp}/binary.toml"], "not UTF-8"),
    ("batch-zero", [*TRAIN, "--set", "data.micro_batch_size=0"], "data.micro_batch_size = 0"),
    ("val-fraction-nan", [*TRAIN, "--set", "data.val_fraction=nan"], "data.val_fraction = nan"),
    ("eval-batches-zero", [*TRAIN, "--set", "train.eval_every=1", "--set", "train.eval_batches=0"],
     "train.eval_batches = 0"),
    ("precision-mode", [*TRAIN, "--set", "precision.mode=fp8"], "precision.mode = 'fp8'"),
    ("min-scale-inf", [*TRAIN, "--set", "precision.min_scale=inf"], "precision.min_scale = inf"),
    ("policy-unknown", [*TRAIN, "--set", "checkpointing.policy=some"], "checkpointing.policy = 'some'"),
    ("blocks-not-found", [*TRAIN, "--set", "checkpointing.policy=all", "--set", "checkpointing.blocks=Nope"],
     "checkpointing.blocks"),
    ("zero-stage-4", [*TRAIN, "--set", "zero.stage=4"], "zero.stage = 4"),
    ("zero-auto-no-budget", [*TRAIN, "--set", "zero.stage=auto"], "needs a per-rank budget"),
    ("bucket-nan", [*TRAIN, "--set", "zero.bucket_mb=nan"], "zero.bucket_mb = nan"),
    ("reshard-root-word", [*TRAIN, "--set", "zero.reshard_root_after_forward=maybe"],
     "zero.reshard_root_after_forward = 'maybe' has the wrong type: expected bool"),
    ("budget-garbage", [*TRAIN, "--set", "memory.budget=abc"], "memory.budget"),
    ("budget-negative", [*TRAIN, "--set", "memory.budget=-1GiB"], "memory.budget"),
    ("enforce-without-budget", [*TRAIN, "--set", "memory.enforce=true"], "needs memory.budget"),
    ("enforce-untracked", [*TRAIN, "--set", "memory.budget=1GiB", "--set", "memory.enforce=true",
                           "--set", "memory.track=false"], "memory.track = False"),
    ("budget-1KiB-enforced", [*TRAIN, "--set", "memory.budget=1KiB", "--set", "memory.enforce=true",
                              "--set", "memory.budget_counts=tensors"], "memory budget exceeded"),
    ("budget-300KiB-enforced", [*TRAIN, "--set", "memory.budget=300KiB", "--set", "memory.enforce=true",
                                "--set", "memory.budget_counts=tensors"], "memory budget exceeded in phase 'forward'"),
    ("budget-below-any-process", [*TRAIN, "--set", "memory.budget=100MiB", "--set", "memory.enforce=true"],
     "is below what any configuration's process needs on this machine"),
    ("budget-counts-unknown", [*TRAIN, "--set", "memory.budget_counts=bytes"], "memory.budget_counts = 'bytes'"),
    ("model-larger-than-host-memory", [*TRAIN, "--set", "model.n_layer=2", "--set", "model.d_model=65536",
                                       "--set", "model.n_head=8"], "more than this machine's"),
    ("backend-unknown", [*TRAIN, "--set", "distributed.backend=mpi"], "distributed.backend = 'mpi'"),
    ("offload-tier-unknown", [*TRAIN, "--set", "offload.optimizer=nvme"], "offload.optimizer = 'nvme'"),
    ("offload-params-not-stage-3", [*TRAIN, "--set", "offload.optimizer=disk", "--set", "offload.params=disk"],
     "set zero.stage = 3"),
    ("offload-dir-under-a-file", [*TRAIN, "--set", "offload.optimizer=disk", "--set",
                                  "offload.dir={tmp}/broken.toml/offload"], "cannot be created"),
    ("host-malloc-unknown", [*TRAIN, "--set", "memory.host_malloc=jemalloc"], "memory.host_malloc = 'jemalloc'"),
    ("host-malloc-empty", [*TRAIN, "--set", "memory.host_malloc="], "memory.host_malloc = ''"),
    ("host-malloc-number", [*TRAIN, "--set", "memory.host_malloc=1"], "memory.host_malloc = "),
    ("huge-pages-not-bool", [*TRAIN, "--set", "memory.huge_pages=sometimes"], "memory.huge_pages = "),
    ("huge-pages-empty", [*TRAIN, "--set", "memory.huge_pages="], "memory.huge_pages = ''"),
    ("huge-pages-number", [*TRAIN, "--set", "memory.huge_pages=2"], "memory.huge_pages = '2'"),
    ("huge-pages-list", [*TRAIN, "--set", "memory.huge_pages=[true]"], "memory.huge_pages = '[true]'"),
    ("shared-memory-not-bool", [*TRAIN, "--set", "distributed.shared_memory=yes please"],
     "distributed.shared_memory = 'yes please'"),
    ("shared-memory-int", [*TRAIN, "--set", "distributed.shared_memory=2"], "distributed.shared_memory = '2'"),
    ("shared-memory-list", [*TRAIN, "--set", "distributed.shared_memory=[]"], "distributed.shared_memory = '[]'"),
    ("plan-offload-unknown", ["plan", "--offloads", "params=disk"], "--offloads 'params=disk'"),
    ("timeout-huge", [*TRAIN, "--set", "distributed.timeout_s=1e300"], "distributed.timeout_s"),
    ("nproc-zero", [*TRAIN, "--nproc", "0"], "--nproc must be >= 1"),
    ("nproc-not-int", [*TRAIN, "--nproc", "two"], "invalid int value: 'two'"),
    ("unknown-flag", [*TRAIN, "--bogus"], "unrecognized arguments: --bogus"),
    ("unknown-command", ["bogus"], "invalid choice: 'bogus'"),
    ("no-command", [], "required: command"),
    ("verify-steps-zero", ["verify", *TINY, "--steps", "0"], "--steps must be >= 1"),
    ("plan-world-zero", ["plan", "--world-size", "0"], "--world-size must be >= 1"),
    ("vocab-slice-negative", [*TRAIN, "--set", "train.loss_vocab_slice=-1"], "must be >= 0"),
    ("vocab-slice-word", [*TRAIN, "--set", "train.loss_vocab_slice=abc"], "has the wrong type: expected int"),
    ("vocab-slice-empty", [*TRAIN, "--set", "train.loss_vocab_slice="], "has the wrong type: expected int"),
    ("vocab-slice-huge", [*TRAIN, "--set", "train.loss_vocab_slice=99999999999999999999"], "must fit in 64 bits"),
    ("context-attention-unknown", [*TRAIN, "--set", "parallel.context_attention=rings"],
     "choose 'auto', 'all_to_all', 'all_gather', 'ring'"),
    ("plan-device-unknown", ["plan", "--device", "tpu"], "--device 'tpu': choose cpu or cuda"),
    ("plan-device-empty", ["plan", "--device", ""], "--device '': choose cpu or cuda"),
    ("plan-device-indexed", ["plan", "--device", "cuda:0"], "--device 'cuda:0': choose cpu or cuda"),
    ("plan-device-cpu-host-offload", ["plan", "--device", "cpu", "--act-offloads", "cpu"],
     "whose memory is host memory already"),
    ("plan-init-from-missing", ["plan", "--init-from", "{tmp}/nowhere"], "no such directory or .safetensors file"),
    ("plan-init-from-fifo", ["plan", "--init-from", "{tmp}/fifo"], "no such directory or .safetensors file"),
    ("plan-init-from-dangling-link", ["plan", "--init-from", "{tmp}/dangling"],
     "no such directory or .safetensors file"),
    ("plan-init-from-text-file", ["plan", "--init-from", "{tmp}/broken.toml"],
     "no such directory or .safetensors file"),
    ("plan-mlp-tiles-word", ["plan", "--mlp-tiles", "x"], "--mlp-tiles 'x'"),
    ("plan-mlp-tiles-negative", ["plan", "--mlp-tiles", "0,-5"], "--mlp-tiles '0,-5'"),
    ("plan-mlp-tiles-empty", ["plan", "--mlp-tiles", ""], "--mlp-tiles ''"),
    ("plan-mlp-tiles-huge", ["plan", "--mlp-tiles", "99999999999999999999"], "64 bits"),
    ("plan-solve-no-budget", ["plan", "--solve"], "--solve needs a per-rank budget"),
    ("plan-allow-unknown", ["plan", "--budget", "1GiB", "--solve", "--allow", "fast"], "--allow 'fast'"),
    ("plan-allow-without-solve", ["plan", "--budget", "1GiB", "--allow", "micro_batch"], "--solve"),
    ("calibrate-world-zero", ["calibrate", "--world-size", "0"], "--world-size must be >= 1"),
    ("calibrate-world-word", ["calibrate", "--world-size", "two"], "invalid int value: 'two'"),
    ("train-mlp-tiles-negative", [*TRAIN, "--set", "checkpointing.mlp_tile_tokens=-1"],
     "checkpointing.mlp_tile_tokens = -1"),
    ("train-mlp-tiles-word", [*TRAIN, "--set", "checkpointing.mlp_tile_tokens=abc"], "wrong type"),
    ("train-solver-allow-unknown", [*TRAIN, "--set", "memory.solver_allow=fast"], "'fast' is not a lever"),
    ("plan-budget-nan", ["plan", "--budget", "nan"], "--budget"),
    ("plan-model-missing", ["plan", "--model", "no_such_module:f"], "--model 'no_such_module:f'"),
    ("plan-model-not-module", ["plan", "--model", "os:getcwd"], "not an nn.Module"),
    ("plan-plot-format", ["plan", "--plot", "{tmp}/plan.xyz"], "unknown image format '.xyz'"),
    ("plan-plot-directory", ["plan", "--plot", "{tmp}"], "is a directory"),
    ("plan-plot-no-folder", ["plan", "--plot", "{tmp}/no/such/plan.png"], "does not exist"),
    ("report-missing", ["report", "{tmp}/no_run"], "does not exist"),
    ("report-file", ["report", "{tmp}/broken.toml"], "is not a directory"),
    ("report-no-metrics", ["report", "{tmp}"], "has no metrics.jsonl"),
    ("report-all-lines-damaged", ["report", "{tmp}/damaged_run"], "has no readable step"),
    ("report-plot-format", ["report", "{tmp}/damaged_run", "--plot", "{tmp}/r.gif"], "unknown image format"),
    # the probe of issue 20: sizes beyond 64 bits, bad resume dirs, exports onto what is not theirs, launch
    ("batch-beyond-64-bits", [*TRAIN, "--set", "data.micro_batch_size=99999999999999999999999"],
     "data.micro_batch_size = 99999999999999999999999 is not allowed: must fit in 64 bits"),
    ("d-model-beyond-64-bits", [*TRAIN, "--set", "model.d_model=99999999999999999999999"], "model.d_model"),
    ("vocab-beyond-64-bits", [*TRAIN, "--set", "model.vocab_size=99999999999999999999999"], "model.vocab_size"),
    ("vocab-beyond-64-bits-nproc-2", [*TRAIN, "--nproc", "2", "--set", "model.vocab_size=99999999999999999999999"],
     "model.vocab_size"),
    ("logits-overflow-64-bits", [*TRAIN, "--set", "data.micro_batch_size=4611686018427387904"],
     "beyond 64-bit sizes"),
    ("run-dir-empty", [*TRAIN, "--run-dir", ""], "--run-dir '' is empty"),
    ("zero-units-not-found", [*TRAIN, "--set", "zero.units=Nope"], "zero.units = ['Nope']"),
    ("adapter-pattern-matches-nothing", [*TRAIN, "--set", "adapter.kind=lora", "--set", "adapter.targets=[*q_proj]"],
     "adapter.targets pattern '*q_proj' matches no linear layer of GPT; it could match e.g. blocks.0.attn.qkv"),
    ("adapter-on-the-head", [*TRAIN, "--set", "adapter.kind=lora", "--set", "adapter.targets=[lm_head]"],
     "selects the output head"),
    ("adapter-nf4-without-qlora", [*TRAIN, "--set", "adapter.kind=lora", "--set", "adapter.base_dtype=nf4"],
     "set adapter.kind = 'qlora'"),
    ("adapter-pattern-nproc-2", [*TRAIN, "--nproc", "2", "--set", "adapter.kind=lora", "--set",
                                 "adapter.targets=[*q_proj]"], "'*q_proj' matches no linear layer"),
    ("verify-nproc-zero", ["verify", *TINY, "--nproc", "0"], "--nproc must be >= 1"),
    ("plan-budget-below-one-byte", ["plan", "--budget", "0.5B"], "less than one byte"),
    ("plan-model-raises", ["plan", "--model", "tests.planner_models:raising"],
     "raised RuntimeError: a factory that fails"),
    ("rdzv-endpoint-no-port", ["train", "--nnodes", "2", "--rdzv-endpoint", "node0:port", *TINY], "HOST:PORT"),
    ("rdzv-endpoint-unresolvable", ["train", "--nnodes", "2", "--rdzv-endpoint", "no-such-host.invalid:29400",
                                    *TINY], "does not resolve"),
    ("resume-metadata-wrong-shape", ["train", "--resume", "{tmp}/list_meta_run"], "holds a JSON list"),
    ("resume-metadata-wrong-shape-nproc-2", ["train", "--nproc", "2", "--resume", "{tmp}/list_meta_run"],
     "holds a JSON list"),
    ("resume-checkpoints-deleted", ["train", "--resume", "{tmp}/emptied_run"], "so they were deleted"),
    ("export-onto-symlink", ["export", "{tmp}/emptied_run", "--out", "{tmp}/link", "--force"], "a symbolic link"),
    ("export-onto-fifo", ["export", "{tmp}/emptied_run", "--out", "{tmp}/fifo", "--force"], "a FIFO"),
    ("export-onto-run-metadata", ["export", "{tmp}/emptied_run", "--out", "{tmp}/emptied_run/metadata.json",
                                  "--force"], "own files"),
    ("hf-auto-map-custom-code", [*HF_TRAIN, "hf:{tmp}/hf_auto_map"], "has auto_map"),
    ("hf-bert-not-a-decoder", [*HF_TRAIN, "hf:{tmp}/hf_bert"], "is_decoder"),
    ("hf-layers-negative", [*HF_TRAIN, "hf:{tmp}/hf_layers_negative"], "n_layer = -1 must be a positive integer"),
    ("hf-field-null", [*HF_TRAIN, "hf:{tmp}/hf_width_null"], "n_embd = null must be"),
    ("hf-field-wrong-type", [*HF_TRAIN, "hf:{tmp}/hf_width_string"], 'n_embd = "32" must be'),
    ("hf-heads-not-divisor", [*HF_TRAIN, "hf:{tmp}/hf_heads_3"], "not divisible by num_attention_heads = 3"),
    ("hf-kv-heads-not-divisor", [*HF_TRAIN, "hf:{tmp}/hf_kv_heads_3"], "not divisible by num_key_value_heads = 3"),
    ("hf-eps-string", [*HF_TRAIN, "hf:{tmp}/hf_eps_string"], "layer_norm_epsilon"),
    ("hf-dropout-above-one", [*HF_TRAIN, "hf:{tmp}/hf_dropout_2"], "resid_pdrop = 2 must be a probability"),
    ("hf-activation-int", [*HF_TRAIN, "hf:{tmp}/hf_act_int"], "activation_function"),
    ("hf-activation-unknown", [*HF_TRAIN, "hf:{tmp}/hf_act_unknown"], "cannot build a model"),
    ("hf-config-json-null", [*HF_TRAIN, "hf:{tmp}/hf_json_null"], "holds a JSON null"),
    ("hf-config-nested-deep", [*HF_TRAIN, "hf:{tmp}/hf_deep"], "nests its JSON too deeply"),
    ("plan-hf-bert-not-a-decoder", ["plan", "--model", "hf:{tmp}/hf_bert"], "is_decoder"),
    ("export-into-checkpoints", ["export", "{tmp}/emptied_run", "--out", "{tmp}/emptied_run/checkpoints/w"],
     "own files"),
    # issue 29, the data side: mct prepare's hostile inputs and datasets that lie about their tokens
    ("prepare-workers-huge", ["prepare", "{corpus}", "--out", "{tmp}/ds", "--workers", "100000"],
     "--workers must be an integer in [1, "),
    ("prepare-train-vocab-huge", ["prepare", "{corpus}", "--out", "{tmp}/ds", "--tokenizer", "train:4294967296"],
     "VOCAB must be in [257, 1048576]"),
    ("prepare-deep-json", ["prepare", "{tmp}/data/deep.jsonl", "--out", "{tmp}/ds", "--no-progress"],
     "nested too deeply"),
    ("prepare-lone-surrogate", ["prepare", "{tmp}/data/surrogate.jsonl", "--out", "{tmp}/ds", "--no-progress"],
     "lone surrogate"),
    ("prepare-json-null", ["prepare", "{tmp}/data/null.jsonl", "--out", "{tmp}/ds", "--no-progress"], "holds null,"),
    ("prepare-dangling-link", ["prepare", "{tmp}/data/dangling", "--out", "{tmp}/ds"], "dangling symbolic link"),
    ("prepare-out-parent-is-file", ["prepare", "{corpus}", "--out", "{tmp}/broken.toml/ds"], "is a file, not a"),
    ("prepare-dataset-as-input", ["prepare", "{tmp}/data/lowered_ds", "--out", "{tmp}/ds"], "is a prepared dataset"),
    ("prepare-split-unknown", ["prepare", "{corpus}", "--out", "{tmp}/ds", "--split", "words"], "invalid choice"),
    ("data-prepared-vocab-lowered", [*TRAIN, "--set", "data.path={tmp}/data/lowered_ds"], "holds token id 256"),
    # this round's keys and plan flags: schedule, loss chunking, activation offload, [optimizer]
    ("decay-fraction-nan", [*TRAIN, "--set", "train.decay_fraction=nan"], "train.decay_fraction = nan"),
    ("decay-fraction-above-1", [*TRAIN, "--set", "train.decay_fraction=1.5"], "train.decay_fraction = 1.5"),
    ("min-lr-ratio-negative", [*TRAIN, "--set", "train.min_lr_ratio=-0.1"], "train.min_lr_ratio = -0.1"),
    ("loss-chunk-negative", [*TRAIN, "--set", "train.loss_chunk_tokens=-1"], "train.loss_chunk_tokens = -1"),
    ("loss-chunk-float", [*TRAIN, "--set", "train.loss_chunk_tokens=1.5"], "train.loss_chunk_tokens = '1.5'"),
    ("loss-chunk-beyond-64-bits", [*TRAIN, "--set", "train.loss_chunk_tokens=99999999999999999999999"],
     "train.loss_chunk_tokens = 99999999999999999999999"),
    ("act-offload-unknown", [*TRAIN, "--set", "checkpointing.offload=nvme"], "checkpointing.offload = 'nvme'"),
    ("act-offload-empty", [*TRAIN, "--set", "checkpointing.offload="], "checkpointing.offload = ''"),
    ("act-offload-without-policy", [*TRAIN, "--set", "checkpointing.offload=disk"], "checkpointing.policy = 'none'"),
    ("optimizer-name-unknown", [*TRAIN, "--set", "optimizer.name=sgd"], "optimizer.name = 'sgd'"),
    ("optimizer-lr-not-a-key", [*TRAIN, "--set", "optimizer.lr=1"], "set train.lr"),
    ("optimizer-betas-one", [*TRAIN, "--set", "optimizer.betas=0.9"], "optimizer.betas = [0.9]"),
    ("optimizer-betas-nan", [*TRAIN, "--set", "optimizer.betas=0.9,nan"], "optimizer.betas[1] = nan"),
    ("optimizer-betas-text", [*TRAIN, "--set", "optimizer.betas=a,b"], "optimizer.betas[0] = 'a'"),
    ("optimizer-betas-one-or-more", [*TRAIN, "--set", "optimizer.betas=1,0.9"], "optimizer.betas = [1.0, 0.9]"),
    ("optimizer-eps-inf", [*TRAIN, "--set", "optimizer.eps=inf"], "optimizer.eps = inf"),
    ("optimizer-state-dtype-unknown", [*TRAIN, "--set", "optimizer.state_dtype=fp8"], "optimizer.state_dtype = 'fp8'"),
    ("act-offload-dir-under-a-file", [*TRAIN, "--set", "checkpointing.policy=all", "--set",
                                      "checkpointing.offload=disk", "--set", "offload.dir={tmp}/broken.toml/acts"],
     "broken.toml"),
    ("plan-act-offloads-unknown", ["plan", "--act-offloads", "nvme"], "--act-offloads 'nvme'"),
    ("plan-act-offloads-empty", ["plan", "--act-offloads", ","], "--act-offloads ','"),
    ("plan-loss-chunks-text", ["plan", "--loss-chunks", "abc"], "--loss-chunks 'abc'"),
    ("plan-loss-chunks-negative", ["plan", "--loss-chunks", "0,-5"], "--loss-chunks '0,-5'"),
    ("plan-loss-chunks-empty", ["plan", "--loss-chunks", ""], "--loss-chunks ''"),
    ("plan-loss-chunks-beyond-64-bits", ["plan", "--loss-chunks", "99999999999999999999999"],
     "train.loss_chunk_tokens = 99999999999999999999999"),
    # mct prepare's streamed text, save_to_disk directories and --text-field, hostile
    ("prepare-split-line-not-utf8", ["prepare", "{tmp}/data/latin1.txt", "--out", "{tmp}/ds", "--split", "line",
                                     "--no-progress"], "latin1.txt: not UTF-8 text (byte 9)"),
    ("prepare-save-to-disk-missing-arrow", ["prepare", "{tmp}/data/saved", "--out", "{tmp}/ds"], "which is missing"),
    ("prepare-text-field-empty", ["prepare", "{corpus}", "--out", "{tmp}/ds", "--text-field", ""],
     "--text-field is empty"),
    ("prepare-out-is-input-file", ["prepare", "{tmp}/data/latin1.txt", "--out", "{tmp}/data/latin1.txt"],
     "already exists and is not an empty directory"),
    ("plan-loss-chunks-not-int", ["plan", "--loss-chunks", "0,1.5"], "give token counts >= 0"),
    # Probe V: paths that are links, FIFOs or files where a directory is needed; lists the TOML way
    ("offload-dir-dangling-link", [*TRAIN, "--set", "offload.optimizer=disk", "--set", "offload.dir={tmp}/dangling"],
     "offload.dir = '{tmp}/dangling' is a dangling symbolic link (it points at '{tmp}/nowhere'"),
    ("offload-dir-a-file", [*TRAIN, "--set", "offload.optimizer=disk", "--set", "offload.dir={tmp}/broken.toml"],
     "offload.dir = '{tmp}/broken.toml' is a file, not a directory"),
    ("offload-dir-fifo", [*TRAIN, "--set", "offload.optimizer=disk", "--set", "offload.dir={tmp}/fifo"],
     "offload.dir = '{tmp}/fifo' is not a directory (a device, FIFO or socket)"),
    ("act-offload-dir-dangling-link", [*TRAIN, "--set", "checkpointing.policy=all", "--set",
                                       "checkpointing.offload=disk", "--set", "offload.dir={tmp}/dangling"],
     "offload.dir = '{tmp}/dangling' is a dangling symbolic link"),
    ("act-offload-dir-a-file", [*TRAIN, "--set", "checkpointing.policy=all", "--set", "checkpointing.offload=disk",
                                "--set", "offload.dir={tmp}/broken.toml"], "is a file, not a directory"),
    ("run-dir-a-file", ["train", "--run-dir", "{tmp}/broken.toml", *TINY], "is a file, not a directory"),
    ("run-dir-fifo", ["train", "--run-dir", "{tmp}/fifo", *TINY], "is not a directory (a FIFO)"),
    ("run-dir-dangling-link", ["train", "--run-dir", "{tmp}/dangling", *TINY],
     "--run-dir '{tmp}/dangling' is a dangling symbolic link"),
    ("config-dangling-link", [*TRAIN, "--config", "{tmp}/dangling"], "no such file"),
    ("resume-a-file", ["train", "--resume", "{tmp}/broken.toml"], "is not a run directory"),
    ("resume-fifo", ["train", "--resume", "{tmp}/fifo"], "is not a run directory"),
    ("init-from-fifo", [*TRAIN, "--init-from", "{tmp}/fifo"], "--init-from '{tmp}/fifo'"),
    ("init-from-dangling-link", [*TRAIN, "--init-from", "{tmp}/dangling"], "--init-from '{tmp}/dangling'"),
    ("per-block-list-unclosed", [*TRAIN, "--set", "checkpointing.per_block=[all,none"],
     "is not a TOML list or table: write a list as checkpointing.per_block=[a,b]"),
    ("per-block-list-of-numbers", [*TRAIN, "--set", "checkpointing.per_block=[1,2]"],
     "checkpointing.per_block = [1, 2] has the wrong type"),
    ("per-block-list-unknown", [*TRAIN, "--set", "checkpointing.per_block=[all,most]"],
     "checkpointing.per_block[1] = 'most'"),
    ("solver-allow-table", [*TRAIN, "--set", "memory.solver_allow={{micro_batch=1}}"],  # {{ }}: str.format
     "memory.solver_allow = {{'micro_batch': 1}} has the wrong type: expected list (a list like"),
    ("solver-allow-unknown-toml", [*TRAIN, "--set", 'memory.solver_allow=["fast"]'], "'fast' is not a lever"),
    ("resume-empty", ["train", "--resume", "", *TINY], "--resume '' is empty"),
    ("config-empty", [*TRAIN, "--config", ""], "--config '' is empty"),
    ("plan-world-huge", ["plan", "--world-size", "99999999999999999999"], "<= 16777216 (2**24), got 99999999999999999999"),
    ("calibrate-world-huge", ["calibrate", "--world-size", "16777217"], "<= 16777216"),
    ("betas-toml-out-of-range", [*TRAIN, "--set", "optimizer.betas=[0.9, 1.5]"], "optimizer.betas = [0.9, 1.5]"),
]


def _fixtures(tmp: Path) -> dict[str, str]:
    """Files the cases point at; returns the placeholders' values."""
    corpus = tmp / "corpus"
    corpus.mkdir()
    for i in range(8):
        (corpus / f"f{i}.txt").write_text(f"file {i}: " + "the quick brown fox jumps over the lazy dog. " * 30)
    os.mkfifo(tmp / "fifo")  # reading it would block forever: must be refused, not opened
    (tmp / "binary.toml").write_bytes(b"\xff\xfe\x00\x01")
    (tmp / "broken.toml").write_text("[train\nsteps = 1\n")
    (tmp / "section.toml").write_text("model = 3\n")
    (tmp / "nan.toml").write_text("[train]\nlr = nan\n")
    (tmp / "damaged_run").mkdir()
    (tmp / "damaged_run" / "metrics.jsonl").write_text('{"step": 0, "loss": 5.1\n[1, 2]\n')
    (tmp / "list_meta_run" / "checkpoints").mkdir(parents=True)
    (tmp / "list_meta_run" / "metadata.json").write_text("[1, 2]\n")
    (tmp / "emptied_run" / "checkpoints").mkdir(parents=True)  # a run that saved every 2 steps, all deleted
    (tmp / "emptied_run" / "metadata.json").write_text('{"world_size": 1, "config": {"train": {"checkpoint_every": 2}}}')
    (tmp / "link").symlink_to(tmp / "broken.toml")
    (tmp / "dangling").symlink_to(tmp / "nowhere")
    for name, config in HF_CONFIGS.items():
        (tmp / f"hf_{name}").mkdir()
        (tmp / f"hf_{name}" / "config.json").write_text(json.dumps(config))
    (tmp / "hf_deep").mkdir()
    (tmp / "hf_deep" / "config.json").write_text("[" * 100_000)
    _data_fixtures(tmp / "data")
    return {"tmp": str(tmp), "corpus": str(corpus), "run": str(tmp / "run")}


def _data_fixtures(d: Path) -> None:
    """Inputs of mct prepare's cases, and a prepared dataset whose meta.json says vocab_size 200
    while its tokens hold EOS = 256 (written by hand, the public format)."""
    import json
    import numpy as np
    d.mkdir()
    (d / "deep.jsonl").write_text("[" * 100000 + "\n")
    (d / "surrogate.jsonl").write_text('{"text": "a\\ud800b"}\n')
    (d / "null.jsonl").write_text('{"text": null}\n')
    (d / "dangling").symlink_to(d / "nowhere")
    (d / "latin1.txt").write_bytes("first\ncaf\xe9\n".encode("latin-1"))
    (d / "saved").mkdir()
    (d / "saved" / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    ds = d / "lowered_ds"
    ds.mkdir()
    docs = [np.frombuffer(f"document {i}: ".encode() * 20, np.uint8).astype("<u2") for i in range(8)]
    tokens = np.concatenate([np.append(t, 256) for t in docs]).astype("<u2")
    (ds / "tokens.bin").write_bytes(tokens.tobytes())
    (ds / "docs.idx").write_bytes(np.cumsum([0] + [t.size + 1 for t in docs]).astype("<i8").tobytes())
    (ds / "tokenizer.json").write_text("{}")
    (ds / "meta.json").write_text(json.dumps({"format": "mct-prepared-v1", "dtype": "uint16", "vocab_size": 200,
                                              "eos_id": 256, "documents": 8, "tokens": int(tokens.size)}))


def _run_case(argv: list[str], values: dict[str, str], capsys) -> tuple[int, list[str], str]:
    args = [a.format(**values) for a in argv]
    try:
        rc = main(args)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    return rc, [line for line in err.splitlines() if line.strip()], err


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_invocation_is_one_line_exit_2_and_writes_nothing(case, tmp_path, capsys):
    _, argv, fragment = case
    values = _fixtures(tmp_path)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    rc, lines, err = _run_case(argv, values, capsys)
    assert rc == 2, err
    errors = [line for line in lines if line.startswith("mct: error:")]
    assert len(errors) == 1, err
    assert "Traceback" not in err
    assert fragment.format(**values) in errors[0], errors[0]
    assert [line for line in lines if not line.startswith(("mct: error:", "mct: warning:"))] == [], err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before, "a failed command wrote files"


# (case id, argv after `mct`, fragment) against one trained tiny hf: run and its damaged copies
# (tests/task/test_hf_inputs.py::probe_runs): exports, samples and init-from sources.
HF_RUN_TRAIN = ["train", "--no-progress", "--run-dir", "{root}/new_run", "--model", "hf:{src}", "--set",
                "model.seq_len=16", "--set", "data.path={dataset}", "--set", "train.steps=1", "--set",
                "train.eval_every=0"]
RUN_CASES: list[tuple[str, list[str], str]] = [
    ("export-hf-into-the-runs-hf-dir", ["export", "{run}", "--format", "hf", "--out", "{run}/hf/exported"],
     "own files"),
    ("export-hf-into-checkpoints", ["export", "{run}", "--format", "hf", "--out", "{run}/checkpoints/mine"],
     "own files"),
    ("export-onto-the-runs-tokenizer", ["export", "{run}", "--out", "{run}/tokenizer.json", "--force"], "own files"),
    ("export-hf-parent-is-a-file", ["export", "{run}", "--format", "hf", "--out", "{a_file}/x"], "is a file"),
    ("export-parent-is-a-file", ["export", "{run}", "--out", "{a_file}/x.safetensors"], "is a file"),
    ("export-told-to-resume", ["export", "{run}", "--out", "{root}/w.safetensors", "--resume"], "no --resume"),
    ("export-shard-size-beyond-float", ["export", "{run}", "--format", "hf", "--out", "{root}/x",
                                        "--max-shard-size", "1e400GB"], "--max-shard-size"),
    ("sample-tokens-huge", ["sample", "{run}", "--tokens", "1000000000000"], "between 1 and 100,000"),
    ("sample-temperature-denormal", ["sample", "{run}", "--temperature", "1e-320"], "below 0.0001"),
    ("sample-temperature-negative", ["sample", "{run}", "--temperature", "-1"], "finite number >= 0"),
    ("sample-temperature-nan", ["sample", "{run}", "--temperature", "nan"], "got nan"),
    ("sample-prompt-beyond-vocab", ["sample", "{bytes_run}", "--prompt", "caf\u00e9".encode().decode(
        "unicode_escape")], "beyond the model's vocabulary of 128 ids"),
    ("sample-truncated-weights", ["sample", "{truncated_run}"], "not a readable safetensors file"),
    ("sample-wrong-shaped-weights", ["sample", "{wrong_run}"], "transformer.wte.weight has shape [100, 32]"),
    ("sample-no-tokenizer", ["sample", "{notok_run}"], "has no tokenizer.json"),
    ("sample-not-a-run", ["sample", "{a_file}"], "not a run directory"),
    ("sample-metadata-damaged", ["sample", "{damaged_meta_run}"], "holds no run config"),
    ("sample-metadata-nested-deep", ["sample", "{deep_meta_run}"], "nested too deeply"),
    ("resume-metadata-nested-deep", ["train", "--resume", "{deep_meta_run}"], "nested too deeply"),
    ("init-from-missing-shard", [*HF_RUN_TRAIN, "--init-from", "{sharded}"], "not in the directory"),
    ("init-from-truncated", [*HF_RUN_TRAIN, "--init-from", "{truncated_hf}"], "not a readable safetensors file"),
    ("export-hf-onto-a-symlink", ["export", "{run}", "--format", "hf", "--out", "{root}/link"], "a symbolic link"),
    ("init-from-uppercase-suffix-missing", [*HF_RUN_TRAIN, "--init-from", "{root}/none.SAFETENSORS"],
     "no such directory or .safetensors file"),
    # review of the task / export / sample area
    ("sample-tokenizer-not-utf8", ["sample", "{badtok_run}"], "is not a readable tokenizer (not UTF-8 text"),
    # adapters out (issue 54): the run trained every weight
    ("export-peft-of-a-full-run", ["export", "{run}", "--format", "peft", "--out", "{root}/adapter"],
     "--format peft needs a run that trained adapters"),
    ("export-merge-of-a-full-run", ["export", "{run}", "--format", "hf", "--merge", "--out", "{root}/merged"],
     "--merge needs a run that trained adapters"),
    ("export-peft-into-the-run", ["export", "{lora_run}", "--format", "peft", "--out", "{lora_run}/checkpoints/a"],
     "own files"),
    ("export-peft-onto-a-symlink", ["export", "{lora_run}", "--format", "peft", "--out", "{root}/link"],
     "a symbolic link"),
    ("export-peft-parent-is-a-file", ["export", "{lora_run}", "--format", "peft", "--out", "{a_file}/x"], "is a file"),
    ("export-peft-onto-a-file", ["export", "{lora_run}", "--format", "peft", "--out", "{a_file}"], "a_file"),
    ("export-peft-of-nothing", ["export", "{root}/nowhere", "--format", "peft", "--out", "{root}/adapter"],
     "nowhere"),
    ("export-merge-onto-a-symlink", ["export", "{lora_run}", "--format", "hf", "--merge", "--out", "{root}/link"],
     "a symbolic link"),
    ("export-merge-into-the-runs-hf-dir", ["export", "{lora_run}", "--format", "hf", "--merge", "--out",
                                           "{lora_run}/hf/merged"], "own files"),
    ("export-merge-file-parent-is-a-file", ["export", "{lora_run}", "--merge", "--out", "{a_file}/w.safetensors"],
     "is a file"),
    ("export-peft-with-dtype", ["export", "{run}", "--format", "peft", "--dtype", "bf16", "--out", "{root}/adapter"],
     "do not apply to --format peft"),
]


def test_an_oserror_is_one_line_naming_the_path_and_direction(monkeypatch, capsys):
    """The funnel: an OSError no command turned into a message still ends as one line
    (mct.errors.describe), read vs write and missing vs denied told apart."""
    import errno
    import mct.cli
    for err, fragment in ((PermissionError(errno.EACCES, "Permission denied", "/x/y"), "cannot read '/x/y': permission"),
                          (FileNotFoundError(errno.ENOENT, "No such file", "/x/z"), "cannot read '/x/z': no such file"),
                          (OSError(errno.EIO, "Input/output error", "/x/w"), "I/O error")):
        def fail(args, argv, err=err):
            raise err
        monkeypatch.setattr(mct.cli, "cmd_report", fail)
        assert main(["report", "anything"]) == 2
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("mct: error:") and fragment in lines[0], lines


def test_an_oserror_while_training_says_read_or_write(tmp_path):
    """A run's OS error names its path and direction: a corpus it cannot read is not
    called a write needing free space; a full disk in the run directory is a write."""
    import errno
    from mct.run.worker import _place_message
    cfg = load_config(None, [])
    run = tmp_path / "run"
    read = _place_message(PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "corpus.txt")),
                          str(run), cfg)
    assert read.startswith(f"cannot read '{tmp_path / 'corpus.txt'}': permission denied"), read
    full = _place_message(OSError(errno.ENOSPC, "No space left", str(run / "checkpoints" / "x")), str(run), cfg)
    assert full.startswith("cannot write") and "no space left" in full, full
    denied = _place_message(PermissionError(errno.EACCES, "Permission denied", str(run / "metrics.jsonl")),
                            str(run), cfg)
    assert denied.startswith("cannot write") and "permission denied" in denied, denied


@pytest.fixture(scope="module")
def hf_probe(tmp_path_factory) -> dict[str, str]:
    pytest.importorskip("transformers")
    from tests.task.test_hf_inputs import probe_runs
    return probe_runs(tmp_path_factory.mktemp("cli_hf"))


@pytest.mark.parametrize("case", RUN_CASES, ids=[c[0] for c in RUN_CASES])
def test_bad_use_of_a_run_is_one_line_exit_2_and_writes_nothing(case, hf_probe, capsys):
    _, argv, fragment = case
    root = Path(hf_probe["root"])
    before = sorted((p.relative_to(root), p.lstat().st_size) for p in root.rglob("*"))
    rc, lines, err = _run_case(argv, hf_probe, capsys)
    assert rc == 2, err
    errors = [line for line in lines if line.startswith("mct: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert fragment in errors[0], errors[0]
    assert [line for line in lines if not line.startswith(("mct: error:", "mct: warning:"))] == [], err
    assert sorted((p.relative_to(root), p.lstat().st_size) for p in root.rglob("*")) == before, "files changed"


@pytest.mark.cli
@pytest.mark.parametrize("argv,fragment", [
    (["-m", "mct", "train", "--set", "memory.budget=1KiB", "--set", "memory.enforce=true",
      "--set", "memory.budget_counts=tensors", *TINY], "memory budget exceeded"),
    (["-m", "mct", "train", "--nproc", "x"], "invalid int value"),
    (["-m", "mct", "train", "--set", "train.lr=nan"], "train.lr = nan"),
], ids=["budget-enforced", "argparse", "non-finite"])
def test_bad_invocation_end_to_end_has_no_traceback(argv, fragment, tmp_path):
    values = _fixtures(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, *[a.format(**values) for a in argv], "--run-dir", str(tmp_path / "run")],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=240)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("mct: error:") == 1 and "Traceback" not in out.stderr, out.stderr
    assert fragment in out.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.cli
def test_version_flag_in_both_entry_points():
    import mct
    for cmd in ([sys.executable, "-m", "mct", "--version"], [str(Path(sys.executable).parent / "mct"), "--version"]):
        if not Path(cmd[0]).exists():
            continue
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and out.stdout.strip() == f"mct {mct.__version__}", out


def test_train_help_shows_every_flag_default(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    blocks: dict[str, str] = {}  # option -> its help text (option lines start with two spaces and a dash)
    for line in out.split("options:")[1].split("\n\n")[0].splitlines():
        if line.startswith("  -"):
            name = line.split()[0].rstrip(",")
            blocks[name] = line
        elif blocks:
            blocks[name] += " " + line.strip()
    assert set(blocks) >= {"--config", "--set", "--nproc", "--run-dir", "--no-progress"}
    for name, text in blocks.items():
        if name != "-h":
            assert "(default:" in " ".join(text.split()), f"{name} shows no default: {text}"
    assert "(default: 1)" in " ".join(blocks["--nproc"].split())


def test_budget_without_enforce_warns_once(capsys):
    _config_warnings(load_config(None, ["memory.budget=2GiB"]), nproc=1)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mct: warning: memory.budget = '2GiB' is recorded but not enforced")
    _config_warnings(load_config(None, ["memory.budget=2GiB", "memory.enforce=true"]), nproc=1)
    _config_warnings(load_config(None, ["memory.budget=2GiB", "zero.stage=auto"]), nproc=1)
    assert capsys.readouterr().err == ""


def test_nproc_above_core_count_hints(capsys, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    cores = os.cpu_count() or 1
    _config_warnings(load_config(None, []), nproc=cores + 1)
    err = capsys.readouterr().err
    assert f"--nproc {cores + 1}" in err and f"{cores} CPU cores" in err
    _config_warnings(load_config(None, []), nproc=cores)
    assert capsys.readouterr().err == ""


def _table() -> str:  # pragma: no cover - `python tests/test_cli_errors.py`
    import contextlib
    import io
    import tempfile
    rows = ["| case | command | exit | message |", "|---|---|---|---|"]
    for name, argv, _ in CASES:
        with tempfile.TemporaryDirectory() as d:
            values = _fixtures(Path(d))
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                try:
                    rc = main([a.format(**values) for a in argv])
                except SystemExit as e:
                    rc = e.code
            rest = argv[len(TRAIN):] if argv[:len(TRAIN)] == TRAIN else argv
            shown = ("train [tiny model] " if rest is not argv else "") + " ".join(rest).replace("{tmp}", "T")
            msg = next((x for x in err.getvalue().splitlines() if x.startswith("mct: error:")), "(none)")
            rows.append(f"| {name} | `mct {shown}` | {rc} | {msg.replace(d, 'T').replace('|', '/')} |")
    return "\n".join(rows)


if __name__ == "__main__":  # pragma: no cover
    print(_table())
