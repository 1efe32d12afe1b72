"""Hot reload, failed reloads, canary, SIGHUP and memory after reloads, against real servers and real models.

One shared server (module scope) runs tiny_model as "v1"; tests that change what it serves say what they
expect first (``ensure_active``), so they do not depend on their order.
"""

from __future__ import annotations

import gc
import json
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
import pytest
import torch
import yaml
from conftest import ROOT, Server, metric_value, wait_for
from lifecycle_fakes import vector_for
from prompted import add_matryoshka_card, add_prompts, sentence_transformer
from tinymodel import write_st_v6, write_tiny_bert

from inferd.config import load_settings
from inferd.core import quantize
from inferd.core.loading import load_handler
from inferd.core.manager import ModelManager
from inferd.core.spec import ModelSpec

ADMIN = {"Authorization": "Bearer admin-secret"}
TEXT = "the cat and the dog run in the city"


def metric(server: Server, name: str, **labels: str) -> float:
    return metric_value(httpx.get(server.url + "/metrics", timeout=10).text, name, **labels)


def reference(path: Path) -> np.ndarray:
    """TEXT's vector computed in this process, straight through the handler: no server, no batching."""
    handler = load_handler(ModelSpec(path=path, name="tiny", version="ref", device="cpu"))
    return np.asarray(handler.postprocess(handler.infer(handler.preprocess([TEXT])))[0])


@pytest.fixture(scope="module")
def server(module_serve: Callable[..., Server], tiny_model: Path, models_root: Path) -> Server:
    return module_serve({
        "INFERD__MODEL__PATH": str(tiny_model), "INFERD__MODEL__VERSION": "v1", "INFERD__MODEL__NAME": "tiny",
        "INFERD__MODEL__ROOT": str(models_root), "INFERD__SERVER__ADMIN_KEY": "admin-secret",
        # Batches of four and six texts a request keep a backlog, so at the switch v1 and v2 items wait side
        # by side: the case where a scheduler that ignored item.group would mix versions.
        "INFERD__BATCHING__MAX_BATCH_SIZE": "4", "INFERD__SERVER__LOG_FORMAT": "json"}, wait="/health/ready",
        clean_exit=True)


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def refs(tiny_model: Path, tiny_model_v2: Path) -> dict[Path, np.ndarray]:
    out = {tiny_model: reference(tiny_model), tiny_model_v2: reference(tiny_model_v2)}
    assert not np.allclose(out[tiny_model], out[tiny_model_v2], atol=1e-3)  # distinguishable outputs
    return out


def active_version(client: httpx.Client) -> str:
    return client.get("/info").json()["version"]


def ensure_active(client: httpx.Client, path: Path, version: str) -> None:
    info = client.get("/info").json()
    if info["version"] != version or len(info["models"]) != 1:
        client.post("/admin/models/rollback", headers=ADMIN)
        r = client.post("/admin/models/reload", json={"path": str(path), "version": version}, headers=ADMIN)
        assert r.status_code == 200, r.text


def predict(client: httpx.Client, **kw: Any) -> httpx.Response:
    r = client.post("/predict", json={"texts": [TEXT], **kw.pop("body", {})}, **kw)
    assert r.status_code == 200, r.text
    return r


# -- the serving version, everywhere ---------------------------------------------------------------------


def test_the_serving_version_is_in_header_body_info_and_metrics(server: Server, client: httpx.Client,
                                                                tiny_model: Path) -> None:
    ensure_active(client, tiny_model, "v1")
    r = predict(client)
    assert r.headers["X-Model-Version"] == "v1" and r.json()["model"] == "tiny@v1"
    e = client.post("/v1/embeddings", json={"input": TEXT})
    assert e.headers["X-Model-Version"] == "v1" and e.json()["model"] == "tiny@v1"
    info = client.get("/info").json()
    assert (info["name"], info["version"]) == ("tiny", "v1")
    assert metric(server, "inferd_version_requests_total", version="v1") >= 2
    assert metric(server, "inferd_inference_duration_seconds_count", version="v1") >= 1
    assert metric(server, "inferd_model_info", slot="active", version="v1") == 1


# -- reload under load -----------------------------------------------------------------------------------


def test_reload_under_load_loses_no_request_and_never_mixes_versions(
        server: Server, client: httpx.Client, tiny_model: Path, tiny_model_v2: Path,
        refs: dict[Path, np.ndarray]) -> None:
    ensure_active(client, tiny_model, "v1")
    switches_before = client.get("/admin/models", headers=ADMIN).json()["switches"]
    expected = {"v1": refs[tiny_model], "v2": refs[tiny_model_v2]}
    stop = threading.Event()
    seen: list[list[tuple[int, str | None, str | None, Any]]] = [[] for _ in range(6)]
    ready_codes: list[int] = []

    def send(out: list[tuple[int, str | None, str | None, Any]]) -> None:
        with server.client() as c:
            while not stop.is_set():
                # Five texts in batches of four: most requests share a batch with the next request.
                r = c.post("/predict", json={"texts": [TEXT] * 5})
                body = r.json()
                out.append((r.status_code, r.headers.get("X-Model-Version"), body.get("model"),
                            body.get("results")))

    def probe_readiness() -> None:
        with server.client() as c:
            while not stop.is_set():
                ready_codes.append(c.get("/health/ready").status_code)
                time.sleep(0.02)

    threads = [threading.Thread(target=send, args=(out,)) for out in seen]
    threads.append(threading.Thread(target=probe_readiness))
    for t in threads:
        t.start()
    try:
        wait_for(lambda: all(len(out) >= 5 for out in seen), what="traffic before the reload")
        r = client.post("/admin/models/reload", json={"path": str(tiny_model_v2), "version": "v2"},
                        headers=ADMIN)
        assert r.status_code == 200, r.text
        after = [len(out) for out in seen]
        wait_for(lambda: all(len(out) >= n + 5 for out, n in zip(seen, after, strict=True)),
                 what="traffic after the reload")
    finally:
        stop.set()
        for t in threads:
            t.join(30)

    assert r.json()["active"]["version"] == "v2"
    for out in seen:
        assert [s for s, *_ in out if s != 200] == []
        versions = [v for _, v, _, _ in out]
        # Each client's requests are sequential: once one ran on v2, none after it ran on v1.
        assert versions == sorted(versions) and versions[0] == "v1" and versions[-1] == "v2"
        for _, header, model, results in out:
            assert model == f"tiny@{header}" and len(results) == 5
            np.testing.assert_allclose(results, [expected[header]] * 5, atol=1e-5)
    assert set(ready_codes) == {200}
    assert client.get("/admin/models", headers=ADMIN).json()["switches"] == switches_before + 1


# -- failed reloads --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bad_models(models_root: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    def copy(name: str) -> Path:
        return Path(shutil.copytree(tiny_model, models_root / name, dirs_exist_ok=True))

    corrupt = copy("bad-corrupt")
    (corrupt / "model.safetensors").write_bytes(b"\x00garbage, not safetensors" * 64)
    arch = copy("bad-arch")
    config = json.loads((arch / "config.json").read_text())
    (arch / "config.json").write_text(json.dumps({**config, "model_type": "gpt2", "architectures": ["GPT2Model"]}))
    no_tokenizer = copy("bad-no-tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        (no_tokenizer / name).unlink(missing_ok=True)
    outside = Path(shutil.copytree(tiny_model, tmp_path_factory.mktemp("elsewhere") / "tiny"))

    def module_path(name: str, path: str) -> Path:
        folder = copy(name)
        modules = json.loads((folder / "modules.json").read_text())
        modules[1]["path"] = path
        (folder / "modules.json").write_text(json.dumps(modules))
        return folder

    # Files leading out of model.root (issue 30 item 3): a module folder beside the root that would load...
    escape = module_path("bad-module-escape", "../../outside/x")
    shutil.copytree(tiny_model / "1_Pooling", models_root.parent / "outside" / "x", dirs_exist_ok=True)
    # ...and weights linked to a copy outside it.
    linked = copy("bad-linked-weights")
    (linked / "model.safetensors").unlink()
    (linked / "model.safetensors").symlink_to(outside / "model.safetensors")
    return {
        "missing": str(models_root / "no-such-model"),
        "corrupt": str(corrupt),
        "pickle": str(write_tiny_bert(models_root / "bad-pickle", seed=3, pickle_weights=True)),
        "architecture": str(arch),
        "tokenizer": str(no_tokenizer),
        "dimension": str(write_tiny_bert(models_root / "bad-dim48", seed=4, hidden=48)),
        "outside_root": str(outside),
        "dotdot": f"{models_root}/tiny-v1/../tiny-v2",
        "url": "https://example.com/models/tiny",
        "scheme": f"file://{tiny_model}",
        "module_escape": str(escape),
        "module_etc": str(module_path("bad-module-etc", "/etc")),
        "linked_weights": str(linked),
        # A default prompt longer than any text may be (issue 30 item 4): every request would be refused.
        "prompt": str(add_prompts(copy("bad-prompt"), {"query": "q" * 200_000}, "query")),
    }


CAUSES = {
    "missing": "does not exist",
    "corrupt": "SafetensorError",
    "pickle": "pickle weights",
    "architecture": "model_type 'gpt2' is not a supported architecture",
    "tokenizer": "has no tokenizer",
    "dimension": "embedding dimension is 48",
    "outside_root": "not under an allowed model.root",
    "dotdot": "'..' is not allowed",
    "url": "only local folders",
    "scheme": "only local folders",
    "module_escape": "modules.json module 1: path '../../outside/x' leaves the model folder",
    "module_etc": "modules.json module 1: path '/etc' leaves the model folder",
    "linked_weights": "model.safetensors in the model folder is a link that leads outside model.root",
    "prompt": "prompt 'query' of config_sentence_transformers.json is 200000 characters long",
}


def test_failed_reloads_keep_the_old_model_and_name_the_cause(
        server: Server, client: httpx.Client, tiny_model: Path, bad_models: dict[str, str],
        refs: dict[Path, np.ndarray]) -> None:
    ensure_active(client, tiny_model, "v1")
    failed_before = metric(server, "inferd_model_reloads_total", outcome="failed")
    switches = client.get("/admin/models", headers=ADMIN).json()["switches"]
    for kind, path in bad_models.items():
        r = client.post("/admin/models/reload", json={"path": path, "version": f"bad-{kind}"}, headers=ADMIN)
        assert r.status_code == 422, (kind, r.text)
        error = r.json()["error"]
        assert error["code"] == "model_load_failed" and error["param"] == "path"
        assert "the serving model is unchanged" in error["message"]
        assert CAUSES[kind] in error["message"], (kind, error["message"])
        # Nothing is said of files outside the root: not their names, nor whether they exist.
        assert "/etc/config.json" not in error["message"] and "outside/x/config.json" not in error["message"]
        answer = predict(client)
        assert answer.headers["X-Model-Version"] == "v1", kind
        np.testing.assert_allclose(answer.json()["results"][0], refs[tiny_model], atol=1e-5)
    assert metric(server, "inferd_model_reloads_total", outcome="failed") == failed_before + len(bad_models)
    assert client.get("/admin/models", headers=ADMIN).json()["switches"] == switches
    assert client.get("/health/ready").status_code == 200
    assert "reload failed" in server.log()


def test_a_folder_saved_by_sentence_transformers_6_serves_its_vectors(
        client: httpx.Client, tiny_model: Path, models_root: Path) -> None:
    folder = write_st_v6(models_root / "st6", tiny_model, pooling=["mean", "lasttoken"], dense=32, include_prompt=False,
                         prompts={"query": "query: ", "document": ""}, default_prompt_name="query", similarity="dot")
    ensure_active(client, tiny_model, "v1")
    r = client.post("/admin/models/reload", json={"path": str(folder), "version": "st6"}, headers=ADMIN)
    assert r.status_code == 200, r.text
    st = sentence_transformer(folder)
    texts = [TEXT, "one", "a river " * 40]
    for body, name in (({}, None), ({"prompt_name": "document"}, "document")):
        got = client.post("/embed", json={"inputs": texts, **body})
        assert got.status_code == 200 and got.headers["X-Model-Version"] == "st6", got.text
        np.testing.assert_allclose(np.array(got.json()), st.encode(texts, prompt_name=name), atol=1e-5)
    info = client.get("/info").json()["models"][0]
    assert (info["pooling"], info["default_prompt_name"], info["similarity_fn_name"]) == (
        "mean+lasttoken", "query", "dot")


def test_a_malformed_reload_request_gets_the_error_shape(client: httpx.Client) -> None:
    for body in ({"path": "x"}, {"path": "x", "version": "a b"}, {"path": "x", "version": "v", "extra": 1}):
        r = client.post("/admin/models/reload", json=body, headers=ADMIN)
        assert r.status_code == 422 and set(r.json()["error"]) == {"message", "type", "code", "param"}


# -- canary over HTTP ------------------------------------------------------------------------------------


def test_canary_sticky_keys_pinning_promote_and_rollback(
        server: Server, client: httpx.Client, tiny_model: Path, tiny_model_v2: Path,
        refs: dict[Path, np.ndarray]) -> None:
    ensure_active(client, tiny_model, "v1")
    # force: another tiny model is another embedding space, which a canary refuses by default (test_shadow.py).
    r = client.post("/admin/models/canary", json={"path": str(tiny_model_v2), "version": "v2", "weight": 0.5,
                                                  "force": True}, headers=ADMIN)
    assert r.status_code == 200, r.text
    info = client.get("/info").json()
    assert [(m["role"], m["version"], m["weight"]) for m in info["models"]] == [
        ("active", "v1", None), ("canary", "v2", 0.5)]

    by_key = {}
    for i in range(12):
        versions = {predict(client, headers={"X-Routing-Key": f"user-{i}"}).headers["X-Model-Version"]
                    for _ in range(3)}
        assert len(versions) == 1  # sticky
        by_key[i] = versions.pop()
    assert set(by_key.values()) == {"v1", "v2"}  # P(all 12 keys on one side) = 2 * 0.5**12

    for pin, version, path in (("v2", "v2", tiny_model_v2), ("tiny@v1", "v1", tiny_model)):
        answer = predict(client, body={"model": pin}, headers={"X-Routing-Key": "user-0"})
        assert answer.headers["X-Model-Version"] == version and answer.json()["model"] == f"tiny@{version}"
        np.testing.assert_allclose(answer.json()["results"][0], refs[path], atol=1e-5)
    assert metric(server, "inferd_model_info", slot="canary", version="v2") == 1

    assert client.post("/admin/models/promote", headers=ADMIN).json()["active"]["version"] == "v2"
    assert [m["version"] for m in client.get("/info").json()["models"]] == ["v2"]
    assert {predict(client, headers={"X-Routing-Key": f"user-{i}"}).headers["X-Model-Version"]
            for i in range(12)} == {"v2"}
    r = client.post("/admin/models/promote", headers=ADMIN)
    assert r.status_code == 409 and r.json()["error"]["code"] == "no_canary"

    r = client.post("/admin/models/canary", json={"path": str(tiny_model), "version": "v1", "weight": 1.0,
                                                  "force": True}, headers=ADMIN)
    assert r.status_code == 200 and predict(client).headers["X-Model-Version"] == "v1"
    assert client.post("/admin/models/rollback", headers=ADMIN).json()["active"]["version"] == "v2"
    assert {predict(client).headers["X-Model-Version"] for _ in range(10)} == {"v2"}
    assert client.post("/admin/models/rollback", headers=ADMIN).status_code == 409


def test_a_canary_s_answer_is_shaped_by_the_canary_s_own_description(
        client: httpx.Client, tiny_model: Path, models_root: Path) -> None:
    """Issue 28: the canary, unnormalised, with prompts (a default one) and Matryoshka sizes, answers every
    request beside an active model that normalises and has no prompts: its prompt is the one tokenised, and its
    vectors are cut without renormalising, on the OpenAI, Cohere and TEI routes alike."""
    folder = add_matryoshka_card(add_prompts(write_tiny_bert(models_root / "prompted-raw", seed=4, normalize=False),
                                             default="query"))
    st = sentence_transformer(folder)
    ensure_active(client, tiny_model, "v1")
    r = client.post("/admin/models/canary", json={"path": str(folder), "version": "raw", "weight": 1.0,
                                                  "force": True}, headers=ADMIN)
    assert r.status_code == 200, r.text
    try:
        openai = client.post("/v1/embeddings", json={"input": [TEXT], "dimensions": 16})
        assert openai.status_code == 200 and openai.headers["X-Model-Version"] == "raw", openai.text
        np.testing.assert_allclose(openai.json()["data"][0]["embedding"], st.encode([TEXT])[0][:16], atol=1e-5)
        cohere = client.post("/v2/embed", json={"texts": [TEXT], "input_type": "search_document",
                                                "embedding_types": ["float"], "output_dimension": 8})
        assert cohere.status_code == 200 and cohere.headers["X-Model-Version"] == "raw", cohere.text
        np.testing.assert_allclose(cohere.json()["embeddings"]["float"][0],
                                   st.encode([TEXT], prompt_name="document")[0][:8], atol=1e-5)
        # TEI's /embed too: the canary's default prompt, and normalize: false allowed as the canary does not.
        tei = client.post("/embed", json={"inputs": [TEXT], "normalize": False})
        assert tei.status_code == 200 and tei.headers["X-Model-Version"] == "raw", tei.text
        np.testing.assert_allclose(tei.json()[0], st.encode([TEXT])[0], atol=1e-5)
    finally:
        assert client.post("/admin/models/rollback", headers=ADMIN).status_code == 200


def test_cohere_int8_and_uint8_computed_before_a_reload_are_answered_after_it(serve: Any, tmp_path: Path) -> None:
    """Issue 28: requests held in the worker across a hot reload get their int8/uint8 answers, with the ranges
    of the model that computed them (they were answered 404 for a version no longer served, or 503)."""
    hold = tmp_path / "hold"
    hold.touch()
    server = serve({"INFERD__MODEL__TASK": "lifecycle_fakes:SlowHandler", "INFERD__MODEL__PATH": str(tmp_path),
                    "INFERD__MODEL__ROOT": str(tmp_path), "INFERD__MODEL__VERSION": "v10", "INFERD__MODEL__NAME": "x",
                    "INFERD__SERVER__ADMIN_KEY": "admin-secret", "INFERD__BATCHING__MAX_BATCH_SIZE": "8",
                    "LIFECYCLE_DELAY_S": "0", "LIFECYCLE_HOLD_FILE": str(hold)}, wait="/health/ready")
    kinds = {f"text {i}": ("int8", "uint8")[i % 2] for i in range(40)}
    answers: dict[str, httpx.Response] = {}

    def one(text: str) -> None:
        with server.client(timeout=60) as c:
            answers[text] = c.post("/v2/embed", json={"texts": [text], "embedding_types": [kinds[text]]})

    threads = [threading.Thread(target=one, args=(t,)) for t in kinds]
    for t in threads:
        t.start()
    wait_for(lambda: metric(server, "inferd_requests_in_flight") == len(kinds), what="every request held")
    with server.client() as c:
        r = c.post("/admin/models/reload", json={"path": str(tmp_path), "version": "v11"}, headers=ADMIN)
        assert r.status_code == 200, r.text
        hold.unlink()
        for t in threads:
            t.join(60)
        calibration = [vector_for(t) for t in quantize.calibration_texts(None) if t.strip()]
        ranges = quantize.ranges_of(np.array(calibration, dtype=np.float32))
        for text, kind in kinds.items():
            got = answers[text]
            assert got.status_code == 200 and got.headers["X-Model-Version"] == "v10", got.text
            expected = quantize.quantize(np.array([vector_for(text)], dtype=np.float32), kind, ranges)
            assert got.json()["embeddings"][kind] == expected.tolist()
        after = c.post("/v2/embed", json={"texts": ["after"], "embedding_types": ["int8"]})
        assert after.status_code == 200 and after.headers["X-Model-Version"] == "v11", after.text


# -- SIGHUP and a reload while another is in progress -----------------------------------------------------


def write_config(folder: Path, model: dict[str, Any] | str) -> None:
    text = model if isinstance(model, str) else yaml.safe_dump({"model": model})
    (folder / "dev.yaml").write_text(text)


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("configs")
    shutil.copy(ROOT / "configs" / "base.yaml", folder / "base.yaml")
    return folder


def test_sighup_rereads_the_model_section_and_a_second_change_gets_409(
        serve: Callable[..., Server], config_dir: Path, tiny_model: Path, tiny_model_v2: Path, models_root: Path,
        refs: dict[Path, np.ndarray]) -> None:
    model = {"name": "tiny", "path": str(tiny_model), "version": "v1", "root": [str(models_root)],
             "load_delay_s": 1.0}  # every load takes a second: room for a second change to collide
    write_config(config_dir, model)
    server = serve({"INFERD_CONFIG_DIR": str(config_dir), "INFERD__SERVER__ADMIN_KEY": "admin-secret"},
                   wait="/health/ready")
    with server.client() as c:
        results: list[httpx.Response] = []
        posts = [threading.Thread(target=lambda v=v: results.append(c.post(
            "/admin/models/reload", json={"path": str(tiny_model_v2), "version": v}, headers=ADMIN)))
            for v in ("v2", "v2b")]
        for t in posts:
            t.start()
        for t in posts:
            t.join(30)
        assert sorted(r.status_code for r in results) == [200, 409]
        conflict = next(r for r in results if r.status_code == 409).json()["error"]
        assert conflict["code"] == "reload_in_progress" and conflict["type"] == "conflict_error"
        assert metric(server, "inferd_model_reloads_total", outcome="conflict") == 1

        write_config(config_dir, {**model, "version": "v3"})
        server.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: active_version(c) == "v3", what="SIGHUP reload to v3")
        answer = predict(c)
        assert answer.headers["X-Model-Version"] == "v3"
        np.testing.assert_allclose(answer.json()["results"][0], refs[tiny_model], atol=1e-5)

        for n, bad in enumerate(({**model, "path": str(models_root / "gone"), "version": "v4"},
                                 "model: [unclosed"), start=1):
            write_config(config_dir, bad)
            server.proc.send_signal(signal.SIGHUP)
            wait_for(lambda n=n: metric(server, "inferd_model_reloads_total", outcome="failed") == n,
                     what=f"failed SIGHUP reload {n}")
            assert active_version(c) == "v3" and predict(c).headers["X-Model-Version"] == "v3"
        assert c.get("/admin/models", headers=ADMIN).json()["switches"] == 2
    log = server.log()
    assert "does not exist" in log and "not valid YAML" in log and "SIGHUP reload failed" in log
    assert server.stop() == 0  # SIGTERM after the failed reloads: still a clean exit


def test_sighup_serves_the_canary_section_and_names_what_only_a_restart_applies(
        serve: Callable[..., Server], config_dir: Path, tiny_model: Path, models_root: Path) -> None:
    # The probe's: adding canary: failed ("'v1' is already being served by the active model") and jammed every later
    # SIGHUP of the model; a limits change was logged as the model "unchanged".
    model = {"name": "tiny", "path": str(tiny_model), "version": "v1", "root": [str(models_root)]}
    write_config(config_dir, model)
    server = serve({"INFERD_CONFIG_DIR": str(config_dir), "INFERD__SERVER__ADMIN_KEY": "admin-secret"},
                   wait="/health/ready")
    canary = {"path": str(tiny_model), "version": "cv", "weight": 0.5}  # the same folder: the same space

    def sighup(config: dict[str, Any]) -> dict[str, Any]:
        ok = metric(server, "inferd_model_reloads_total", outcome="ok")
        write_config(config_dir, yaml.safe_dump(config))
        server.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: metric(server, "inferd_model_reloads_total", outcome="ok") == ok + 1, what="the SIGHUP")
        models: dict[str, Any] = c.get("/admin/models", headers=ADMIN).json()
        return models

    with server.client() as c:
        shown = sighup({"model": model, "canary": canary})
        assert [(s["role"], s["version"]) for s in shown["slots"]] == [("active", "v1"), ("canary", "cv")]
        assert shown["canary_weight"] == 0.5 and predict(c, body={"model": "cv"}).headers["X-Model-Version"] == "cv"
        shown = sighup({"model": model, "canary": {**canary, "weight": 0.2}, "limits": {"max_items_per_request": 8}})
        assert shown["canary_weight"] == 0.2 and shown["switches"] == 0
        r = c.post("/predict", json={"texts": [TEXT] * 9})
        assert r.status_code == 200, r.text  # the start's limit still holds: not applied, and said so
        assert "SIGHUP: limits.max_items_per_request change only at a restart" in server.log()
        shown = sighup({"model": model})
        assert [(s["role"], s["version"]) for s in shown["slots"]] == [("active", "v1")]
        sighup({"model": model, "batching": {"max_batch_size": 4}})  # a batching edit is just that
        assert metric(server, "inferd_model_reloads_total", outcome="failed") == 0
    assert server.stop() == 0


# -- memory after repeated reloads -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def wide_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    # ~5 MB of weights each, so a leak of even a few retired models stands out against the margin below.
    root = tmp_path_factory.mktemp("wide")
    return write_tiny_bert(root / "a", seed=1, hidden=256), write_tiny_bert(root / "b", seed=2, hidden=256)


def twenty_reloads(wide_models: tuple[Path, Path], device: str, measure: Callable[[], float]) -> float:
    a, b = wide_models
    settings = load_settings("dev", {"model.path": str(a), "model.version": "w0", "model.device": device},
                             environ={}, config_dir=ROOT / "configs")
    manager = ModelManager(settings, load_handler)
    manager.load_initial()
    for i in range(2):  # first loads fill one-off caches (tokenizer, allocator); not a leak
        manager.reload(str((b, a)[i]), f"warm{i}")
    baseline = measure()
    retired = []
    for i in range(20):
        retired.append(manager.active)
        manager.reload(str(b if i % 2 == 0 else a), f"r{i}")
        slot = manager.pick()
        slot.handler.infer(slot.handler.preprocess(["a request on the new model"]))
        slot.release()
    grown = measure() - baseline
    assert all(s is not None and s.freed.is_set() for s in retired)
    manager.close()
    return grown


def test_twenty_reloads_return_rss_to_its_baseline(wide_models: tuple[Path, Path]) -> None:
    process = psutil.Process()

    def rss_mb() -> float:
        gc.collect()
        return process.memory_info().rss / 2**20

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two cores shared with servers and other tests: oversubscription only slows
    try:
        grown = twenty_reloads(wide_models, "cpu", rss_mb)
    finally:
        torch.set_num_threads(threads)
    # Measured: +0.1 MB over twenty reloads; one retired model left alive costs ~5 MB, twenty ~100 MB.
    assert grown < 25.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU memory after reloads)")
def test_twenty_reloads_return_gpu_memory_to_its_baseline(wide_models: tuple[Path, Path]) -> None:
    def allocated_mb() -> float:
        gc.collect()
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() / 2**20

    # Allocated (not reserved) memory: exact bookkeeping, so the margin is a fraction of one model (~5 MB).
    assert twenty_reloads(wide_models, "cuda", allocated_mb) < 1.0
