"""Tiny random decoder models (Qwen3-shaped), written as real Hugging Face folders in seconds: an embedder with
last-token pooling and an instruction prompt (a sentence-transformers folder, as Qwen3-Embedding is), a
Qwen3-Reranker-shaped causal LM, and a reranker converted to ``Qwen3ForSequenceClassification``.

The tokenizer is a byte-level BPE trained on generated text, with Qwen's special tokens, its ``<|endoftext|>``
as end, padding and (for the embedder) appended end-of-sequence token, and ``padding_side: left``, as the
Qwen3 embedding and reranking models ship theirs.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from tinymodel import WORDS

EOS = "<|endoftext|>"
SPECIALS = (EOS, "<|im_start|>", "<|im_end|>")
# Qwen3-Embedding's query prompt, as its config_sentence_transformers.json writes it.
QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
# Qwen3-Reranker's model card: the system/user/assistant template around the instruction, query and document.
RERANK_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and "
                 "the Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n"
                 "<|im_start|>user\n")
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def write_qwen_tokenizer(folder: Path, append_eos: bool, max_positions: int, padding_side: str = "left") -> int:
    """A Qwen-style fast tokenizer in ``folder``; returns its vocabulary size."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(2000)]
    lines += ["yes", "no", RERANK_PREFIX, RERANK_SUFFIX, QUERY_PROMPT] * 40
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    # Qwen2's split (letters, digits one by one, punctuation runs, newlines) then bytes, as its tokenizer.json.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                                   r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=1000, special_tokens=list(SPECIALS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    if append_eos:  # Qwen3-Embedding's tokenizer.json: the end-of-text token after every text
        eos = tok.token_to_id(EOS)
        tok.post_processor = processors.TemplateProcessing(single=f"$A {EOS}", pair=f"$A {EOS} $B:1 {EOS}:1",
                                                           special_tokens=[(EOS, eos)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    assert tok.token_to_id("yes") is not None and tok.token_to_id("no") is not None
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, unk_token=None,
                                   model_max_length=max_positions, padding_side=padding_side)
    fast.save_pretrained(folder)
    return int(tok.get_vocab_size())


def qwen3_config(vocab: int, max_positions: int, seed: int, model_type: str = "qwen3", **extra: Any) -> Any:
    """A tiny config of a decoder family (grouped key/value heads), ids of the Qwen-style tokenizer above."""
    import torch
    from transformers import AutoConfig

    torch.manual_seed(seed)
    # Large initial weights: a random model with the default 0.02 gives nearly equal vectors for every text.
    return AutoConfig.for_model(
        model_type, vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=max_positions,
        initializer_range=0.2, eos_token_id=0, pad_token_id=0, bos_token_id=None, **extra)


def write_qwen3_embedder(folder: Path, seed: int = 0, max_positions: int = 128, v6_pooling: bool = False,
                         padding_side: str = "left", model_type: str = "qwen3") -> Path:
    """A Qwen3-Embedding-shaped sentence-transformers folder: Qwen3 weights (or another decoder family's,
    ``model_type``), last-token pooling, Normalize, a query prompt; the EOS appended by the tokenizer
    (``v6_pooling``: the Pooling config sentence-transformers 6 writes, else the legacy keys)."""
    from transformers import AutoModel

    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_qwen_tokenizer(folder, append_eos=True, max_positions=max_positions, padding_side=padding_side)
    config = qwen3_config(vocab, max_positions, seed, model_type)
    AutoModel.from_config(config).eval().save_pretrained(folder)
    if model_type == "qwen3":
        cfg = json.loads((folder / "config.json").read_text())
        cfg["architectures"] = ["Qwen3ForCausalLM"]  # as Qwen3-Embedding's config.json says, over bare weights
        (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "2_Normalize").mkdir(exist_ok=True)
    pooling: dict[str, Any] = ({"embedding_dimension": 32, "pooling_mode": "lasttoken", "include_prompt": True}
                               if v6_pooling else
                               {"word_embedding_dimension": 32, "pooling_mode_cls_token": False,
                                "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
                                "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
                                "pooling_mode_lasttoken": True, "include_prompt": True})
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_positions,
                                                                  "do_lower_case": False}))
    (folder / "config_sentence_transformers.json").write_text(json.dumps({
        "prompts": {"query": QUERY_PROMPT, "document": ""}, "default_prompt_name": None,
        "similarity_fn_name": "cosine"}))
    return folder


def write_qwen3_reranker(folder: Path, seed: int = 0, max_positions: int = 256, tied: bool = False,
                         model_type: str = "qwen3") -> Path:
    """A Qwen3-Reranker-shaped causal LM: ``Qwen3ForCausalLM`` (or another family's, ``model_type``) with its LM
    head (``tied``: the input embeddings, as the 0.6B and 4B models), a tokenizer that appends nothing, no
    sentence-transformers files."""
    from transformers import AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_qwen_tokenizer(folder, append_eos=False, max_positions=max_positions)
    config = qwen3_config(vocab, max_positions, seed, model_type, tie_word_embeddings=tied)
    AutoModelForCausalLM.from_config(config).eval().save_pretrained(folder)
    return folder


def write_qwen3_seq_cls(folder: Path, seed: int = 0, max_positions: int = 256) -> Path:
    """A reranker converted to ``Qwen3ForSequenceClassification`` (one label; the head reads the last token that
    is not padding, so the config carries the padding id)."""
    from transformers import Qwen3ForSequenceClassification

    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_qwen_tokenizer(folder, append_eos=False, max_positions=max_positions)
    config = qwen3_config(vocab, max_positions, seed, num_labels=1)
    Qwen3ForSequenceClassification(config).eval().save_pretrained(folder)
    return folder


def model_card_scores(folder: Path, pairs: list[tuple[str, str]], instruction: str = RERANK_INSTRUCTION,
                      max_length: int = 256) -> list[float]:
    """Qwen3-Reranker's scores as its model card computes them: left-padded batch, P(yes) from the softmax over
    the "no" and "yes" logits at the last position."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    no, yes = tokenizer.convert_tokens_to_ids("no"), tokenizer.convert_tokens_to_ids("yes")
    prefix = tokenizer.encode(RERANK_PREFIX, add_special_tokens=False)
    suffix = tokenizer.encode(RERANK_SUFFIX, add_special_tokens=False)
    texts = [f"<Instruct>: {instruction}\n<Query>: {q}\n<Document>: {d}" for q, d in pairs]
    inputs = tokenizer(texts, padding=False, truncation="longest_first", return_attention_mask=False,
                       max_length=max_length - len(prefix) - len(suffix))
    inputs["input_ids"] = [prefix + ids + suffix for ids in inputs["input_ids"]]
    batch = tokenizer.pad(inputs, padding=True, return_tensors="pt")  # the card's max_length here is ignored
    with torch.no_grad():
        logits = model(**batch).logits[:, -1, :]
    pair = torch.nn.functional.log_softmax(torch.stack([logits[:, no], logits[:, yes]], dim=1), dim=1)
    return pair[:, 1].exp().tolist()
