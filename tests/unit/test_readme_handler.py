"""The documentation's example handler (docs/handler.md, "Writing a handler") is served as written: copied out of
the page."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from settingskit import make_settings

from inferd.api.app import create_app

PAGE = Path(__file__).resolve().parents[2] / "docs" / "handler.md"


@pytest.fixture
def example_package(tmp_path: Path) -> str:
    text = PAGE.read_text(encoding="utf-8")
    section = text[text.index("# Writing a handler"):]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None, "docs/handler.md's handler example is gone"
    pkg = tmp_path / "readme_example"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "lengths.py").write_text(code.group(1))
    sys.path.insert(0, str(tmp_path))
    yield "readme_example.lengths:LengthClassifier"
    sys.path.remove(str(tmp_path))
    for name in [m for m in sys.modules if m.startswith("readme_example")]:
        del sys.modules[name]


def test_the_readme_handler_serves_classify_and_not_embeddings(example_package: str, tmp_path: Path) -> None:
    # Warmed up, as a user's server runs the handler.
    settings = make_settings(tmp_path, model={"task": example_package, "warmup": True})
    with TestClient(create_app(settings)) as client:
        r = client.post("/v1/classify", json={"input": ["one two", " ".join(["word"] * 30)]})
        assert r.status_code == 200, r.text
        data = r.json()["data"]
        assert [d["label"] for d in data] == ["short", "long"] and data[0]["num_classes"] == 2
        assert client.get("/info").json()["task"] == "classification"
        r = client.post("/v1/embeddings", json={"input": "hello"})
        assert r.status_code == 404 and "classification task" in r.json()["error"]["message"]
