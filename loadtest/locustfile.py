"""Locust load test, the seed's way (its section 4.5), against a running inferd (or the naive baseline).

Headless and bounded in time, e.g.:

    locust -f loadtest/locustfile.py --headless -u 32 -r 8 -t 30s --host http://127.0.0.1:8000

Texts come from the benchmark's corpus (bench/README.md), so locust and ``inferd bench`` send the same
mix of lengths and languages. Environment knobs:
  LOCUST_TEXTS_PER_REQUEST  texts per request (default 1; the seed's example sent 4)
  LOCUST_WAIT               "seed" = think time between 0.1 and 0.5 s, as the seed; "none" = closed loop
  LOCUST_API_KEY            Bearer key, when the server has server.api_keys set
  LOCUST_EMBEDDINGS_SHARE   share of requests sent to /v1/embeddings instead of /predict (default 0.25;
                            set 0 for the naive baseline, which only has /predict)
Locust's own numbers include its client overhead (gevent, Python requests); for the figures that matter
(ceiling ratio, open-loop tails) use ``inferd bench``.
"""

from __future__ import annotations

import itertools
import os
import random

from locust import FastHttpUser, between, constant, task

from inferd.corpus import texts as corpus_texts

TEXTS_PER_REQUEST = int(os.environ.get("LOCUST_TEXTS_PER_REQUEST", "1"))
EMBEDDINGS_SHARE = float(os.environ.get("LOCUST_EMBEDDINGS_SHARE", "0.25"))
_CORPUS = corpus_texts()
_SHUFFLED = random.Random(0).sample(_CORPUS, len(_CORPUS))
_cursor = itertools.cycle(range(len(_SHUFFLED)))


def _next_texts() -> list[str]:
    return [_SHUFFLED[next(_cursor)] for _ in range(TEXTS_PER_REQUEST)]


class InferenceUser(FastHttpUser):
    wait_time = constant(0) if os.environ.get("LOCUST_WAIT", "seed") == "none" else between(0.1, 0.5)

    def on_start(self) -> None:
        key = os.environ.get("LOCUST_API_KEY")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    @task
    def embed(self) -> None:
        texts = _next_texts()
        if random.random() < EMBEDDINGS_SHARE:
            self._call("/v1/embeddings", {"input": texts}, "data", len(texts))
        else:
            self._call("/predict", {"texts": texts}, "results", len(texts))

    def _call(self, path: str, body: dict, field: str, expected: int) -> None:
        with self.client.post(path, json=body, headers=self.headers, catch_response=True) as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}: {r.text[:200]}")
                return
            try:
                got = len(r.json()[field])
            except (ValueError, KeyError, TypeError):
                r.failure(f"no {field!r} list in the answer")
                return
            if got != expected:
                r.failure(f"{got} vectors for {expected} texts")
            else:
                r.success()
