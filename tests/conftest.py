"""Shared fixtures: the real embedded tiny checkpoint, loaded through the public loader."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# before torch: the service's thread settings must be in place when torch loads (service/__init__.py)
import service  # noqa: E402,F401

# isort: split
import torch  # noqa: E402

from service.engine.engine import Engine  # noqa: E402
from service.model.loading import load_model  # noqa: E402
from service.model.prompts import prepare_prompt  # noqa: E402
from service.random_checkpoints.embedded import embedded_model_dir  # noqa: E402
from service.settings import load_settings  # noqa: E402

# Tests use the embedded model built in a cache of their own, never a user's MODEL_PATH.
os.environ.pop("MODEL_PATH", None)


def pytest_collection_modifyitems(items):
    """Every test that runs on a real Gunicorn (through the `serve` fixture, itself or under a shared
    server's fixture, or `gunicorn_server` itself: those mark themselves) is a `server` test: the
    quick tier leaves them out."""
    for item in items:
        if "serve" in item.fixturenames:
            item.add_marker(pytest.mark.server)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """A cache of the session's own; TEST_CACHE_DIR: one a parent test run already filled (the
    embedded model and kernels built once)."""
    given = os.environ.get("TEST_CACHE_DIR")
    return Path(given) if given else tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session", autouse=True)
def kernels_in_the_test_cache(cache_dir):
    """The native kernels build into the session's cache, never a user's."""
    from service import native

    native.configure(cache_dir)


@pytest.fixture(scope="session", autouse=True)
def tests_compute_on_two_threads():
    """The tests' own forwards (against transformers', in the main thread) on two threads, as a
    script that asks would; every other thread keeps the default of one (service/threads.py)."""
    from service.threads import compute_on

    compute_on(2)


@pytest.fixture(scope="session")
def tiny_dir(cache_dir) -> Path:
    return embedded_model_dir(cache_dir)


def built_preset(cache_dir: Path, preset: str) -> Path:
    """`make-model --preset PRESET` under the cache (embedded-PRESET), built once per cache."""
    from service.random_checkpoints.make import make_checkpoint

    path = cache_dir / f"embedded-{preset}"
    if not (path / "config.json").exists():
        staging = Path(tempfile.mkdtemp(prefix=".building-", dir=cache_dir))
        make_checkpoint(preset, staging)
        try:
            staging.rename(path)
        except OSError:  # another session sharing TEST_CACHE_DIR finished first
            shutil.rmtree(staging, ignore_errors=True)
    return path


@pytest.fixture(scope="session")
def tiny_moe_dir(cache_dir) -> Path:
    """The mixture-of-experts test model (`make-model --preset tiny-moe`)."""
    return built_preset(cache_dir, "tiny-moe")


@pytest.fixture(scope="session")
def tiny_thinking_dir(cache_dir) -> Path:
    """The embedded model's Thinking twin (`make-model --preset tiny-thinking`)."""
    return built_preset(cache_dir, "tiny-thinking")


@pytest.fixture(scope="session")
def no_end_of_turn(tiny_dir) -> dict[str, int]:
    """A logit_bias that keeps the embedded model from ending its answer: for tests that need an
    answer of exactly max_tokens (the random model's greedy text may end anywhere)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    return {str(tokenizer.convert_tokens_to_ids(t)): -100 for t in ("<|im_end|>", "<|endoftext|>")}


# Token limits that cut a forced tool call in its tag, just after it, in its opening brace, in its name
# (the embedded tokenizer's pieces: `<`, `<tool_call`, `<tool_call>`, `<tool_call>\n{"`, `…"name": "ge`).
BEFORE_THE_NAME = [1, 8, 9, 12, 20]


CHROMIUM = Path("/usr/bin/chromium")  # Debian's package: Playwright's own browser download is not used
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def browser():
    """Debian's headless Chromium driven by Playwright (the page tests)."""
    from playwright.sync_api import sync_playwright

    if not CHROMIUM.exists():
        pytest.fail("the browser tests need Debian's Chromium: apt-get install -y chromium chromium-driver")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


def run_probe(script: str, cache_dir, env: dict[str, str]) -> dict:
    """The JSON a probe script prints, run in a fresh Python with `env` added (how the tests reach
    the forced AVX2 paths: those settings are read once per process). The script gets the tests'
    folder and the session's cache as its arguments."""
    import json
    import subprocess

    done = subprocess.run(
        [sys.executable, "-c", script, str(ROOT / "tests"), str(cache_dir)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def run_cli(*args: str, timeout: float = 120):
    """`python -m service *args` in the checkout, as a user types it: the finished process, its
    output as text."""
    import subprocess

    command = [sys.executable, "-m", "service", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def own_kv_disk_dir() -> str:
    """A new empty folder for a disk tier (KV_DISK_DIR), removed when the session ends: an engine or a
    server of a test starts with its caches empty unless the test shares a folder on purpose."""
    return tempfile.mkdtemp(prefix="kv-", dir=_KV_DIRS)


_KV_DIRS = tempfile.mkdtemp(prefix="qwen3vl-test-kv-")
atexit.register(shutil.rmtree, _KV_DIRS, True)


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in text.splitlines() if line.startswith("flags")), set())


# Tests that compare the AVX2 paths with this CPU's own have nothing to compare on a CPU without
# AVX-512: its own paths are the AVX2 ones, which the whole suite runs (a test condition, not a kernel choice).
HAS_AVX512 = "avx512f" in _cpu_flags()
ONLY_AVX2 = "this CPU has no AVX-512: its own paths are the AVX2 ones, which the suite runs"


def make_settings(cache_dir, **overrides):
    overrides.setdefault("kv_disk_dir", own_kv_disk_dir())
    return load_settings(cache_dir=cache_dir, threads=2, **overrides)


def generate_config(engine, params, max_new_tokens: int):
    """A transformers GenerationConfig for `model.generate` with the sampling the service resolves
    for `params` (service/engine/sampling.Sampling): what the tests compare the engine's draws with."""
    from transformers import GenerationConfig

    from service.engine.sampling import Sampling

    s = Sampling.resolve(params, engine.model.generation_config)
    sampled = dict(do_sample=True, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        repetition_penalty=s.repetition_penalty,
        eos_token_id=engine.loaded.eos_token_ids,
        pad_token_id=engine.loaded.eos_token_ids[0],
        **(sampled if not s.greedy else dict(do_sample=False)),
    )


def prepared(engine, request):
    """The request's prompt as the engine prepares it (tokens, spans, patches), without running it."""
    return prepare_prompt(engine.processor, request.messages, engine.limits.prompt)


@pytest.fixture(scope="session")
def serve(cache_dir, tiny_dir, tmp_path_factory):
    """serve(env, name, **kw): a real Gunicorn on the embedded model (tests.servers.gunicorn_server),
    logging to serve.log(name) under the session's temporary directory."""
    from servers import gunicorn_server

    logs = tmp_path_factory.mktemp("server-logs")

    def start(env: dict[str, str], name: str = "gunicorn", **kwargs):
        env = {"CACHE_DIR": str(cache_dir), "KV_DISK_DIR": own_kv_disk_dir(), **env}
        return gunicorn_server(env, start.log(name), **kwargs)

    start.log = lambda name: logs / f"{name}.log"
    return start


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory) -> str:
    """The URL of one real redis-server for the session (tests.servers.redis_server); a test that
    needs it empty flushes its database."""
    from servers import redis_server

    with redis_server(tmp_path_factory.mktemp("redis") / "redis.log") as url:
        yield url


INT4_DIR = "embedded-tiny-int4"  # under the session's cache: `int4_dir` writes it, `weights_settings` serves it


@pytest.fixture(scope="session")
def int4_dir(cache_dir, tiny_dir) -> Path:
    """The embedded model written as a 4-bit checkpoint (`python -m service quantize --bits 4`'s
    defaults: groups of 128 inputs where they divide, else 64 or 32; the vision tower INT8)."""
    from service.quant.writer import write_quantized

    path = cache_dir / INT4_DIR
    if not (path / "config.json").exists():
        write_quantized(tiny_dir, path, progress=False, bits=4)
    return path


def weights_settings(cache_dir, weights: str, **overrides):
    """Settings serving the embedded model with `weights`: fp32, int8 (quantized at load) or int4
    (the 4-bit checkpoint of `int4_dir`, which must exist)."""
    if weights == "int4":
        return make_settings(cache_dir, model_path=cache_dir / INT4_DIR, **overrides)
    return make_settings(cache_dir, quantization=weights, **overrides)


def in_a_mapping_of(address: int, directory) -> bool:
    """Whether `address` lies in this process's memory mapping of a file under `directory`."""
    for line in open("/proc/self/maps"):
        fields = line.split(maxsplit=5)
        low, high = (int(v, 16) for v in fields[0].split("-"))
        if low <= address < high:
            return len(fields) == 6 and fields[5].strip().startswith(str(directory))
    return False


def transformers_model(path: Path, quantization: str = "fp32", kernel: str = "fbgemm"):
    """The checkpoint as transformers' own model (`from_pretrained`, fp32), the reference the service's
    modules and forward are compared with; "int8": its projections fused and INT8-quantized as the
    service quantizes them (the same Linears in transformers' forward)."""
    from transformers import AutoConfig

    from service.quant.fusion import fuse_projections, model_class
    from service.quant.in_place import quantize_in_place

    model = model_class(AutoConfig.from_pretrained(path)).from_pretrained(path, dtype=torch.float32).eval()
    model.requires_grad_(False)
    if quantization == "int8":
        fuse_projections(model)
        quantize_in_place(model, kernel=kernel)
    return model


@pytest.fixture(scope="session")
def loaded_model(request, cache_dir, tiny_dir):
    """loaded_model(weights): the embedded model as `weights_settings(cache_dir, weights)` loads it
    (fp32, int8 or int4), loaded once a session. A test that wants those settings' model takes it:
    an Engine over it with other settings (caches, batch, KV dtype...) costs little next to a load."""
    made = {}

    def get(weights: str):
        if weights not in made:
            if weights == "int4":
                request.getfixturevalue("int4_dir")
            made[weights] = load_model(weights_settings(cache_dir, weights))
        return made[weights]

    return get


@pytest.fixture(scope="session", params=["fp32", "int8", "int4"])
def engine(request, cache_dir, loaded_model) -> Engine:
    return Engine(loaded_model(request.param), weights_settings(cache_dir, request.param))


@pytest.fixture(scope="session")
def fp32_engine(cache_dir, loaded_model) -> Engine:
    return Engine(loaded_model("fp32"), make_settings(cache_dir, quantization="fp32"))


def app_on(loaded, settings):
    """The service's Flask app (create_app, load="now") on a model already loaded, e.g. one of
    `loaded_model` with the same settings: its loader hands over `loaded` instead of loading again."""
    from service.api.app import create_app

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("service.model.loading.load_model", lambda settings, threads=None: loaded)
        return create_app(settings, load="now")


# -- servers shared by the session's modules (one Gunicorn start each) ------------------------------

# The shared server's settings: enough new tokens and context for every module on it (the web page
# stops a 1,400-token answer), a 20 s video limit (tests/test_video.py sends a 25 s clip to be refused).
SHARED_ENV = {"MAX_NEW_TOKENS": "1500", "CONTEXT_LIMIT": "4096", "QUEUE_TIMEOUT": "60", "VIDEO_MAX_SECONDS": "20"}
KEY = "sk-test-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}
# The keyed server's settings: API keys, and per-request limits at their smallest (the most a log may hold).
KEYED_ENV = {
    "API_KEYS": f"other-key, {KEY}",
    "MAX_IMAGES_PER_REQUEST": "2",
    "MAX_MESSAGES": "3",
    "MAX_PROMPT_TOKENS": "300",
    "MAX_STOP_STRINGS": "2",
    "REQUEST_DEADLINE": "1.0",
    "MAX_NEW_TOKENS": "4000",
    "CONTEXT_LIMIT": "8192",
    "ACCESS_LOG": "1",
    "LOG_LEVEL": "debug",
}


@pytest.fixture(scope="session")
def shared_server_tmpdir(tmp_path_factory) -> Path:
    """The shared server's TMPDIR, its own: tests see that no temporary file outlives a request."""
    return tmp_path_factory.mktemp("shared-server-tmp")


@pytest.fixture(scope="session")
def shared_server(serve, shared_server_tmpdir) -> str:
    """The base URL of one Gunicorn with SHARED_ENV for every module that needs no settings of its own
    (the embedded model, INT8, bf16 keys and values, PRELOAD). Tests on it assume nothing about what
    other modules asked before them: counters as deltas, pictures and prompts of their own."""
    with serve({**SHARED_ENV, "TMPDIR": str(shared_server_tmpdir)}, "shared") as (base, _):
        yield base


@pytest.fixture(scope="session")
def keyed_server(serve):
    """(base URL, log file) of one Gunicorn with KEYED_ENV: API keys and small per-request limits."""
    with serve(KEYED_ENV, "keyed", headers=AUTH) as (base, _):
        yield base, serve.log("keyed")


@pytest.fixture(scope="session")
def unloadable_server(serve, tmp_path_factory) -> str:
    """The base URL of a Gunicorn whose model cannot load (a config.json of garbage): /health answers,
    /ready and every request 503 model_load_failed once the load has failed (model_loading before)."""
    broken = tmp_path_factory.mktemp("broken-model")
    (broken / "config.json").write_text('{"model_type": "qwen3_vl", "text_config": "garbage"}')
    with serve({"MODEL_PATH": str(broken)}, "unloadable", ready_path="/health") as (base, _):
        yield base
