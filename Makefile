PYTHON ?= python3
PIP ?= $(PYTHON) -m pip

.PHONY: install test test-quick demo run nginx chromium redis

# torch first, alone: its CPU wheel (anything else resolves to a multi-GB CUDA build). Where pip
# has no local CPU wheel (plain PyPI), add the CPU index:
#   make test TORCH_INDEX="--index-url https://download.pytorch.org/whl/cpu"
TORCH_INDEX ?=
install:
	$(PIP) install --disable-pip-version-check -q torch==2.13.0 $(TORCH_INDEX)
	$(PIP) install --disable-pip-version-check -q -r requirements.txt

# Nginx and its njs module (nginx/affinity.js routes each conversation to its instance) for `make run`
# and the deployment tests: installed with apt-get when missing (as root).
NJS_MODULE = /usr/lib/nginx/modules/ngx_http_js_module.so
nginx:
	@{ command -v nginx >/dev/null || [ -x /usr/sbin/nginx ]; } && [ -f $(NJS_MODULE) ] || { \
	  [ "$$(id -u)" = 0 ] || { echo "nginx or its njs module is missing: sudo apt-get install nginx libnginx-mod-http-js" >&2; exit 1; }; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nginx libnginx-mod-http-js >/dev/null; }

# Debian's redis-server for the batch jobs' Redis store tests (JOB_STORE_URL=redis://; the fixture starts it), likewise.
redis:
	@command -v redis-server >/dev/null || { \
	  [ "$$(id -u)" = 0 ] || { echo "redis-server is missing (the job store tests need it): sudo apt-get install redis-server" >&2; exit 1; }; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null; }

# Debian's Chromium for the browser tests (tests/test_web_page.py; Playwright downloads nothing), likewise.
chromium:
	@[ -x /usr/bin/chromium ] || { \
	  [ "$$(id -u)" = 0 ] || { echo "chromium is missing (the browser tests need it): sudo apt-get install chromium" >&2; exit 1; }; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null; }

# The README's first command: the service (embedded random model unless MODEL_PATH is set) behind
# Nginx on localhost:8080 in front of pinned Gunicorn instances (CORES_PER_INSTANCE, NUMA, memory); Ctrl-C stops it.
run: install nginx
	$(PYTHON) -m service.deploy

# The README's test command: lint and format check, then the whole suite on the embedded tiny model.
test: install nginx chromium redis
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m pytest -q --durations=20 tests

# The edit loop: lint, then every test that needs no server, no Nginx, no browser and no long run
# (pytest.ini's markers; under two minutes on 2 cores). Installs the Python packages only: no root.
test-quick: install
	$(PYTHON) -m ruff check .
	$(PYTHON) -m pytest -q -m "not server and not nginx and not browser and not slow" tests

# Answer a question about a generated picture with the embedded (random!) model.
demo: install
	$(PYTHON) -m service chat --image tests/data/demo.png "What is in this picture?"
