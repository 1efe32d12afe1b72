from __future__ import annotations


def test_tiny_model_serves_embeddings(serve, tiny_model):
    server = serve({"INFERD__MODEL__PATH": str(tiny_model)}, wait="/health/ready")
    with server.client() as c:
        r = c.post("/predict", json={"texts": ["hello world", "the cat"]})
        assert r.status_code == 200, r.text
        body = r.json()
        assert len(body["results"]) == 2 and len(body["results"][0]) == 32
        assert body["results"][0] != body["results"][1]
