"""The rerank task served by a causal LM that answers "yes" or "no" (Qwen3-Reranker): (query, document) pairs in,
one relevance score per pair out, on the same routes as a cross-encoder (/v1/rerank, /rerank, /predict).

As its model card computes it: each pair is written into the model's chat template (a system turn asking for
"yes" or "no", a user turn with the instruction, query and document, an open assistant turn), and the score is
P(yes), the softmax over the "no" and "yes" logits at the last position. That is sigmoid(yes - no), so only the
two rows of the LM head matter: the task reads them from the checkpoint at load and scores the decoder's last
hidden state against their difference, instead of computing logits over the whole vocabulary. The raw score
(TEI's ``raw_scores``) is that difference, the log-odds, as a cross-encoder's is its logit before the sigmoid.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from inferd.core.backends.base import Runner
from inferd.core.description import Loaded, ModelDescription, TaskFacts
from inferd.core.errors import ModelLoadError
from inferd.core.families import family_of
from inferd.core.preprocess import Encoded, InputError
from inferd.core.spec import ModelSpec
from inferd.core.tasks.base import ModelTask, check_weights, length_limit, load_tokenizer
from inferd.core.text_options import PLAIN_INPUTS, InputOptions

# Qwen3-Reranker's model card, verbatim: the template around each pair and the instruction it uses by default.
PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
          "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
PAIR = "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
# The model card's max_length: the model's position table (40,960) is far past what it was trained to rank.
CARD_MAX_LENGTH = 8192
# The chat template is Qwen's; another family's LLM reranker has its own template and answer tokens.
MODEL_TYPES = ("qwen2", "qwen3")
TEMPLATE_TOKENS = ("<|im_start|>", "<|im_end|>")


def is_causal_lm(path: Path) -> bool:
    try:
        archs = json.loads((path / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return False
    return any(str(a).endswith("ForCausalLM") for a in archs)


def head_rows(path: Path, safetensors: bool, tied: bool, rows: list[int]) -> torch.Tensor:
    """Rows of the LM head (the input embeddings where the checkpoint ties them and stores no head), float32,
    read from the checkpoint without loading the rest."""
    names = ("lm_head.weight", "model.embed_tokens.weight", "embed_tokens.weight")
    if safetensors:
        from safetensors import safe_open

        found: dict[str, torch.Tensor] = {}
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for name in names:
                    if name in f.keys():  # noqa: SIM118 (a safetensors handle has no __contains__)
                        sliced = f.get_slice(name)
                        found[name] = torch.cat([sliced[r: r + 1] for r in rows])
    else:
        state: dict[str, torch.Tensor] = {}
        for file in sorted(path.glob("pytorch_model*.bin")):
            state.update(torch.load(file, map_location="cpu", weights_only=True, mmap=True))
        found = {name: state[name][rows] for name in names if name in state}
    if "lm_head.weight" in found:
        return found["lm_head.weight"].float()
    embed = found.get("model.embed_tokens.weight", found.get("embed_tokens.weight"))
    if tied and embed is not None:
        return embed.float()
    raise ModelLoadError(f"{path}: no LM head (lm_head.weight) in the checkpoint: not a causal LM's weights")


class LLMRerankHandler(ModelTask):
    """A Qwen3-Reranker-shaped ``*ForCausalLM``: its decoder's last hidden state at the last token, scored
    against the "yes" row of its LM head less the "no" row."""

    task = "rerank"
    inputs = "pairs"
    head = "hidden"

    def load(self, spec: ModelSpec, device: torch.device) -> Loaded:
        safetensors = check_weights(spec.path, spec.allow_pickle)
        config, tokenizer = load_tokenizer(spec.path)
        family_kind = family_of(spec.path).kind
        if family_kind != "decoder" or config.model_type not in MODEL_TYPES:
            raise ModelLoadError(f"{spec.path}: an LLM reranker follows Qwen3-Reranker's chat template, for "
                                 f"{', '.join(MODEL_TYPES)} models; this one is {config.model_type!r}")
        if (spec.path / "modules.json").is_file():
            raise ModelLoadError(f"{spec.path}: a sentence-transformers CrossEncoder folder over a causal LM "
                                 "(modules.json) is not read; serve the model's own folder, or its "
                                 "*ForSequenceClassification conversion")
        if getattr(config, "final_logit_softcapping", None):
            raise ModelLoadError(f"{spec.path}: logits soft-capped by the model: the yes/no score is not linear "
                                 "in its last hidden state")
        self.max_seq_length = length_limit(config, tokenizer, spec.max_seq_length or CARD_MAX_LENGTH)
        self.pad_id = tokenizer.pad_token_id or 0
        self.tokenizer: Tokenizer = tokenizer.backend_tokenizer
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        missing = [t for t in (*TEMPLATE_TOKENS, "yes", "no") if t not in vocab]
        if missing:
            raise ModelLoadError(f"{spec.path}: the tokenizer has no {', '.join(missing)} token: not a "
                                 "Qwen3-Reranker-shaped model")
        self.yes, self.no = vocab["yes"], vocab["no"]
        rows = head_rows(spec.path, safetensors, bool(getattr(config, "tie_word_embeddings", False)),
                         [self.yes, self.no])
        self.direction = rows[0] - rows[1]
        self.prefix = self.tokenizer.encode(PREFIX, add_special_tokens=False).ids
        self.suffix = self.tokenizer.encode(SUFFIX, add_special_tokens=False).ids
        room = self.max_seq_length - len(self.prefix) - len(self.suffix)
        if room < 16:
            raise ModelLoadError(f"{spec.path}: max_seq_length {self.max_seq_length} leaves {room} tokens for the "
                                 "query and document after the template")
        self.truncate, self.room = spec.truncate, room
        self._pairs = Tokenizer.from_str(self.tokenizer.to_str())
        self._pairs.no_padding()
        self._pairs.enable_truncation(room)  # the card cuts the formatted pair's end: the document's
        self.instruction = spec.settings.rerank_instruction or INSTRUCTION
        return self.open_runner(spec, device, safetensors)  # last: see ModelTask

    def facts(self) -> TaskFacts:
        return TaskFacts(other={"activation": "Sigmoid", "scoring": "llm-yes-no", "instruction": self.instruction})

    def incompatibility(self, serving: ModelDescription, allow_change: bool) -> str | None:
        return None  # scores are ranked within one request, as a cross-encoder's

    def preprocess(self, pairs: list[tuple[str, str]], options: InputOptions = PLAIN_INPUTS) -> list[Encoded]:
        # The formatted pair's end is cut, as the model card cuts it: a document's own cut side and truncate (its
        # options) do not apply to a template.
        self._check_room(pairs)
        texts = [PAIR.format(instruction=self.instruction, query=q, document=d) for q, d in pairs]
        out = []
        for i, enc in enumerate(self._pairs.encode_batch(texts)):
            truncated = bool(enc.overflowing)
            if truncated and not self.truncate:
                raise InputError(i, f"the query and this document are longer than the model's limit of "
                                 f"{self.max_seq_length} tokens with its template (truncation is off)",
                                 "context_length_exceeded")
            out.append(Encoded(self.prefix + enc.ids + self.suffix, truncated))
        return out

    def document_room(self, query: str) -> int | None:
        head = PAIR.format(instruction=self.instruction, query=query, document="").rstrip()
        return max(0, self.room - len(self._pairs.encode(head).ids))

    def _check_room(self, pairs: list[tuple[str, str]]) -> None:
        """Refuses a query that leaves no room for its document: the card cuts the formatted pair's end, so the
        document would be cut away whole and every document of the request scored alike (a cross-encoder refuses
        what it cannot fit, naming its limit; truncation on or off, nothing here could be ranked)."""
        seen: set[str] = set()
        for i, (query, _) in enumerate(pairs):
            if query in seen:
                continue
            seen.add(query)
            head = PAIR.format(instruction=self.instruction, query=query, document="").rstrip()
            enc = self._pairs.encode(head)
            if enc.overflowing or len(enc.ids) >= self.room:
                raise InputError(i, f"the query leaves no room for a document: with the instruction it fills the "
                                 f"{self.room} tokens the model's limit of {self.max_seq_length} (max_seq_length) "
                                 "leaves after its template; send a shorter query", "context_length_exceeded")

    def forward(self, runner: Runner, batch: list[Encoded]) -> np.ndarray:
        """[P(yes), yes - no logit] per pair; the batch is padded on the right, so a row's last real token is at
        its length less one (a causal model's real tokens never see the padding after them)."""
        ids, mask, _ = self.collate(batch)
        with torch.inference_mode():
            hidden = runner(ids, mask)
            last = torch.tensor([e.tokens - 1 for e in batch], device=hidden.device)
            final = hidden[torch.arange(len(batch), device=hidden.device), last].float()
            raw = final @ self.direction.to(final.device)
            return torch.stack([torch.sigmoid(raw), raw], dim=1).cpu().numpy()

    def postprocess(self, outputs: np.ndarray) -> list[np.ndarray]:
        """Per pair: [score, raw log-odds] (TEI's ``raw_scores`` asks for the second)."""
        return list(outputs)

    def warmup(self) -> None:
        self.infer(self.preprocess([("warm up", "a document"), ("warm up", "a longer document to pad")]))
