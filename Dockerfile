# syntax=docker/dockerfile:1
# pd-gateway: the gateway and the engine emulator in one small image (docs/deployment.md).
#
#   docker build -t pd-gateway .
#   docker run --rm -p 8000:8000 -v "$PWD/gateway.toml:/etc/pd-gateway/gateway.toml:ro" pd-gateway
#   docker run --rm pd-gateway emulate --engine sglang --role prefill --host 0.0.0.0 --port 30000
#
# Build stage: the package and its dependencies (uvloop, httptools, msgspec: wheels; aiohttp for
# the emulator) into a venv.
# Runtime stage: that venv alone on the slim base, run as an unprivileged user. The admin token,
# worker API keys and every other secret come from the environment at run time, never the image.
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/pd-gateway
WORKDIR /src
COPY pyproject.toml README.md ./
COPY common ./common
COPY gateway ./gateway
COPY policies ./policies
COPY adapters ./adapters
COPY emulator ./emulator
COPY pd_gateway ./pd_gateway
RUN /opt/pd-gateway/bin/pip install '.[kubernetes,emulator]' \
    && /opt/pd-gateway/bin/python -c "import uvloop, httptools, msgspec, kubernetes_asyncio, aiohttp, pd_gateway.cli, gateway.serve, emulator.api"

FROM python:${PYTHON_VERSION}-slim
COPY --from=build /opt/pd-gateway /opt/pd-gateway
RUN useradd --system --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin pdgw
ENV PATH=/opt/pd-gateway/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PD_GATEWAY_HEALTH_URL=http://127.0.0.1:8000/health
USER 10001:10001
EXPOSE 8000
# the gateway's /health (an emulator container sets PD_GATEWAY_HEALTH_URL to its own port)
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; sys.exit(0 if urllib.request.urlopen(os.environ['PD_GATEWAY_HEALTH_URL'], timeout=2).status == 200 else 1)"]
ENTRYPOINT ["pd-gateway"]
CMD ["serve", "--config", "/etc/pd-gateway/gateway.toml"]
