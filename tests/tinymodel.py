"""A tiny random BERT, written as a real Hugging Face folder (safetensors + tokenizer.json), in seconds."""

from __future__ import annotations

import json
from pathlib import Path

WORDS = tuple(
    "the a an is are was be to of and in on for with that this it as at by from or not but all any can "
    "hello world model service batch queue request response text long short sentence token vector "
    "embedding fast slow cat dog house tree river mountain city car run walk read write test data "
    "inference server client network memory error ok yes no one two three four five six seven eight"
    .split()
)
CJK = (
    "我你他她们的是不了在有人这中大为上个国和地到以说时要就出会可也子对生能而那得于着下自之年过发后作里用"
    "道行所然家种事成方多经么去法学如都同现当没动面起看定天分还进好小部其些主样理心本前开但因只从想实日者"
    "意无力它与长把机十民第公此已工使情明性知全三又关点正业外将两高间由问很最重并物手应向头文体"
)


def write_tiny_bert(folder: Path, seed: int = 0, hidden: int = 32, layers: int = 2, max_positions: int = 128,
                    pooling: str = "mean", normalize: bool = True, pickle_weights: bool = False) -> Path:
    """A random BertModel + fast tokenizer + sentence-transformers files; outputs differ per seed."""
    import torch
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *dict.fromkeys(CJK)]
    vocab += [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"] + list("abcdefghijklmnopqrstuvwxyz0123456789.,!?'")
    vocab = list(dict.fromkeys(vocab))
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    ids = {tok: i for i, tok in enumerate(vocab)}
    backend = Tokenizer(WordPiece(ids, unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True, handle_chinese_chars=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
        mask_token="[MASK]", model_max_length=max_positions)
    tokenizer.save_pretrained(folder)
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=len(vocab), hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=4, intermediate_size=hidden * 2,
                        max_position_embeddings=max_positions)
    model = BertModel(config).eval()
    model.save_pretrained(folder, safe_serialization=not pickle_weights)
    if pickle_weights:
        for f in folder.glob("*.safetensors"):
            f.unlink()
        if not (folder / "pytorch_model.bin").exists():
            torch.save(model.state_dict(), folder / "pytorch_model.bin")
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": hidden, "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False}))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_positions,
                                                                  "do_lower_case": False}))
    return folder


def _tiny_encoder_config(folder: Path, seed: int, hidden: int, layers: int, max_positions: int) -> tuple:
    """The tokenizer files written into ``folder``, and a BertConfig sized for its vocabulary."""
    import torch
    from transformers import BertConfig

    write_tiny_bert(folder, seed=seed, hidden=hidden, layers=layers, max_positions=max_positions)
    # Only the tokenizer is kept from the embedding folder: the weights and ST files are replaced below.
    for name in ("modules.json", "sentence_bert_config.json", "model.safetensors", "config.json"):
        (folder / name).unlink(missing_ok=True)
    for sub in ("1_Pooling", "2_Normalize"):
        if (folder / sub).is_dir():
            for f in (folder / sub).iterdir():
                f.unlink()
            (folder / sub).rmdir()
    vocab = (folder / "vocab.txt").read_text(encoding="utf-8").splitlines()
    # As a BERT tokenizer's: segment ids go to the model, so a pair's document is told from its query.
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    tok_cfg["model_input_names"] = ["input_ids", "token_type_ids", "attention_mask"]
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    torch.manual_seed(seed)
    return BertConfig(vocab_size=len(vocab), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                      intermediate_size=hidden * 2, max_position_embeddings=max_positions, type_vocab_size=2,
                      initializer_range=0.2)


def write_tiny_cross_encoder(folder: Path, seed: int = 0, hidden: int = 32, layers: int = 2,
                             max_positions: int = 64, activation: str | None = "torch.nn.modules.activation.Sigmoid"
                             ) -> Path:
    """A random BertForSequenceClassification with one label and a sentence-transformers CrossEncoder config
    (``activation`` None writes none: the reader's default applies)."""
    from transformers import BertForSequenceClassification

    config = _tiny_encoder_config(folder, seed, hidden, layers, max_positions)
    config.num_labels = 1
    BertForSequenceClassification(config).eval().save_pretrained(folder)
    if activation is not None:
        cfg = json.loads((folder / "config.json").read_text())
        cfg["sentence_transformers"] = {"activation_fn": activation, "version": "4.0.0"}
        (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder


def write_tiny_classifier(folder: Path, seed: int = 0, labels: tuple[str, ...] = ("negative", "neutral", "positive"),
                          multi_label: bool = False, hidden: int = 32, layers: int = 2,
                          max_positions: int = 64) -> Path:
    """A random BertForSequenceClassification with ``labels`` in id2label (multi-label: the config says so)."""
    from transformers import BertForSequenceClassification

    config = _tiny_encoder_config(folder, seed, hidden, layers, max_positions)
    config.num_labels = len(labels)
    config.id2label = dict(enumerate(labels))
    config.label2id = {label: i for i, label in enumerate(labels)}
    if multi_label:
        config.problem_type = "multi_label_classification"
    BertForSequenceClassification(config).eval().save_pretrained(folder)
    return folder


def write_tiny_modernbert(folder: Path, seed: int = 0, max_positions: int = 8192, cross_encoder: bool = False) -> Path:
    """A random ModernBERT with its long context (8,192 positions: rotary, so no position table to store) and
    sliding-window layers (two in three, a 128-token window), as a sentence-transformers embedder (mean pooling,
    Normalize) or, ``cross_encoder``, a ModernBertForSequenceClassification with one label; the tiny BERT's
    tokenizer."""
    import torch
    from transformers import ModernBertConfig, ModernBertForSequenceClassification, ModernBertModel

    write_tiny_bert(folder, seed=seed, max_positions=max_positions)
    (folder / "model.safetensors").unlink()
    vocab = (folder / "vocab.txt").read_text(encoding="utf-8").splitlines()
    torch.manual_seed(seed)
    config = ModernBertConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                              num_attention_heads=4, max_position_embeddings=max_positions, pad_token_id=0,
                              cls_token_id=2, sep_token_id=3, bos_token_id=2, eos_token_id=3,
                              global_attn_every_n_layers=3, local_attention=128, initializer_range=0.2)
    if not cross_encoder:
        ModernBertModel(config).eval().save_pretrained(folder)
        return folder
    for name in ("modules.json", "sentence_bert_config.json", "1_Pooling/config.json"):
        (folder / name).unlink()
    (folder / "1_Pooling").rmdir()
    config.num_labels = 1
    ModernBertForSequenceClassification(config).eval().save_pretrained(folder)
    return folder


def write_st_v6(folder: Path, source: Path, pooling: str | list[str] = "mean", dense: int | None = None,
                activation: str = "Tanh", normalize: bool = True, include_prompt: bool = True,
                prompts: dict[str, str] | None = None, default_prompt_name: str | None = None,
                similarity: str | None = None, seed: int = 0) -> Path:
    """The Hugging Face model of ``source`` saved by sentence-transformers 6 itself (``pooling_mode``, module
    types under ``sentence_transformers.base``...): Transformer, Pooling, an optional Dense of ``dense`` outputs
    with torch's ``activation``, an optional Normalize."""
    import warnings

    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules.dense import Dense
    from sentence_transformers.base.modules.normalize import Normalize
    from sentence_transformers.base.modules.transformer import Transformer
    from sentence_transformers.sentence_transformer.modules.pooling import Pooling

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformer = Transformer(str(source))
        size = transformer.get_embedding_dimension()
        modules: list[torch.nn.Module] = [transformer, Pooling(size, pooling_mode=pooling,
                                                               include_prompt=include_prompt)]
        if dense is not None:
            torch.manual_seed(seed)
            width = size * (1 if isinstance(pooling, str) else len(pooling))
            modules.append(Dense(width, dense, activation_function=getattr(torch.nn, activation)()))
        if normalize:
            modules.append(Normalize())
        model = SentenceTransformer(modules=modules, device="cpu", prompts=prompts,
                                    default_prompt_name=default_prompt_name, similarity_fn_name=similarity)
        model.save(str(folder), create_model_card=False)  # the card costs a third of a second and says nothing here
    return folder


def write_st_legacy(folder: Path, source: Path, pooling: tuple[str, ...] = ("mean",), dense: int | None = None,
                    activation: str = "torch.nn.modules.activation.Tanh", normalize: bool = True,
                    pickle_dense: bool = False, seed: int = 0) -> Path:
    """``source``'s Hugging Face files with the sentence-transformers 2-4 files written by hand: module types
    ``sentence_transformers.models.*``, the Pooling's ``pooling_mode_*`` booleans, a Dense's weights as
    safetensors or (``pickle_dense``) the ``pytorch_model.bin`` older releases wrote."""
    import shutil

    import torch
    from safetensors.torch import save_file

    keys = {"cls": "pooling_mode_cls_token", "max": "pooling_mode_max_tokens", "mean": "pooling_mode_mean_tokens",
            "mean_sqrt_len_tokens": "pooling_mode_mean_sqrt_len_tokens",
            "weightedmean": "pooling_mode_weightedmean_tokens", "lasttoken": "pooling_mode_lasttoken"}
    shutil.copytree(source, folder, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("modules.json", "1_Pooling", "2_Normalize"))
    config = json.loads((folder / "config.json").read_text())
    size = config.get("hidden_size") or config["dim"]  # DistilBERT names it dim
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": size, **{key: mode in pooling for mode, key in keys.items()}}))
    if dense is not None:
        torch.manual_seed(seed)
        width = size * len(pooling)
        sub = folder / "2_Dense"
        sub.mkdir(exist_ok=True)
        (sub / "config.json").write_text(json.dumps({"in_features": width, "out_features": dense, "bias": True,
                                                     "activation_function": activation}))
        state = {"linear.weight": torch.randn(dense, width) / width ** 0.5, "linear.bias": torch.randn(dense) / 10}
        if pickle_dense:
            torch.save(state, sub / "pytorch_model.bin")
        else:
            save_file(state, str(sub / "model.safetensors"))
        modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    if normalize:
        n = len(modules)
        modules.append({"idx": n, "name": str(n), "path": f"{n}_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    return folder


def write_tiny_colbert(folder: Path, seed: int = 7, dim: int = 16, query_length: int = 12,
                       document_length: int = 24) -> Path:
    """PyLate's ColBERT layout, tiny: the encoder (its vocabulary grown by the [Q] and [D] markers), a bias-free Dense
    projection of every token, and the markers, lengths and skiplist in config_sentence_transformers.json."""
    import shutil

    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, BertModel

    write_tiny_bert(folder, seed=seed, max_positions=64)
    shutil.rmtree(folder / "1_Pooling")
    shutil.rmtree(folder / "2_Normalize", ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens(["[Q] ", "[D] "])
    tokenizer.save_pretrained(folder)
    model = BertModel.from_pretrained(folder)
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(folder)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense.Dense"}]))
    (folder / "1_Dense").mkdir()
    (folder / "1_Dense" / "config.json").write_text(json.dumps(
        {"in_features": 32, "out_features": dim, "bias": False,
         "activation_function": "torch.nn.modules.linear.Identity", "use_residual": False}))
    torch.manual_seed(seed)
    save_file({"linear.weight": torch.randn(dim, 32) / 4}, str(folder / "1_Dense" / "model.safetensors"))
    (folder / "config_sentence_transformers.json").write_text(json.dumps(
        {"query_prefix": "[Q] ", "document_prefix": "[D] ", "query_length": query_length,
         "document_length": document_length, "attend_to_expansion_tokens": False, "do_query_expansion": True,
         "skiplist_words": [",", ".", "!", ";"], "similarity_fn_name": "MaxSim"}))
    return folder
