"""An `hf:` model trains on its own tokens and comes back whole: a tiny Llama with a BPE
tokenizer trained here (bos <s>, eos </s>, pad <pad>, a post-processor that puts <s>
first), raw JSON Lines as data.path. The ids trained on are the tokenizer's encoding
plus EOS (never the JSON syntax, never bytes); `mct prepare --tokenizer DIR` gives the
same ids and no warning; a byte dataset is refused; RUN_DIR/hf and `mct export --format
hf` load with AutoTokenizer with the source's special tokens; `mct sample` equals
transformers' greedy `generate` on the run's weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from mct.config import EngineConfig  # noqa: E402
from mct.data import build_data  # noqa: E402
from mct.data.model_data import CACHE_DIR  # noqa: E402
from mct.run.trainer import train  # noqa: E402

SPECIAL = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"}
CHAT = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards hex bold jumping frogs".split()


def save_tiny_llama_with_tokenizer(d: Path, layers: int = 2, width: int = 32, positions: int = 64) -> Path:
    """A Llama of ``layers`` layers (``width`` wide, ``positions`` positions) whose
    vocabulary is a byte-level BPE of 320 ids trained here, saved with save_pretrained:
    tokenizer.json, tokenizer_config.json, a chat template, generation_config.json,
    model.safetensors (seed 7)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(WORDS)] * 20, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL)
    fast.chat_template = CHAT
    fast.save_pretrained(d)
    config = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=width, intermediate_size=2 * width,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=positions,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(7)
    LlamaForCausalLM(config).save_pretrained(d)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(d)
    return d


def _documents(n: int, seed: int) -> list[str]:
    rnd = np.random.default_rng(seed)
    return [" ".join(rnd.choice(WORDS, size=int(rnd.integers(20, 60)))) for _ in range(n)]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("owntok")
    save_tiny_llama_with_tokenizer(root / "llama")
    (root / "data").mkdir()
    for i in range(2):  # JSON Lines with a second field, as exported data often has
        lines = [json.dumps({"id": k, "text": t}) for k, t in enumerate(_documents(30, i))]
        (root / "data" / f"part{i}.jsonl").write_text("\n".join(lines) + "\n")
    return root


def _cfg(root: Path, data: Path, **train_keys) -> EngineConfig:
    return EngineConfig.from_dict({
        "seed": 3, "model": {"source": f"hf:{root / 'llama'}", "seq_len": 16},
        "data": {"path": str(data), "micro_batch_size": 2},
        "train": {"steps": 2, "warmup_steps": 1, "eval_every": 0, "log_every": 1, "checkpoint_every": 2,
                  "init_from": str(root / "llama"), **train_keys}})


def _split_documents(split) -> list[tuple[int, ...]]:
    """The documents of a prepared dataset's split (DocumentSpans), as id tuples."""
    cum = split.cum
    return [tuple(int(t) for t in split[int(cum[i]):int(cum[i + 1])]) for i in range(cum.size - 1)]


def test_raw_jsonl_trains_on_the_models_tokens_plus_eos(root, capsys):
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(str(root / "llama"))
    texts = [json.loads(line)["text"] for f in sorted((root / "data").glob("*.jsonl"))
             for line in f.read_text().splitlines()]
    want = sorted(tuple(hf(t)["input_ids"]) + (hf.eos_token_id,) for t in texts)
    assert all(w[0] == hf.bos_token_id for w in want)  # the tokenizer's own placement: <s> first
    corpus, sampler = build_data(_cfg(root, root / "data"))
    assert sorted(_split_documents(corpus.train) + _split_documents(corpus.val)) == want
    x, y = sampler.batch(0, 0, 0)
    assert int(x.max()) >= 256  # merged ids, not bytes
    assert "tokenizing" in capsys.readouterr().err
    again, _ = build_data(_cfg(root, root / "data"))  # the cache: same tokens, no second tokenization
    assert again.fingerprint == corpus.fingerprint and "tokenizing" not in capsys.readouterr().err
    assert len([p for p in (root / CACHE_DIR).iterdir() if p.is_dir()]) == 1


def test_one_text_file_is_cut_for_the_split_and_keeps_the_models_tokens(root):
    from transformers import AutoTokenizer
    text = " ".join(_documents(40, 5))
    (root / "one").mkdir()
    (root / "one" / "book.txt").write_text(text)
    corpus, _ = build_data(_cfg(root, root / "one" / "book.txt"))
    hf = AutoTokenizer.from_pretrained(str(root / "llama"))
    starts = [*corpus.train.starts.tolist(), *corpus.val.starts.tolist()]
    pieces = [*_split_documents(corpus.train), *_split_documents(corpus.val)]
    assert corpus.train.size > 0 and corpus.val.size > 0
    whole = [t for _, piece in sorted(zip(starts, pieces)) for t in piece]
    assert whole == hf(text)["input_ids"] + [hf.eos_token_id]  # one document: <s> text </s>, cut in two


def test_data_prepared_with_the_models_tokenizer_is_the_same_and_not_warned(root, capsys):
    from mct.cli import main
    build_data(_cfg(root, root / "data"))  # the cached tokens of the raw path
    assert main(["prepare", str(root / "data"), "--tokenizer", str(root / "llama"), "--out",
                 str(root / "ds")]) == 0
    cached = next(p for p in (root / CACHE_DIR).iterdir() if p.is_dir())
    assert (root / "ds" / "tokens.bin").read_bytes() == (cached / "tokens.bin").read_bytes()
    capsys.readouterr()
    train(_cfg(root, root / "ds"), root / "run_ds", progress=False)
    assert "warning" not in capsys.readouterr().err


def test_a_byte_dataset_or_a_tokenizer_mct_cannot_read_is_refused_in_one_line(root, tmp_path):
    from mct.data.pipeline import prepare
    prepare([str(root / "data")], str(tmp_path / "bytes"), tokenizer="bytes", progress=False)
    with pytest.raises(ValueError, match=r"holds UTF-8 bytes .*`mct prepare INPUT --tokenizer") as e:
        build_data(_cfg(root, tmp_path / "bytes"))
    assert "\n" not in str(e.value)
    spm = tmp_path / "spm"
    spm.mkdir()
    for name in ("config.json", "model.safetensors"):
        (spm / name).write_bytes((root / "llama" / name).read_bytes())
    (spm / "tokenizer.model").write_bytes(b"\0")
    cfg = _cfg(root, root / "data").to_dict()
    cfg["model"]["source"] = f"hf:{spm}"
    with pytest.raises(ValueError, match=r"no tokenizer.json .*`mct prepare"):
        build_data(EngineConfig.from_dict(cfg))


@pytest.fixture(scope="module")
def run(root) -> Path:
    run = root / "run"
    train(_cfg(root, root / "data"), run, progress=False)
    return run


def test_run_hf_dir_and_export_load_with_the_sources_special_tokens(root, run):
    from transformers import AutoTokenizer
    from mct.cli import main
    assert main(["export", str(run), "--format", "hf", "--out", str(root / "exported")]) == 0
    source = AutoTokenizer.from_pretrained(str(root / "llama"))
    for d in (run / "hf", root / "exported"):
        tok = AutoTokenizer.from_pretrained(str(d))
        assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "</s>", "<pad>")
        assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
            source.bos_token_id, source.eos_token_id, source.pad_token_id)
        assert tok.chat_template == CHAT
        assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] == 2


def test_sample_equals_transformers_greedy_generate_on_the_runs_weights(run, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from mct.cli import main
    assert main(["sample", str(run), "--prompt", "the quick", "--tokens", "20", "--temperature", "0"]) == 0
    got = capsys.readouterr().out[:-1]  # print's newline
    tok = AutoTokenizer.from_pretrained(str(run / "hf"))
    model = AutoModelForCausalLM.from_pretrained(str(run / "hf")).eval()
    x = tok("the quick", return_tensors="pt")
    assert int(x["input_ids"][0, 0]) == tok.bos_token_id
    with torch.no_grad():
        out = model.generate(**x, max_new_tokens=20, do_sample=False)
    assert got == tok.decode(out[0, 1:])
    assert main(["sample", str(run), "--tokens", "30", "--seed", "1"]) == 0  # sampled, from <s> alone
    capsys.readouterr()


def test_tokenizer_config_add_bos_and_add_eos_override_the_post_processor(root, tmp_path):
    from mct.data.tokenizer import resolve_tokenizer, tokenizer_identity
    (tmp_path / "tokenizer.json").write_bytes((root / "llama" / "tokenizer.json").read_bytes())
    assert resolve_tokenizer(str(tmp_path)).prefix == (1,)  # the post-processor's <s>, no config
    config = {**SPECIAL, "add_bos_token": False, "add_eos_token": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = resolve_tokenizer(str(tmp_path))
    assert (tok.prefix, tok.suffix, tok.closing()) == ((), (2,), (2,))  # the EOS ends a document once
    assert tokenizer_identity(tok.json) == tokenizer_identity((root / "llama" / "tokenizer.json").read_text())
