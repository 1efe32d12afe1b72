"""Batch job helpers the batch suites share: input files, waiting for a batch to end, reading its output."""

from __future__ import annotations

import json
from typing import Any

import httpx
from conftest import wait_for

FINAL = ("completed", "failed", "expired", "cancelled")


def line(custom_id: str, body: dict[str, Any], url: str = "/v1/embeddings") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def embedding_lines(n: int, prefix: str = "t") -> list[str]:
    """``n`` lines of distinct texts, custom_id ``{prefix}{i}``."""
    return [line(f"{prefix}{i}", {"input": f"text number {i} of the corpus, {i % 7} words"}) for i in range(n)]


def jsonl(lines: list[str]) -> bytes:
    return ("\n".join(lines) + "\n").encode()


def upload(client: httpx.Client, data: bytes, name: str = "in.jsonl", purpose: str = "batch") -> httpx.Response:
    return client.post("/v1/files", files={"file": (name, data)}, data={"purpose": purpose})


def create(client: httpx.Client, file_id: str, endpoint: str = "/v1/embeddings") -> httpx.Response:
    return client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": endpoint,
                                            "completion_window": "24h"})


def wait_final(client: httpx.Client, batch_id: str, timeout: float = 180.0) -> dict[str, Any]:
    """The batch once it is in a final state (polled every 0.2 s)."""

    def final() -> dict[str, Any] | None:
        batch = client.get(f"/v1/batches/{batch_id}").json()
        return batch if batch["status"] in FINAL else None

    found = wait_for(final, timeout, f"batch {batch_id} final", every=0.2)
    assert isinstance(found, dict)
    return found


def records(client: httpx.Client, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    answer = client.get(f"/v1/files/{file_id}/content")
    assert answer.status_code == 200, answer.text
    return [json.loads(raw) for raw in answer.content.splitlines() if raw.strip()]
