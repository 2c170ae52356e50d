"""What the model reads: corpus sources and tokenizer (``corpus``), the document-level
train/validation split, and the stateless window sampler (``sampler``)."""

from mct.data.corpus import ByteTokenizer, Corpus, load_corpus
from mct.data.sampler import BatchSampler, build_data

__all__ = ["BatchSampler", "ByteTokenizer", "Corpus", "build_data", "load_corpus"]
