# One image for the web app and the GPU workers. GPU hosts: build with a CUDA base, e.g.
#   docker build --build-arg BASE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime -t collage .
ARG BASE=python:3.11-slim
FROM ${BASE}

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 COLLAGE_HOME=/data
WORKDIR /opt/collage

COPY pyproject.toml README.md ./
COPY app ./app
COPY worker ./worker
COPY training ./training
COPY templates ./templates
COPY migrations ./migrations
COPY examples ./examples
# editable: templates/, migrations/ and app/static/ are read from this folder
RUN pip install --no-cache-dir -e .

RUN useradd --create-home --uid 1000 collage && mkdir -p /data && chown collage /data
USER collage
VOLUME ["/data"]
EXPOSE 8000
# the web node; workers override the command (see docker-compose.yml)
CMD ["collage", "serve", "--host", "0.0.0.0", "--port", "8000", "--workers", "0"]
