"""loong-data: text corpora tokenised to memory-mapped files, packed LM samples, DP batch sampling.

    from loong_data import (DistributedBatchSampler, PackedTextDataset, collate, default_corpus,
                            default_tokenizer, load_tokenizer, prepare_text_dataset)
    tok = load_tokenizer(default_tokenizer())
    corpus = prepare_text_dataset(default_corpus(), tok, "outputs/shakespeare")
    ds = PackedTextDataset(corpus.train, seq_len=256)
    sampler = DistributedBatchSampler(len(ds), micro_batch_size=4, num_microbatches=2,
                                      dp_rank=0, dp_size=1, seed=0)
    microbatches = next(iter(sampler))
    batch = collate([ds[i] for i in microbatches[0]])   # tokens, labels, loss_mask, position_ids
"""

from loong_data.bundled import default_corpus, default_tokenizer
from loong_data.collate import collate
from loong_data.packed import PackedTextDataset
from loong_data.prepare import TokenizedCorpus, prepare_text_dataset
from loong_data.sampler import DistributedBatchSampler
from loong_data.token_file import TokenFile
from loong_data.tokenizer import EOD_TOKEN, PAD_TOKEN, TextTokenizer, load_tokenizer

__version__ = "0.1.0"
__all__ = [
    "EOD_TOKEN",
    "PAD_TOKEN",
    "DistributedBatchSampler",
    "PackedTextDataset",
    "TextTokenizer",
    "TokenFile",
    "TokenizedCorpus",
    "collate",
    "default_corpus",
    "default_tokenizer",
    "load_tokenizer",
    "prepare_text_dataset",
]
