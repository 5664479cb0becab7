"""loong-data: text corpora tokenised to memory-mapped files, packed LM samples, DP batch sampling.

    from loong_data import (DistributedBatchSampler, PackedTextDataset, collate, default_corpus,
                            default_tokenizer, load_tokenizer, prepare_text_dataset)
    tok = load_tokenizer(default_tokenizer())
    corpus = prepare_text_dataset(default_corpus(), tok, "outputs/shakespeare")
    ds = PackedTextDataset(corpus.train, seq_length=256)
    sampler = DistributedBatchSampler(len(ds), micro_batch_size=4, num_microbatches=2,
                                      dp_rank=0, dp_size=1, seed=0)
    microbatches = next(iter(sampler))
    batch = collate([ds[i] for i in microbatches[0]])   # tokens, labels, loss_mask, position_ids

Variable-length samples packed into THD sequences (no attention across samples):

    docs = DocumentDataset(corpus.train, max_length=256, lengths=LogNormalLengths(median=64, sigma=1.0))
    idx = microbatches[0]
    packs = FirstFitDecreasing().pack([int(docs.lengths[i]) for i in idx], capacity=256)
    batch = collate_packed([docs[idx[j]] for j in packs[0]], capacity=256)  # + cu_seqlens, max_seqlen

Vision-language conversations (WebDataset shards, images/videos, chat template): ``loong_data.multimodal``.
"""

from loong_data.bundled import (
    default_chat_tokenizer,
    default_corpus,
    default_multimodal_dataset,
    default_tokenizer,
)
from loong_data.collate import collate
from loong_data.documents import DocumentDataset
from loong_data.errors import DataError
from loong_data.lengths import LogNormalLengths
from loong_data.packed import PackedTextDataset
from loong_data.packed_collate import collate_packed, padded_length
from loong_data.packing import (
    STRATEGIES,
    FirstFitDecreasing,
    PackingStrategy,
    SequentialPacking,
    packing_strategy,
    padding_fraction,
)
from loong_data.prepare import TokenizedCorpus, prepare_text_dataset
from loong_data.sampler import DistributedBatchSampler
from loong_data.token_file import TokenFile
from loong_data.tokenizer import EOD_TOKEN, PAD_TOKEN, TextTokenizer, load_tokenizer

__version__ = "0.1.0"
__all__ = [
    "EOD_TOKEN",
    "PAD_TOKEN",
    "STRATEGIES",
    "DataError",
    "DistributedBatchSampler",
    "DocumentDataset",
    "FirstFitDecreasing",
    "LogNormalLengths",
    "PackedTextDataset",
    "PackingStrategy",
    "SequentialPacking",
    "TextTokenizer",
    "TokenFile",
    "TokenizedCorpus",
    "collate",
    "collate_packed",
    "padded_length",
    "default_chat_tokenizer",
    "default_corpus",
    "default_multimodal_dataset",
    "default_tokenizer",
    "load_tokenizer",
    "packing_strategy",
    "padding_fraction",
    "prepare_text_dataset",
]
