# Helix Locks service image. BASE is any Debian-like image with python3 (>= 3.11) and its venv
# module; the default is the official slim Python image.
ARG BASE=python:3.12-slim-bookworm

FROM ${BASE} AS build
WORKDIR /src
RUN python3 -m venv /opt/helix-locks
COPY pyproject.toml README.md ./
COPY service ./service
COPY migrations ./migrations
RUN /opt/helix-locks/bin/pip install --no-cache-dir --disable-pip-version-check '.[server]'

FROM ${BASE}
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin helix
COPY --from=build /opt/helix-locks /opt/helix-locks
ENV PATH=/opt/helix-locks/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001
EXPOSE 8080
HEALTHCHECK --interval=5s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2)"]
# DATABASE_URL must be set: without it the service would start an embedded PostgreSQL inside
# the container, which is for laptops, not deployments.
CMD ["helix-locks", "serve", "--host", "0.0.0.0", "--port", "8080"]
