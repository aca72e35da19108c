"""Datasets for every stage: formats, tokenization, collation, packing, sampling, the built-in task.

Modules: ``formats`` (files -> validated records, auto-detection), ``encode`` (records ->
token ids and loss masks, truncation), ``collate`` (padding collators and SFT packing),
``sampler`` (the resumable :class:`DataIterator`), ``task`` (the built-in addition task and
its tokenizer), ``pipeline`` (config -> encoded train/eval splits).
"""

from aligner.data.collate import collate_pairs, collate_prompts, collate_sft, pack_sft
from aligner.data.encode import EncodeResult, encode_records, prompt_ids
from aligner.data.formats import FORMATS, LoadResult, detect_format, load_records
from aligner.data.pipeline import DataSplits, load_data, resolve_tokenizer, task_paths
from aligner.data.sampler import DataIterator
from aligner.data.task import build_task_tokenizer, check_answer, write_task_files

__all__ = [
    "FORMATS",
    "DataIterator",
    "DataSplits",
    "EncodeResult",
    "LoadResult",
    "build_task_tokenizer",
    "check_answer",
    "collate_pairs",
    "collate_prompts",
    "collate_sft",
    "detect_format",
    "encode_records",
    "load_data",
    "load_records",
    "pack_sft",
    "prompt_ids",
    "resolve_tokenizer",
    "task_paths",
    "write_task_files",
]
