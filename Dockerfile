# The whole deployment in one container: Nginx on :8080 in front of one Gunicorn instance per
# core (python -m service.deploy). Build and run:
#   docker build -t qwen3vl-cpu .
#   docker run -p 8080:8080 -v /srv/models:/models -e MODEL_PATH=/models/Qwen3-VL-2B-Instruct qwen3vl-cpu
# Without MODEL_PATH it serves the embedded random test model (built once under /models/.cache).
FROM python:3.11-slim-bookworm

# Nginx in front, with its njs module (nginx/affinity.js routes each conversation to its instance); taskset
# (util-linux, part of every Debian image) pins the instances; gcc builds the exact attention kernel for
# the CPU the container runs on (service/native/attention.c, once, into /models/.cache).
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends nginx libnginx-mod-http-js gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# CPU-only torch first, from its own index: a torch pip resolves by itself is a multi-GB CUDA build.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY requirements.txt /app/requirements.txt
RUN pip install -r /app/requirements.txt

COPY . /app
WORKDIR /app
RUN useradd --create-home --uid 10001 service && mkdir -p /models && chown service /models
USER service

VOLUME /models
ENV CACHE_DIR=/models/.cache NGINX_LISTEN=0.0.0.0:8080
EXPOSE 8080
# Ready = the models are loaded and Nginx answers (the first load of a large checkpoint takes minutes;
# the deploy itself gives up after START_TIMEOUT, 900 s).
HEALTHCHECK --interval=30s --timeout=10s --start-period=960s --retries=3 CMD ["python", "-m", "service.deploy.healthcheck"]
# `docker stop` sends SIGTERM: a graceful stop (open streams get GRACEFUL_TIMEOUT, 30 s; so `docker stop -t 40`).
ENTRYPOINT ["python", "-m", "service.deploy"]
