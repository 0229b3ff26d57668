"""Data: tokenizers, the embedded stdlib corpus, local files, streamed Hugging Face datasets, the synthetic
retrieval task and the resumable loader. Typical use::

    tok = tokenizer_from_config(job.data)
    loader = build_dataloader(job.data, tok, seq_len=T, local_batch_size=B, rank=r, world_size=W, seed=s,
                              num_workers=job.data.num_workers)
    batch = next(loader)  # {"input": [B, T] int64, "labels": [B, T] int64 (-100 = ignore), "is_retrieval": [B] bool}
"""

from .build import DATASETS, build_dataloader
from .corpus import TokenCorpus, stdlib_documents, text_file_documents, tokenize_documents
from .dataloader import StatefulLoader, torchdata_available
from .loader import BatchAssembler, MapBatches, PackedTextDataset
from .retrieval import IGNORE_INDEX, RetrievalLayout, RetrievalTask, query_correct, retrieval_accuracy
from .tokenizer import ByteTokenizer, HFTokenizer, TiktokenTokenizer, build_tokenizer, tokenizer_from_config

__all__ = [
    "DATASETS",
    "IGNORE_INDEX",
    "BatchAssembler",
    "ByteTokenizer",
    "HFTokenizer",
    "MapBatches",
    "PackedTextDataset",
    "RetrievalLayout",
    "RetrievalTask",
    "StatefulLoader",
    "TiktokenTokenizer",
    "TokenCorpus",
    "build_dataloader",
    "build_tokenizer",
    "query_correct",
    "retrieval_accuracy",
    "stdlib_documents",
    "text_file_documents",
    "tokenize_documents",
    "tokenizer_from_config",
    "torchdata_available",
]
