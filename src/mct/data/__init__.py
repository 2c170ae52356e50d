"""What the model reads: inputs (``sources``), tokenizers (``tokenizer``), the prepared
dataset format (``dataset``: its writer and reader) and the ``mct prepare`` pipeline (``pipeline``); corpus
loading with the document-level train/validation split (``corpus``), and the stateless
window sampler (``sampler``)."""

from mct.data.corpus import ByteTokenizer, Corpus, load_corpus
from mct.data.sampler import BatchSampler, build_data
from mct.data.tokenizer import copy_tokenizer

__all__ = ["BatchSampler", "ByteTokenizer", "Corpus", "build_data", "copy_tokenizer", "load_corpus"]
