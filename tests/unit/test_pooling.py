"""Pooling maths, the model folder's sentence-transformers config, and the weight-format checks."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from inferd.core.errors import ModelLoadError
from inferd.core.preprocess import Encoded
from inferd.core.tasks.base import check_weights
from inferd.core.tasks.embedding import POOLERS, EmbeddingHandler, PooledHead, cls_pool, lasttoken_pool, mean_pool
from inferd.core.tasks.st_modules import Normalize

# -- pooling ---------------------------------------------------------------------------------------------------


def test_mean_pool_ignores_padding() -> None:
    torch.manual_seed(0)
    hidden = torch.randn(2, 5, 4)
    hidden[0, 3:] = 1e6  # padding positions hold garbage: it must not leak into the mean
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    pooled = mean_pool(hidden, mask)
    torch.testing.assert_close(pooled[0], hidden[0, :3].mean(dim=0))
    torch.testing.assert_close(pooled[1], hidden[1].mean(dim=0))


def test_mean_pool_is_the_same_padded_or_not() -> None:
    torch.manual_seed(1)
    row = torch.randn(1, 3, 8)
    padded = torch.cat([row, torch.randn(1, 4, 8)], dim=1)
    alone = mean_pool(row, torch.ones(1, 3, dtype=torch.long))
    in_batch = mean_pool(padded, torch.tensor([[1, 1, 1, 0, 0, 0, 0]]))
    torch.testing.assert_close(alone, in_batch)


def test_mean_pool_with_an_empty_mask_is_finite() -> None:
    pooled = mean_pool(torch.ones(1, 3, 2), torch.zeros(1, 3, dtype=torch.long))
    assert torch.isfinite(pooled).all()


def test_mean_pool_keeps_low_precision_dtype() -> None:
    pooled = mean_pool(torch.ones(1, 2, 4, dtype=torch.bfloat16), torch.ones(1, 2, dtype=torch.long))
    assert pooled.dtype == torch.bfloat16


def test_cls_pool_takes_the_first_token() -> None:
    hidden = torch.arange(2 * 3 * 2, dtype=torch.float32).reshape(2, 3, 2)
    torch.testing.assert_close(cls_pool(hidden, torch.ones(2, 3)), hidden[:, 0])


def padded(rows: list[torch.Tensor], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of hidden states of different lengths as one batch padded on ``side``, padding filled with garbage."""
    longest = max(r.shape[0] for r in rows)
    hidden = torch.full((len(rows), longest, rows[0].shape[1]), 1e4)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for i, r in enumerate(rows):
        span = slice(0, r.shape[0]) if side == "right" else slice(longest - r.shape[0], longest)
        hidden[i, span], mask[i, span] = r, 1
    return hidden, mask


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("mode", sorted(POOLERS))
def test_each_pooler_equals_sentence_transformers_on_either_padding_side(mode: str, side: str) -> None:
    from sentence_transformers.models import Pooling

    torch.manual_seed(3)
    hidden, mask = padded([torch.randn(n, 8) for n in (5, 2, 7)], side)
    expected = Pooling(8, pooling_mode=mode)({"token_embeddings": hidden, "attention_mask": mask})
    torch.testing.assert_close(POOLERS[mode](hidden, mask), expected["sentence_embedding"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("side", ["right", "left"])
def test_last_token_is_the_text_alone_s_last_token(side: str) -> None:
    torch.manual_seed(4)
    rows = [torch.randn(n, 4) for n in (3, 6, 1)]
    hidden, mask = padded(rows, side)
    torch.testing.assert_close(lasttoken_pool(hidden, mask), torch.stack([r[-1] for r in rows]))


# -- the handler's batch path with a fake encoder (no weights) ---------------------------------------------------


class FakeEncoder(torch.nn.Module):
    """Hidden state = a fixed embedding per token id, so the expected pooled vectors are easy to compute."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.emb = torch.nn.Embedding(20, 6)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(last_hidden_state=self.emb(input_ids))


def fake_handler(pooling: str, normalize: bool) -> EmbeddingHandler:
    from inferd.core.backends.torch import TorchRunner

    h = EmbeddingHandler()
    h.model, h.device, h.pad_id, h.normalize = FakeEncoder().eval(), torch.device("cpu"), 0, normalize
    h.runner = TorchRunner(h.model, h.device)
    h.pooling_modes = (pooling,)
    h._head = PooledHead([Normalize("2_Normalize")]) if normalize else None
    return h


def test_collate_pads_with_the_pad_id_and_masks_it() -> None:
    h = fake_handler("mean", False)
    h.pad_id = 9
    ids, mask, _ = h.collate([Encoded([2, 5, 3], False), Encoded([2, 3], False)])
    assert ids.tolist() == [[2, 5, 3], [2, 3, 9]]
    assert mask.tolist() == [[1, 1, 1], [1, 1, 0]]


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_infer_matches_each_text_computed_alone(pooling: str) -> None:
    h = fake_handler(pooling, normalize=True)
    batch = [Encoded([2, 5, 6, 7, 3], False), Encoded([4, 3], False), Encoded([8, 9, 3], False)]
    together = h.infer(batch)
    alone = np.stack([h.infer([e])[0] for e in batch])
    np.testing.assert_allclose(together, alone, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(together, axis=1), 1.0, atol=1e-6)
    emb = h.model.emb.weight.detach()
    first = emb[[2, 5, 6, 7, 3]]
    raw = first.mean(dim=0) if pooling == "mean" else first[0]
    np.testing.assert_allclose(together[0], (raw / raw.norm()).numpy(), atol=1e-6)


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_prompt_left_out_of_pooling_is_its_first_tokens_whichever_side_pads(side: str) -> None:
    from inferd.core.tasks.base import collate

    h = fake_handler("mean", normalize=False)
    if side == "left":  # a decoder's tokenizer pads on the left
        def left(batch: list[Encoded]) -> tuple[torch.Tensor, torch.Tensor, None]:
            ids, mask, _ = collate(batch, 0)
            return ids.flip(1), mask.flip(1), None  # rows are palindromes below, so only the padding moves
        h.collate = left  # type: ignore[method-assign]
    batch = [Encoded([2, 5, 6, 5, 2], False, skip=2), Encoded([4, 3, 4], False, skip=1)]
    emb = h.model.emb.weight.detach()
    expected = np.stack([emb[[6, 5, 2]].mean(dim=0).numpy(), emb[[3, 4]].mean(dim=0).numpy()])
    np.testing.assert_allclose(h.infer(batch), expected, atol=1e-6)


def test_infer_without_normalisation_keeps_the_norm() -> None:
    h = fake_handler("mean", normalize=False)
    out = h.infer([Encoded([4, 5], False)])
    expected = h.model.emb.weight.detach()[[4, 5]].mean(dim=0).numpy()
    np.testing.assert_allclose(out[0], expected, atol=1e-6)
    assert len(h.postprocess(out)) == 1


# -- weight formats: safetensors yes, pickle only when allowed -------------------------------------------------


def hf_folder(tmp: Path, *weights: str) -> Path:
    (tmp / "config.json").write_text("{}")
    for name in weights:
        (tmp / name).write_bytes(b"\0")
    return tmp


def test_safetensors_are_preferred_even_beside_pickle(tmp_path: Path) -> None:
    assert check_weights(hf_folder(tmp_path, "model.safetensors", "pytorch_model.bin"), allow_pickle=False)


def test_pickle_weights_are_refused_by_default(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="allow_pickle"):
        check_weights(hf_folder(tmp_path, "pytorch_model.bin"), allow_pickle=False)


def test_pickle_weights_load_when_allowed(tmp_path: Path) -> None:
    assert check_weights(hf_folder(tmp_path, "pytorch_model.bin"), allow_pickle=True) is False


@pytest.mark.parametrize(("setup", "needle"), [
    ("missing", "does not exist"), ("no_config", "no config.json"), ("no_weights", "no weights")])
def test_unusable_folders_are_named(tmp_path: Path, setup: str, needle: str) -> None:
    folder = tmp_path / "m"
    if setup == "no_config":
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"\0")
    elif setup == "no_weights":
        folder.mkdir()
        hf_folder(folder)
    with pytest.raises(ModelLoadError, match=needle):
        check_weights(folder, allow_pickle=True)
