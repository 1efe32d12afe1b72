"""A slot's description of its model, built once at load: what /info, /v1/models, the admin API and the
metrics show, with the defaults a plug-in handler without the optional attributes gets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import metric_value
from fakes import DIM, HashHandler, loader_for, opened
from fastapi.testclient import TestClient
from settingskit import make_settings

from inferd.api.app import create_app
from inferd.core.description import Loaded, ModelDescription, TaskFacts
from inferd.core.errors import ModelLoadError
from inferd.core.slots import ModelSlot
from inferd.core.spec import ModelSpec
from inferd.core.tasks.base import Handler
from inferd.core.tasks.classification import ClassificationHandler

ADMIN = {"Authorization": "Bearer admin-key"}


class BareHandler(Handler):
    """The smallest plug-in: load and the three stages, none of the members with defaults."""

    def load(self, spec: ModelSpec, device: torch.device) -> Loaded:
        return Loaded()

    def preprocess(self, texts: list[str]) -> list[Any]:
        return texts

    def infer(self, batch: list[Any]) -> list[Any]:
        return batch

    def postprocess(self, outputs: list[Any]) -> list[Any]:
        return [[0.0] for _ in outputs]


def test_a_plugin_handler_gets_the_defaults_in_its_description(tmp_path: Path) -> None:
    spec = ModelSpec(tmp_path / "m1", "v1")
    d = ModelSlot(opened(BareHandler(), spec), spec, 1.23456).description
    assert (d.name, d.version, d.path, d.task) == (spec.name, "v1", str(spec.path), "embedding")
    assert (d.backend, d.quantize, d.backend_info) == ("torch", "none", None)
    assert (d.dtype, d.device, d.max_seq_length, d.dimension) == (None, "", None, None)
    assert d.load_seconds == 1.235


def test_the_task_s_facts_sit_beside_the_common_ones_and_cannot_replace_them(tmp_path: Path) -> None:
    class Describing(HashHandler):
        def facts(self) -> TaskFacts:
            return TaskFacts(dimension=DIM, pooling="mean", other={"version": "not-the-load's", "kind": "hash"})

    spec = ModelSpec(tmp_path / "m1", "v1")
    d = ModelSlot(opened(Describing(), spec), spec, 0.0).description
    assert (d.dimension, d.pooling, d.version) == (DIM, "mean", "v1")
    assert dict(d.facts) == {"kind": "hash"}  # a fact of the load itself is the load's to say


class OldShape(HashHandler):
    """A plug-in written to the contract before load returned a Loaded: it sets attributes and returns None."""

    def load(self, spec: ModelSpec, device: torch.device) -> Any:
        super().load(spec, device)
        self.dtype = "float32"


class UntypedFacts(HashHandler):
    def facts(self) -> Any:
        return {"dimension": DIM}


@pytest.mark.parametrize(("handler", "named"), [
    (OldShape, r"OldShape\.load\(\) returned NoneType; it returns a Loaded"),
    (UntypedFacts, r"UntypedFacts\.load\(\) returned facts of type dict; it returns a Loaded, its facts a TaskFacts"),
])
def test_a_plugin_whose_load_returns_the_old_shape_is_refused_at_load_naming_it(
        tmp_path: Path, handler: type[HashHandler], named: str) -> None:
    made = handler()
    with pytest.raises(ModelLoadError, match=named):
        made.open(ModelSpec(tmp_path / "m1", "v1"), torch.device("cpu"))
    assert made.closed  # what it loaded is dropped


def test_a_server_whose_plugin_returns_the_old_shape_fails_its_load_and_logs_why(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    settings = make_settings(tmp_path / "m1", model={"version": "v1", "root": [str(tmp_path)]})
    with TestClient(create_app(settings, loader=loader_for(OldShape()))) as client:
        r = client.get("/health")
        assert (r.status_code, r.json()["status"]) == (503, "failed")
    assert "OldShape.load() returned NoneType; it returns a Loaded" in caplog.text


def test_info_models_admin_and_metrics_show_the_description_built_at_load(tmp_path: Path) -> None:
    handler = HashHandler()
    settings = make_settings(tmp_path / "m1", model={"version": "v1", "root": [str(tmp_path)]},
                             server={"admin_key": "admin-key"})
    with TestClient(create_app(settings, loader=loader_for(handler))) as client:
        handler.dimension = DIM + 1  # what is served was described at load: nothing reads it again
        info = client.get("/info").json()
        (model,) = info["models"]
        assert {k: model[k] for k in ("name", "version", "task", "dimension", "dtype", "device", "backend",
                                      "quantize", "backend_info")} == {
            "name": "all-MiniLM-L6-v2", "version": "v1", "task": "embedding", "dimension": DIM,
            "dtype": "float32", "device": "cpu", "backend": "torch", "quantize": "none", "backend_info": None}
        assert (info["dtype"], info["backend"]) == ("float32", "torch")
        (listed,) = client.get("/v1/models").json()["data"]
        assert (listed["id"], listed["task"], listed["ready"]) == ("all-MiniLM-L6-v2", "embedding", True)
        assert [(v["version"], v["role"], v["backend"]) for v in listed["versions"]] == [("v1", "active", "torch")]
        (slot,) = client.get("/admin/models", headers=ADMIN).json()["slots"]
        assert (slot["name"], slot["version"], slot["dimension"]) == ("all-MiniLM-L6-v2", "v1", DIM)
        exposition = client.get("/metrics").text
        assert metric_value(exposition, "inferd_model_info", slot="active", version="v1", device="cpu",
                            dtype="float32", backend="torch", quantize="none") == 1
        assert 'model="all-MiniLM-L6-v2"' in next(line for line in exposition.splitlines()
                                                 if line.startswith("inferd_model_info{"))


def test_a_bare_plugin_handler_is_described_too(tmp_path: Path) -> None:
    settings = make_settings(tmp_path / "m1", model={"version": "v1", "root": [str(tmp_path)]},
                             server={"admin_key": "admin-key"})
    with TestClient(create_app(settings, loader=lambda spec: opened(BareHandler(), spec))) as client:
        r = client.get("/info")
        assert r.status_code == 200, r.text
        (model,) = r.json()["models"]
        assert (model["dtype"], model["device"], model["max_seq_length"], model["backend"]) == (None, "", None,
                                                                                               "torch")
        assert metric_value(client.get("/metrics").text, "inferd_model_info", slot="active", version="v1",
                            backend="torch", quantize="none") == 1


def test_the_reload_rules_read_the_serving_load_s_typed_description(tmp_path: Path) -> None:
    def serving(**facts: Any) -> ModelDescription:
        return ModelDescription("m", "v1", 1, str(tmp_path), facts.pop("task", "embedding"), **facts)

    # The default rule (a handler that declares no incompatibility): an embedding keeps its dimension.
    plugin = opened(HashHandler(), ModelSpec(tmp_path, "1"))
    assert plugin.incompatibility(serving(dimension=DIM), False) is None
    assert "embedding dimension is 8, the serving model's is 16" in str(plugin.incompatibility(serving(dimension=16),
                                                                                                False))
    assert plugin.incompatibility(serving(dimension=16), True) is None
    # A classifier keeps its label set, read from the description's labels.
    classifier = ClassificationHandler()
    classifier.labels = ["neg", "pos"]
    assert classifier.incompatibility(serving(task="classification", labels=("neg", "pos")), False) is None
    assert "the serving model's are ['a', 'b']" in str(
        classifier.incompatibility(serving(task="classification", labels=("a", "b")), False))


def test_info_shows_each_load_as_its_description_renders_it_for_the_wire(tmp_path: Path) -> None:
    handler = HashHandler()
    settings = make_settings(tmp_path / "m1", model={"version": "v1", "root": [str(tmp_path)]},
                             server={"admin_key": "admin-key"})
    with TestClient(create_app(settings, loader=loader_for(handler))) as client:
        (model,) = client.get("/info").json()["models"]
        (slot,) = client.app.state.services.registry.first().manager.slots()  # type: ignore[attr-defined]
        assert model == {"role": "active", "state": "ready", "weight": None, **slot[1].description.wire()}
        assert "path" not in model  # the folder is the admin API's to show
