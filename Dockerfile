# Collage's images, installed from the wheel (never an editable checkout). One Dockerfile, two images:
#   web node (no torch):  docker build -t collage-web .
#   GPU worker:           docker build --build-arg EXTRAS=worker,postgres,redis,s3 \
#                           --build-arg BASE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime -t collage-worker .
ARG BASE=python:3.11-slim

FROM python:3.11-slim AS wheel
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY app ./app
COPY worker ./worker
COPY training ./training
COPY templates ./templates
COPY migrations ./migrations
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /dist .

FROM ${BASE}
# the extras this image installs: web,postgres,redis,s3 for the web node, worker,postgres,redis,s3 for GPU workers
ARG EXTRAS=web,postgres,redis,s3
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 COLLAGE_HOME=/home-web
COPY --from=wheel /dist /tmp/dist
RUN pip install --no-cache-dir "$(ls /tmp/dist/collage_rl-*.whl)[${EXTRAS}]" && rm -rf /tmp/dist
COPY examples /opt/collage/examples

# never root: the web node and the workers run as this user
RUN useradd --create-home --uid 1000 collage \
    && mkdir -p /home-web /home-worker /datasets /models \
    && chown collage /home-web /home-worker /datasets /models
USER collage
WORKDIR /home/collage
EXPOSE 8000
# the web node; workers override the command (see docker-compose.yml)
CMD ["collage", "serve", "--host", "0.0.0.0", "--port", "8000", "--workers", "0"]
