"""jobs/lines.py LineRunner: a job's lines reach the route a bounded number at a time, and every line is answered."""

from __future__ import annotations

import asyncio

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response

from inferd.api.schemas import EmbeddingsRequest
from inferd.jobs.lines import Endpoint, Line, LineRunner


def test_lines_reach_the_route_a_bounded_number_at_a_time_over_concurrent_runs():
    inside, most = 0, 0

    async def route(request: Request) -> Response:
        nonlocal inside, most
        body = orjson.loads(await request.body())
        inside += 1
        most = max(most, inside)
        await asyncio.sleep(0.001)
        inside -= 1
        return Response(orjson.dumps({"echo": body["input"], "priority": body["priority"]}), 200)

    endpoint = Endpoint("/v1/embeddings", EmbeddingsRequest, -100, route)
    runner = LineRunner(Starlette(), in_flight=5)

    async def both() -> list[list]:
        chunks = [[Line(n, f"c{n}", {"input": f"t{n}"}) for n in range(k, k + 40)] for k in (0, 40)]
        return list(await asyncio.gather(*(runner.route_lines(chunk, endpoint, None) for chunk in chunks)))

    first, second = asyncio.run(both())
    assert most == 5  # the bound holds across the two chunks' runs, and is used
    records = [*first, *second]
    assert [r.number for r in records] == list(range(80))  # every line answered, in its chunk's order
    for r in records:
        got = orjson.loads(r.data)
        assert r.ok and got["custom_id"] == f"c{r.number}"
        assert got["response"]["body"] == {"echo": f"t{r.number}", "priority": -100}
