"""Data: tokenizers, the embedded stdlib corpus, the synthetic retrieval task and the
packing loader. Typical use::

    tok = build_tokenizer(job.data.tokenizer)
    loader = build_dataloader(job.data, tok, seq_len=T, local_batch_size=B, rank=r, world_size=W, seed=s)
    batch = next(loader)  # {"input": [B, T] int64, "labels": [B, T] int64 (-100 = ignore), "is_retrieval": [B] bool}
"""

from .build import DATASETS, build_dataloader
from .corpus import TokenCorpus, hf_documents, stdlib_documents, text_file_documents, tokenize_documents
from .loader import PackedTextDataset, StatefulLoader, StreamingPackedDataset
from .retrieval import IGNORE_INDEX, RetrievalLayout, RetrievalTask, query_correct, retrieval_accuracy
from .tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer

__all__ = [
    "DATASETS",
    "IGNORE_INDEX",
    "ByteTokenizer",
    "HFTokenizer",
    "PackedTextDataset",
    "RetrievalLayout",
    "RetrievalTask",
    "StatefulLoader",
    "StreamingPackedDataset",
    "TokenCorpus",
    "build_dataloader",
    "build_tokenizer",
    "hf_documents",
    "query_correct",
    "retrieval_accuracy",
    "stdlib_documents",
    "text_file_documents",
    "tokenize_documents",
]
