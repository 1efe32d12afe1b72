"""The access matrix, against real servers: inference keys, the metrics key, the admin key and admin port."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from conftest import Server, free_port
from settingskit import make_settings

from inferd.api.app import create_app

INFERENCE = [("POST", "/predict", {"texts": ["hello world"]}),
             ("POST", "/v1/embeddings", {"input": "hello world"}),
             ("GET", "/v1/models", None)]
HEALTH = ["/health", "/health/ready", "/health/live"]
# Missing, malformed (another scheme, no scheme, empty, two tokens) and wrong: all the same refusal.
REFUSED = [{}, {"Authorization": "Basic a2V5LTE6"}, {"Authorization": "key-1"}, {"Authorization": "Bearer"},
           {"Authorization": "Bearer key-1 key-2"}, {"Authorization": "Bearer key-3"},
           {"Authorization": "Bearer admin-key"}, {"Authorization": "Bearer key-1x"}]


def call(client: httpx.Client, method: str, path: str, body: object, headers: dict[str, str]) -> httpx.Response:
    return client.request(method, path, json=body, headers=headers)


def assert_401(r: httpx.Response) -> None:
    assert r.status_code == 401, r.text
    assert r.headers["WWW-Authenticate"] == "Bearer"
    error = r.json()["error"]
    assert (error["type"], error["code"]) == ("authentication_error", "invalid_api_key")
    assert set(error) == {"message", "type", "code", "param"}


@pytest.fixture(scope="module")
def keyed(module_serve: Callable[..., Server], tiny_model: Path) -> Server:
    """Every key set, admin routes on the main port."""
    return module_serve({
        "INFERD__MODEL__PATH": str(tiny_model), "INFERD__MODEL__NAME": "tiny",
        "INFERD__SERVER__API_KEYS": "key-1, key-2", "INFERD__SERVER__METRICS_KEY": "metrics-key",
        "INFERD__SERVER__ADMIN_KEY": "admin-key"},
        wait="/health/ready")


@pytest.fixture(scope="module")
def client(keyed: Server) -> Iterator[httpx.Client]:
    with keyed.client() as c:
        yield c


@pytest.mark.parametrize(("method", "path", "body"), INFERENCE)
def test_inference_needs_one_of_the_api_keys(client: httpx.Client, method: str, path: str, body: object) -> None:
    bodies = set()
    for headers in REFUSED:
        r = call(client, method, path, body, headers)
        assert_401(r)
        bodies.add(r.content)
    assert len(bodies) == 1  # nothing tells a missing key from a wrong or malformed one
    for key in ("key-1", "key-2"):
        assert call(client, method, path, body, {"Authorization": f"Bearer {key}"}).status_code == 200


def test_a_refused_request_is_counted(client: httpx.Client) -> None:
    def unauthorized() -> float:
        text = client.get("/metrics", headers={"Authorization": "Bearer metrics-key"}).text
        line = next(x for x in text.splitlines() if x.startswith('inferd_requests_rejected_total{reason="unauth'))
        return float(line.rsplit(" ", 1)[1])

    before = unauthorized()
    assert_401(client.post("/predict", json={"texts": ["x"]}))
    assert unauthorized() == before + 1


def test_the_key_is_checked_before_the_body_is_read(client: httpx.Client) -> None:
    # A caller without a key learns nothing about the API, not even that its body is malformed.
    assert_401(client.post("/predict", content=b"{not json"))
    assert_401(client.post("/admin/models/reload", content=b"{not json", headers={"Authorization": "Bearer key-1"}))


def test_health_stays_public(client: httpx.Client) -> None:
    for path in HEALTH:
        assert client.get(path).status_code == 200, path


def test_metrics_need_the_metrics_key_not_an_api_key(client: httpx.Client) -> None:
    for headers in (*REFUSED, {"Authorization": "Bearer key-1"}):
        assert_401(client.get("/metrics", headers=headers))
    r = client.get("/metrics", headers={"Authorization": "Bearer metrics-key"})
    assert r.status_code == 200 and "inferd_requests_total" in r.text


@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/admin/models"), ("POST", "/admin/models/reload"), ("POST", "/admin/models/canary"),
    ("POST", "/admin/models/promote"), ("POST", "/admin/models/rollback")])
def test_admin_routes_need_the_admin_key(client: httpx.Client, method: str, path: str) -> None:
    for headers in (*REFUSED[:6], {"Authorization": "Bearer key-1"}, {"Authorization": "Bearer metrics-key"}):
        assert_401(client.request(method, path, headers=headers))


def test_the_admin_key_opens_the_admin_routes(client: httpx.Client) -> None:
    r = client.get("/admin/models", headers={"Authorization": "Bearer admin-key"})
    assert r.status_code == 200 and r.json()["slots"][0]["role"] == "active"
    # Authorised, then validated: the admin key reaches the body checks.
    r = client.post("/admin/models/reload", json={"path": "https://example.com/m", "version": "v9"},
                    headers={"Authorization": "Bearer admin-key"})
    assert r.status_code == 422 and "only local folders" in r.json()["error"]["message"]


def test_no_redirect_nor_admin_answer_comes_before_the_key(client: httpx.Client) -> None:
    # A slash too many once got a 307 built from the Host header, before any key was asked for.
    for method, path in (("GET", "/admin/models/"), ("POST", "/admin/models/reload/"), ("POST", "/v1/embeddings/"),
                         ("GET", "/v1/models/")):
        r = client.request(method, path, headers={"Host": "evil.example"})
        assert r.status_code == 404 and "location" not in r.headers, (path, r.status_code, r.headers)
        assert r.json()["error"]["code"] == "not_found"


def test_the_docs_need_an_api_key_and_never_list_the_admin_routes(client: httpx.Client) -> None:
    for path in ("/openapi.json", "/docs", "/redoc"):
        for headers in ({}, {"Authorization": "Bearer admin-key"}):
            assert_401(client.get(path, headers=headers))
    keyed = {"Authorization": "Bearer key-1"}
    doc = client.get("/openapi.json", headers=keyed).json()
    assert {"/predict", "/v1/embeddings", "/health/live"} <= set(doc["paths"])
    assert not [p for p in doc["paths"] if p.startswith("/admin")] and "AdminModels" not in doc["components"]["schemas"]
    assert "swagger" in client.get("/docs", headers=keyed).text.lower()


def test_the_openai_client_with_and_without_the_key(keyed: Server) -> None:
    good = openai.OpenAI(base_url=keyed.url + "/v1", api_key="key-2", max_retries=0)
    assert len(good.embeddings.create(model="tiny", input=["hello world"]).data[0].embedding) == 32
    bad = openai.OpenAI(base_url=keyed.url + "/v1", api_key="not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        bad.embeddings.create(model="tiny", input=["hello world"])
    assert caught.value.status_code == 401


# -- the admin port, and nothing configured --------------------------------------------------------------


def test_admin_routes_move_to_a_loopback_port(serve: Callable[..., Server], tiny_model: Path) -> None:
    admin_port = free_port()
    # The main listener on every interface, as in production; the admin listener must stay on loopback.
    s = serve({"INFERD__MODEL__PATH": str(tiny_model), "INFERD__SERVER__HOST": "0.0.0.0",
               "INFERD__SERVER__ADMIN_PORT": str(admin_port), "INFERD__SERVER__ADMIN_KEY": "admin-key"},
              wait="/health/ready")
    listening = {c.laddr.port: c.laddr.ip for c in psutil.Process(s.proc.pid).net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN}
    assert listening == {s.port: "0.0.0.0", admin_port: "127.0.0.1"}
    admin = {"Authorization": "Bearer admin-key"}
    with s.client() as main, httpx.Client(base_url=s.admin_url, timeout=30) as side:
        r = main.get("/admin/models", headers=admin)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        assert main.post("/admin/models/promote", headers=admin).status_code == 404
        assert side.get("/admin/models", headers=admin).json()["slots"][0]["role"] == "active"
        assert_401(side.get("/admin/models"))
        assert_401(side.get("/admin/models", headers={"Authorization": "Bearer nope"}))
        assert side.post("/admin/models/rollback", headers=admin).status_code == 409  # reached: no canary
        assert side.post("/predict", json={"texts": ["x"]}).status_code == 404  # admin only
        # No api_keys, no metrics_key: inference and metrics are open.
        assert main.post("/predict", json={"texts": ["hello"]}).status_code == 200
        assert main.get("/metrics").status_code == 200
    assert s.stop() == 0  # SIGTERM after the admin calls: a clean exit


def test_admin_routes_do_not_exist_without_an_admin_key(tiny_model: Path) -> None:
    # The app itself, no server process: the refusal comes before any model work.
    settings = make_settings(tiny_model, layered="dev")
    app = create_app(settings)

    async def statuses() -> list[tuple[int, str]]:
        out = []
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            for method, path in (("GET", "/admin/models"), ("POST", "/admin/models/reload"),
                                 ("POST", "/admin/models/promote")):
                for headers in ({}, {"Authorization": "Bearer anything"}):
                    r = await c.request(method, path, headers=headers)
                    out.append((r.status_code, r.json()["error"]["code"]))
        return out

    assert set(asyncio.run(statuses())) == {(404, "not_found")}
