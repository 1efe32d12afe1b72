"""The unpadded torch forward pass on the tiny random BERT: equal to the padded one, padding never computed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from inferd.core.backends.base import BackendError, BackendOptions
from inferd.core.backends.factory import open_backend
from inferd.core.backends.torch import TorchRunner
from inferd.core.backends.varlen import (
    Attention,
    VarlenRunner,
    attention_padded,
    attention_per_sequence,
    choose,
    forward,
    pack,
)
from inferd.core.loading import load_handler
from inferd.core.spec import ModelSpec
from inferd.core.tasks.embedding import EmbeddingHandler
from inferd.corpus import texts as corpus_texts

CPU = torch.device("cpu")
MIXED = corpus_texts(32, seed=7)  # English, Chinese and mixed, 5 to 250 words: many hit the tiny limit


@pytest.fixture(scope="module")
def handler(tiny_model: Path) -> Iterator[EmbeddingHandler]:
    h = load_handler(ModelSpec(path=tiny_model, name="tiny", version="v1", device="cpu", warmup=False))
    yield h  # type: ignore[misc]
    h.close()


@pytest.fixture(scope="module")
def padded(handler: EmbeddingHandler) -> TorchRunner:
    """transformers' own forward pass over the padded batch: the reference."""
    return TorchRunner(handler.runner.model, CPU)


@pytest.fixture(scope="module")
def unpadded(handler: EmbeddingHandler) -> VarlenRunner:
    return VarlenRunner(handler.runner.model, CPU)


def cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def shapes(handler: EmbeddingHandler) -> dict[str, list]:
    long = " ".join(MIXED)
    return {"1 text": handler.preprocess(MIXED[:1]), "32 mixed": handler.preprocess(MIXED),
            "at the limit": handler.preprocess([long, long[len(long) // 3:], MIXED[3]])}


def test_the_shapes_hold_padding_and_the_limit(handler: EmbeddingHandler) -> None:
    s = shapes(handler)
    mixed = [e.tokens for e in s["32 mixed"]]
    assert min(mixed) < 20 and max(mixed) == handler.max_seq_length
    assert [e.tokens for e in s["at the limit"]][:2] == [handler.max_seq_length] * 2


def test_pooled_outputs_match_the_padded_forward_at_every_shape(handler: EmbeddingHandler, padded: TorchRunner,
                                                                 unpadded: VarlenRunner) -> None:
    for name, batch in shapes(handler).items():
        want, got = handler.forward(padded, batch), handler.forward(unpadded, batch)
        assert cos(want, got).min() >= 0.9999, name


def test_every_real_token_matches_and_padding_is_zero(handler: EmbeddingHandler, padded: TorchRunner,
                                                      unpadded: VarlenRunner) -> None:
    ids, mask, _ = handler.collate(handler.preprocess(MIXED))
    want, got = padded(ids, mask), unpadded(ids, mask)
    assert got.shape == want.shape
    keep = mask.bool()
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-4, atol=1e-5)
    assert not got[~keep].any()


def test_a_text_gets_the_same_output_alone_and_in_any_batch(handler: EmbeddingHandler,
                                                             unpadded: VarlenRunner) -> None:
    batch = handler.preprocess(MIXED)
    together = handler.forward(unpadded, batch)
    alone = np.stack([handler.forward(unpadded, [e])[0] for e in batch])
    reversed_ = handler.forward(unpadded, batch[::-1])[::-1]
    assert cos(alone, together).min() >= 0.99999
    assert cos(reversed_, together).min() >= 0.99999


def test_segment_ids_reach_the_embeddings(handler: EmbeddingHandler, padded: TorchRunner,
                                          unpadded: VarlenRunner) -> None:
    ids, mask, _ = handler.collate(handler.preprocess(MIXED[:4]))
    segments = (torch.arange(ids.shape[1]) >= 3).long().expand_as(ids) * mask
    keep = mask.bool()
    want = padded(ids, mask, segments)
    torch.testing.assert_close(unpadded(ids, mask, segments)[keep], want[keep], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(unpadded(ids, mask)[keep], want[keep], atol=1e-3)


def test_any_mask_works_not_only_right_padding(handler: EmbeddingHandler, padded: TorchRunner,
                                               unpadded: VarlenRunner) -> None:
    """Positions are the column, as transformers numbers them: left padding gives transformers' outputs too."""
    ids, mask, _ = handler.collate(handler.preprocess(MIXED[:6]))
    lengths = mask.sum(dim=1)
    left_ids, left_mask = torch.zeros_like(ids), torch.zeros_like(mask)
    for row, n in enumerate(lengths.tolist()):
        left_ids[row, ids.shape[1] - n:] = ids[row, :n]
        left_mask[row, ids.shape[1] - n:] = 1
    keep = left_mask.bool()
    want = padded(left_ids, left_mask)
    torch.testing.assert_close(unpadded(left_ids, left_mask)[keep], want[keep], rtol=1e-4, atol=1e-5)


def test_padded_positions_are_never_computed(handler: EmbeddingHandler, padded: TorchRunner,
                                             unpadded: VarlenRunner) -> None:
    """What ``pads`` says: an id no embedding table holds, at every padded position, breaks the padded
    forward pass (it looks padding up) and changes nothing in the unpadded one (it never reads it)."""
    assert padded.capabilities.pads is True and unpadded.capabilities.pads is False
    ids, mask, _ = handler.collate(handler.preprocess(MIXED[:8]))
    poisoned = ids.masked_fill(~mask.bool(), 10**9)
    with pytest.raises(IndexError):
        padded(poisoned, mask)
    torch.testing.assert_close(unpadded(poisoned, mask), unpadded(ids, mask), rtol=0, atol=0)


def test_pack_lists_each_rows_slice() -> None:
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    packed = pack(mask)
    assert packed.offsets == (0, 3, 4, 8)
    assert packed.index.tolist() == [0, 1, 2, 4, 8, 9, 10, 11]
    assert packed.shape == (3, 4) and not packed.full
    assert pack(torch.ones(2, 5)).full  # texts of one length: packing is a reshape


@pytest.mark.parametrize("attention", [attention_per_sequence, attention_padded])
def test_both_attention_layouts_give_transformers_outputs(handler: EmbeddingHandler, padded: TorchRunner,
                                                          attention: Attention) -> None:
    """Per-sequence calls (served) and one masked padded call (bench/padding.py compares them); a batch of
    one length takes the single batched call either way."""
    for texts in (MIXED, [MIXED[5]] * 3):
        ids, mask, _ = handler.collate(handler.preprocess(texts))
        keep = mask.bool()
        with torch.inference_mode():
            got = forward(handler.runner.model, ids, mask, attention=attention)
        torch.testing.assert_close(got[keep], padded(ids, mask)[keep], rtol=1e-4, atol=1e-5)


def test_bf16_autocast_stays_within_the_half_gate(handler: EmbeddingHandler, padded: TorchRunner) -> None:
    runner = VarlenRunner(handler.runner.model, CPU, "bfloat16")
    assert runner.info["autocast"] == "bfloat16" and runner.info["unpadded"] is True
    batch = handler.preprocess(MIXED)
    assert cos(handler.forward(padded, batch), handler.forward(runner, batch)).min() >= 0.9995


def test_an_architecture_it_was_not_written_for_is_refused() -> None:
    from transformers import RobertaConfig, RobertaModel

    roberta = RobertaModel(RobertaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=32, max_position_embeddings=40))
    with pytest.raises(BackendError, match="model.unpadded.*'roberta'"):
        VarlenRunner(roberta, CPU)


def test_a_closed_runner_says_so(handler: EmbeddingHandler) -> None:
    runner = VarlenRunner(handler.runner.model, CPU)
    runner.close()
    ids, mask, _ = handler.collate(handler.preprocess(MIXED[:1]))
    with pytest.raises(RuntimeError, match="closed"):
        runner(ids, mask)


# -- choosing it ------------------------------------------------------------------------------------------


def test_auto_runs_a_bert_encoder_unpadded_on_the_cpu_only(handler: EmbeddingHandler) -> None:
    model = handler.runner.model
    assert choose("auto", model, CPU) == (True, "auto: a BERT encoder on the CPU runs on its real tokens only")
    unpadded, why = choose("auto", model, torch.device("cuda"))  # nothing moves: the choice is made first
    assert not unpadded and "cuda" in why
    assert choose("false", model, CPU) == (False, "model.unpadded: false")
    assert choose("true", model, torch.device("cuda"))[0] is True


def test_auto_keeps_other_architectures_padded_and_true_refuses_them() -> None:
    from transformers import RobertaConfig, RobertaModel

    roberta = RobertaModel(RobertaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=32, max_position_embeddings=40))
    unpadded, why = choose("auto", roberta, CPU)
    assert not unpadded and "'roberta'" in why
    with pytest.raises(BackendError, match="model.unpadded: true, but .*'roberta'"):
        choose("true", roberta, CPU)


@pytest.mark.parametrize(("setting", "runner", "pads"), [("auto", VarlenRunner, False), ("false", TorchRunner, True)])
def test_the_torch_backend_opens_the_runner_the_setting_chooses(tiny_model: Path, setting: str, runner: type,
                                                                pads: bool) -> None:
    opened = open_backend(tiny_model, BackendOptions(unpadded=setting), CPU, probe=None)  # type: ignore[arg-type]
    try:
        assert type(opened) is runner and opened.capabilities.pads is pads
        assert opened.info["unpadded"] is not pads and opened.info["unpadded_reason"]
    finally:
        opened.close()


# -- decoders ---------------------------------------------------------------------------------------------


def _decoder(kind: str, **extra: object) -> torch.nn.Module:
    """A tiny random decoder of a Llama-shaped family (grouped key/value heads), built in memory."""
    from transformers import AutoConfig, AutoModel

    torch.manual_seed(0)
    config = AutoConfig.for_model(kind, vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  max_position_embeddings=128, initializer_range=0.2, **extra)
    return AutoModel.from_config(config).eval()


@pytest.mark.parametrize("kind", ["qwen3", "qwen2", "llama", "mistral"])
def test_a_decoder_runs_unpadded_as_transformers_runs_it_padded(kind: str) -> None:
    model = _decoder(kind)
    assert choose("auto", model, CPU) == (True, "auto: a Llama-shaped decoder on the CPU runs on its real tokens only")
    lengths = [3, 40, 17, 40, 1]
    ids = torch.randint(1, 100, (len(lengths), max(lengths)))
    right = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        right[row, :n] = 1
    left = right.flip(1)  # a decoder's own padding side: positions must count from each text's first token
    unpadded, padded = VarlenRunner(model, CPU), TorchRunner(model, CPU)
    for mask in (right, left):
        got, want = unpadded(ids, mask), padded(ids, mask)
        keep = mask.bool()
        assert torch.allclose(got[keep], want[keep], atol=1e-5, rtol=0)
        assert not got[~keep].any()
    same = torch.ones(3, 12, dtype=torch.long)  # one length: the batched attention call
    assert torch.allclose(unpadded(ids[:3, :12], same), padded(ids[:3, :12], same), atol=1e-5, rtol=0)


def test_a_decoder_with_a_sliding_window_or_another_family_stays_padded() -> None:
    windowed = _decoder("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0)
    unpadded, why = choose("auto", windowed, CPU)
    assert not unpadded and "sliding window" in why
    gemma = _decoder("gemma")
    unpadded, why = choose("auto", gemma, CPU)
    assert not unpadded and "'gemma'" in why
