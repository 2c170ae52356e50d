"""Command line: mct train | plan | verify | report | export | sample | prepare | calibrate (also
``python -m mct``).

User mistakes (config, data, launch) print one line ``mct: error: ...`` and exit 2.
``--nproc N`` re-launches this command in N local workers, with torchrun's environment
(mct.run.launch; several machines: under torchrun).

This package parses and dispatches (``main``); each command lives in ``train``, ``plan``
or ``commands`` and imports what it runs inside its own function: torch and the engine take
seconds to import, and ``mct --help``, a config error or the launcher must answer at once.
"""

from __future__ import annotations

import argparse
import os
import sys

from mct import __version__
from mct.cli.commands import cmd_export, cmd_prepare, cmd_report, cmd_sample, cmd_verify
from mct.cli.common import _under_torchrun, _warn  # noqa: F401 (mct.__main__ imports _under_torchrun)
from mct.cli.plan import cmd_calibrate, cmd_plan
from mct.cli.train import _config_warnings, cmd_train  # noqa: F401 (tests call _config_warnings)


class _Parser(argparse.ArgumentParser):
    """argparse with mct's error format: one line ``mct: error: ...``, exit 2 (argparse
    would print the usage block first)."""

    def error(self, message: str):  # type: ignore[override]
        print(f"mct: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        raise SystemExit(2)

class _DefaultsFormatter(argparse.HelpFormatter):
    """Appends each option's default to its help, unless the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or not action.option_strings or action.default is argparse.SUPPRESS:
            return text
        d = action.default
        shown = "off" if d is False else "none" if d in (None, []) else "%(default)s"
        return f"{text} (default: {shown})"

def _common(p: argparse.ArgumentParser, nproc: bool = True, init_from: bool = True) -> None:
    p.add_argument("--config", help="TOML config file; keys not in it keep the recipe's defaults")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config key (repeatable), e.g. --set zero.stage=2")
    p.add_argument("--model", metavar="SPEC", help="what is trained (= --set model.source=SPEC): 'gpt' (the "
                   "built-in GPT of [model]), 'hf:DIR' (a local Hugging Face model directory; nothing is "
                   "downloaded, no code from it runs) or 'package.module:factory' returning an nn.Module (it may "
                   "define loss_fn, example_batch, optimizer, param_groups; docs/planner.md) (default: gpt)")
    if init_from:
        p.add_argument("--init-from", metavar="PATH", help="start from these weights (= --set train.init_from=PATH): "
                       "a Hugging Face model directory, a .safetensors file, or an mct run dir or checkpoint; with "
                       "adapter.kind = lora also a peft adapter directory (continues its adapters)")
    if nproc:
        p.add_argument("--nproc", type=int, default=1, help="local worker processes (torchrun's environment)")

def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mct", description="memory-constrained trainer for PyTorch",
                     formatter_class=_DefaultsFormatter)
    parser.add_argument("--version", action="version", version=f"mct {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    kw: dict = {"formatter_class": _DefaultsFormatter,
                "epilog": "Config keys default to the field defaults in mct/config.py, except "
                          "train.grad_clip = 1.0 (the mct recipe; the Python API does not clip)."}
    from mct.run.recipe import recipes_help
    t = sub.add_parser("train", help="train the configured GPT on the configured corpus", **{
        **kw, "epilog": f"Config keys default to the field defaults in mct/config.py, except the recipe's "
                        f"(a config file or --set wins; the run summary names the recipe): {recipes_help()}."})
    _common(t, nproc=False)
    t.add_argument("--nproc", type=int, default=None,
                   help="local worker processes, with torchrun's environment (default: 1); with --resume, the "
                        "run's recorded number of local ranks unless given (another number reshards)")
    t.add_argument("--run-dir", help="a new directory for the run, one that holds no run yet "
                                     "(default: runs/<timestamp>)")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its newest complete "
                                                       "checkpoint, with its recorded config (--set may change "
                                                       "steps, checkpointing, zero, logging)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument("--max-restarts", type=int, default=0,
                   help="restart the worker group up to R times when a worker dies (torchrun --max-restarts)")
    t.add_argument("--nnodes", type=int, default=1, help="machines (one launcher each; c10d rendezvous)")
    t.add_argument("--rdzv-endpoint", help="HOST:PORT of the rendezvous, the same on every machine (--nnodes > 1)")
    t.add_argument("--rdzv-id", default="mct", help="job id shared by the machines of one run (--nnodes > 1)")
    v = sub.add_parser("verify", help="compare the configured engine with the fp32 reference", **kw)
    _common(v)
    v.add_argument("--steps", type=int, default=10, help="steps to compare")
    pl = sub.add_parser("plan", help="predict per-rank peak memory of every configuration; pick one for a budget",
                        **kw)
    _common(pl, nproc=False)
    pl.add_argument("--world-size", type=int, default=1, help="data-parallel ranks")
    pl.add_argument("--device", default=None, help="the device type the run will compute on: cpu or cuda "
                    "(default: this machine's own; plan a GPU job from a laptop with --device cuda)")
    pl.add_argument("--nproc", type=int, default=None, help=argparse.SUPPRESS)  # train's; refused in one clear line
    pl.add_argument("--budget", help="per-rank budget, e.g. 24GiB (default: memory.budget)")
    pl.add_argument("--json", action="store_true", help="print JSON instead of the table")
    pl.add_argument("--wide", action="store_true", help="the full table: every category's bytes at each peak "
                    "(the default table fits 100 columns)")
    pl.add_argument("--plot", metavar="FILE.png", help="also draw the predicted peaks as stacked bars (a new file, "
                    "or a regular file with --force; never a link, FIFO or a run's own file)")
    pl.add_argument("--force", action="store_true", help="replace --plot if it is an existing regular file")
    pl.add_argument("--stages", default="0,1,2,3", help="ZeRO stages to plan, comma-separated")
    pl.add_argument("--policies", default=None, help="checkpointing policies to plan (default none,selective,sqrt,all, "
                    "and per_block when the config sets checkpointing.per_block)")
    pl.add_argument("--precisions", default="fp32,bf16", help="precision modes to plan")
    pl.add_argument("--offloads", default=None, help="offload choices to plan, comma-separated: none, optimizer=cpu|disk, "
                    "optimizer+params=cpu|disk (default: the config's own offload setting)")
    pl.add_argument("--act-offloads", default=None, help="activation offload tiers to plan (checkpointing.offload), "
                    "comma-separated: none, cpu, disk (default: the config's own)")
    pl.add_argument("--loss-chunks", default=None, help="train.loss_chunk_tokens values to plan, comma-separated "
                    "tokens, 0 = off, e.g. 0,1024 (default: the config's own)")
    pl.add_argument("--mlp-tiles", default=None, help="checkpointing.mlp_tile_tokens values to plan, comma-separated "
                    "tokens, 0 = off, e.g. 0,1024 (default: the config's own)")
    pl.add_argument("--full-depth", action="store_true", help="dry-run every configuration at the model's full "
                    "depth instead of extending two shallow copies of its repeated blocks (slower; same numbers "
                    "where the blocks repeat, docs/planner.md)")
    pl.add_argument("--solve", action="store_true", help="search for the fastest configuration that fits the "
                    "budget instead of the grid: the stage, per-block recompute, activation offload and the levers "
                    "--allow names; prints the frontier, the pick and why (docs/planner.md, 'The solver')")
    pl.add_argument("--allow", default=None, help="with --solve: levers that change numerics or move the state it "
                    "may choose, comma-separated: micro_batch, loss_chunk, offload (default: memory.solver_allow)")
    pl.add_argument("--workers", type=int, default=None, help="processes that dry-run the grid's configurations "
                    "(default: one per usable CPU core, at most 8; used only when the grid takes seconds; 1: "
                    "all in this process)")
    r = sub.add_parser("report", help="summarize a run directory", **kw)
    r.add_argument("run_dir", help="a directory made by `mct train`")
    r.add_argument("--plot", metavar="FILE.png", help="also draw loss, throughput, time and memory (a new file, "
                   "or a regular file with --force; never a link, FIFO or a run's own file)")
    r.add_argument("--force", action="store_true", help="replace --plot if it is an existing regular file")
    e = sub.add_parser("export", help="consolidated fp32 weights (safetensors) from a run's newest checkpoint",
                       **kw)
    e.add_argument("source", metavar="RUN_DIR|CHECKPOINT_DIR", help="a run directory or one of its checkpoints")
    e.add_argument("--out", required=True, help="the .safetensors file to write (a new file, or a regular file "
                                                "with --force; never a run's own files); --format hf|peft: a new "
                                                "or empty directory")
    e.add_argument("--force", action="store_true", help="replace --out if it is an existing regular file (--format "
                   "hf: an earlier export, a directory holding only an export's files)")
    e.add_argument("--format", choices=("safetensors", "hf", "peft"), default="safetensors",
                   help="safetensors: one fp32 file, names as named_parameters; hf: a Hugging Face model directory "
                        "(config.json, tokenizer files, sharded safetensors) of a run of an hf: model; peft: an "
                        "adapter run's LoRA tensors (adapter_model.safetensors, adapter_config.json) as peft loads them")
    e.add_argument("--merge", action="store_true", help="an adapter run's base with the adapters merged in "
                   "(W + B A * alpha/rank), the LoRA tensors left out (--format safetensors or hf)")
    e.add_argument("--dtype", default="fp32", help="--format hf: the weights' dtype, fp32 or bf16")
    e.add_argument("--max-shard-size", default="2GB", help="--format hf: the largest safetensors file; more "
                   "weights are split into shards listed by model.safetensors.index.json")
    e.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)  # refused in one clear line
    sm = sub.add_parser("sample", help="text from a run's final weights, with its tokenizer", **kw)
    sm.add_argument("run_dir", help="a directory made by `mct train`")
    sm.add_argument("--prompt", default="", help="text the sample continues (default: a newline)")
    sm.add_argument("--tokens", type=int, default=200, help="tokens to generate")
    sm.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 = greedy")
    sm.add_argument("--seed", type=int, default=0, help="seed of the sampling generator")
    c = sub.add_parser("calibrate", help="measure this machine's matmul FLOP/s per dtype and copy bandwidth "
                       "(the peak MFU divides by), cached per machine", formatter_class=_DefaultsFormatter)
    c.add_argument("--force", action="store_true", help="measure again even when the cache holds this machine")
    c.add_argument("--json", action="store_true", help="print JSON instead of the table")
    c.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="what to measure; auto: the CUDA device where there is one, else the CPU")
    c.add_argument("--world-size", type=int, default=None, metavar="N",
                   help="also measure what the time model needs for N ranks on this machine (collectives at N, "
                        "the per-op and per-byte overhead and the wait of N ranks stepping at once, and one process's "
                        "at every core); `mct plan` measures them on first use")
    pr = sub.add_parser("prepare", help="tokenize text and JSON Lines into a dataset that data.path trains on "
                        "(docs/data.md)", formatter_class=_DefaultsFormatter)
    pr.add_argument("inputs", nargs="+", metavar="INPUT",
                    help="text files (one document each), .jsonl / .jsonl.gz files (one document per line), "
                         "or directories of them")
    pr.add_argument("--out", required=True, metavar="DIR", help="the dataset directory to create: a new name or an "
                    "empty directory (an earlier dataset with --force)")
    pr.add_argument("--force", action="store_true", help="replace --out if it is an earlier dataset (a directory "
                    "holding only a dataset's files; nothing else is ever deleted)")
    pr.add_argument("--tokenizer", default="bytes", metavar="SPEC",
                    help="'bytes' (UTF-8 bytes + EOS, vocab 257), a tokenizer.json file or a directory holding one, "
                         "or train:VOCAB (a byte-level BPE of VOCAB ids trained here on the inputs)")
    pr.add_argument("--text-field", default="text", metavar="NAME", help="the JSON field holding a record's text")
    pr.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), metavar="N",
                    help="encoding processes (default: the CPU cores, at most 8)")
    pr.add_argument("--split", default="file", choices=("file", "paragraph", "line"),
                    help="documents of a plain text file: the whole file, each paragraph (blank-line separated) "
                         "or each line")
    pr.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser

def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    handler = {"train": cmd_train, "plan": cmd_plan, "verify": cmd_verify, "report": cmd_report,
               "export": cmd_export, "sample": cmd_sample,
               "prepare": cmd_prepare, "calibrate": cmd_calibrate}[args.command]
    from mct.run.launch import WorkerLink
    link = WorkerLink.from_env()
    if _under_torchrun():
        link.setup()  # die with the launcher (or torchrun); tell the launcher this worker's pid
    code, line = 0, ""
    try:
        from mct.cli.conflicts import check_conflicts
        for warning in check_conflicts(args, argv):  # flags that contradict: one line naming both
            _warn(warning)
        code = handler(args, argv)
    except ValueError as e:
        code, line = 2, "mct: error: " + " ".join(str(e).split())  # one line, whatever the message held
    except OSError as e:  # a path the user named: missing, denied, full, damaged (mct.errors)
        from mct.errors import describe
        code, line = 2, "mct: error: " + " ".join(describe(e).split())
    except KeyboardInterrupt:
        code = 130
    link.finish(code, line)  # a no-op when train's worker already reported
    if line and not link.active:
        print(line, file=sys.stderr)
    return code
