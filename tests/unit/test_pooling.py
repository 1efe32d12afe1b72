"""Pooling maths, the model folder's sentence-transformers config, and the weight-format checks."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from inferd.core.errors import ModelLoadError
from inferd.core.preprocess import Encoded
from inferd.core.tasks.base import check_weights
from inferd.core.tasks.embedding import POOLERS, EmbeddingHandler, cls_pool, lasttoken_pool, mean_pool, read_st_config

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
    from inferd.core.tasks.embedding import POOLERS

    h = EmbeddingHandler()
    h.model, h.device, h.pad_id, h.normalize = FakeEncoder().eval(), torch.device("cpu"), 0, normalize
    h.runner = TorchRunner(h.model, h.device)
    h._pool = POOLERS[pooling]
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


def test_infer_without_normalisation_keeps_the_norm() -> None:
    h = fake_handler("mean", normalize=False)
    out = h.infer([Encoded([4, 5], False)])
    expected = h.model.emb.weight.detach()[[4, 5]].mean(dim=0).numpy()
    np.testing.assert_allclose(out[0], expected, atol=1e-6)
    assert len(h.postprocess(out)) == 1


# -- the model folder's own sentence-transformers configuration -----------------------------------------------


def st_folder(tmp: Path, pooling: dict, normalize: bool, max_len: int | None = 256) -> Path:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp / "modules.json").write_text(json.dumps(modules))
    (tmp / "1_Pooling").mkdir()
    (tmp / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if max_len is not None:
        (tmp / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_len}))
    return tmp


def test_st_config_mean_and_normalize(tmp_path: Path) -> None:
    folder = st_folder(tmp_path, {"pooling_mode_mean_tokens": True}, normalize=True)
    assert read_st_config(folder) == ("mean", True, 256)


def test_st_config_cls_without_normalize(tmp_path: Path) -> None:
    folder = st_folder(tmp_path, {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False},
                       normalize=False, max_len=None)
    assert read_st_config(folder) == ("cls", False, None)


def test_st_config_unsupported_pooling_is_refused(tmp_path: Path) -> None:
    folder = st_folder(tmp_path, {"pooling_mode_max_tokens": True}, normalize=False)
    with pytest.raises(ModelLoadError, match="unsupported pooling"):
        read_st_config(folder)


def test_plain_hf_folder_has_no_st_config(tmp_path: Path) -> None:
    assert read_st_config(tmp_path) == (None, False, None)


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
