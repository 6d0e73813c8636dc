"""Prometheus metrics, correct with several Gunicorn workers (prometheus_client multiprocess mode
when PROMETHEUS_MULTIPROC_DIR is set, which gunicorn.conf.py does before workers import this)."""

from __future__ import annotations

import os

import psutil
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess

_LATENCY = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
_TOKEN_GAP = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2)

REQUESTS = Counter("qwen3vl_requests_total", "HTTP requests by endpoint and status", ["endpoint", "status"])
# Priority classes (service/generation.priority_class): urgent (< 0), default (0), background (> 0)
PRIORITY_CLASSES = ("urgent", "default", "background")
QUEUE_DEPTH = Gauge(
    "qwen3vl_queue_depth",
    "requests waiting for the model, by priority class",
    ["priority"],
    multiprocess_mode="livesum",
)
PAUSED = Gauge("qwen3vl_paused", "sequences paused for more urgent requests", ["priority"], multiprocess_mode="livesum")
PREEMPTIONS = Counter("qwen3vl_preemptions_total", "sequences paused for a more urgent request", ["priority"])
GENERATING = Gauge("qwen3vl_generating", "generations running now", multiprocess_mode="livesum")
BATCH_SIZE = Gauge("qwen3vl_batch_size", "sequences in the running decode batch", multiprocess_mode="livesum")
PREFILL_WAIT = Histogram(
    "qwen3vl_prefill_wait_seconds",
    "admitted request to the start of its prefill (behind other prefills)",
    buckets=_LATENCY,
)
FIRST_TOKEN_WAIT = Histogram(
    "qwen3vl_first_token_wait_seconds",
    "admitted request to its first token (vision encode and prefill, interleaved with the batch's decoding)",
    buckets=_LATENCY,
)
TTFT = Histogram(
    "qwen3vl_time_to_first_token_seconds",
    "request arrival to first token, by priority class",
    ["priority"],
    buckets=_LATENCY,
)
INTER_TOKEN = Histogram(
    "qwen3vl_inter_token_seconds", "mean gap between streamed tokens per request", buckets=_TOKEN_GAP
)
QUEUE_WAIT = Histogram(
    "qwen3vl_queue_wait_seconds", "time waiting for the model, by priority class", ["priority"], buckets=_LATENCY
)
IMAGE_DECODE = Histogram("qwen3vl_image_decode_seconds", "image decoding per request", buckets=_LATENCY)
VISION_ENCODE = Histogram("qwen3vl_vision_encode_seconds", "vision encoder per request", buckets=_LATENCY)
PROMPT_TOKENS = Counter("qwen3vl_prompt_tokens_total", "prompt tokens processed or reused")
GENERATED_TOKENS = Counter("qwen3vl_generated_tokens_total", "tokens generated")
FINISHED = Counter("qwen3vl_generations_total", "generations by how they ended", ["finish_reason"])
# A stream's status (200) is sent before its first token: an error after that shows here, not in REQUESTS.
STREAM_ERRORS = Counter("qwen3vl_stream_errors_total", "streams that ended in an error event after their 200", ["code"])
RSS = Gauge("qwen3vl_process_rss_bytes", "resident memory of each worker", ["pid"], multiprocess_mode="liveall")
MEMORY_BUDGET = Gauge(
    "qwen3vl_memory_budget_bytes",
    "the instance's memory budget (MAX_MEMORY_MB or derived)",
    multiprocess_mode="livemax",
)
CACHE_BUDGET = Gauge("qwen3vl_cache_budget_bytes", "bytes each cache may hold", ["cache"], multiprocess_mode="livemax")
# The INT8 kernels serving (1 for the kernel of each part) and what each measured (service/quant/kernel_choice.py)
INT8_KERNEL = Gauge(
    "qwen3vl_int8_kernel", "1 for the INT8 kernel serving each part", ["part", "kernel"], multiprocess_mode="livemax"
)
INT8_KERNEL_MS = Gauge(
    "qwen3vl_int8_kernel_probe_milliseconds",
    "each INT8 kernel's time on this checkpoint's matrices at start: a decode row, a prefill piece",
    ["kernel", "rows"],
    multiprocess_mode="livemax",
)


def show_priority_classes() -> None:
    """Every class's series at zero from the start (dashboards and alerts find them before traffic)."""
    for label in PRIORITY_CLASSES:
        for metric in (QUEUE_DEPTH, PAUSED, PREEMPTIONS, QUEUE_WAIT, TTFT):
            metric.labels(label)


def show_cache(name: str, budget_bytes: int) -> None:
    """A cache's budget, and its hit and miss series at zero from the start (for the dashboard's hit rate)."""
    CACHE_BUDGET.labels(cache=name).set(budget_bytes)
    CACHE_HITS.labels(cache=name)
    CACHE_MISSES.labels(cache=name)


def record_int8_kernels(choice: dict | None) -> None:
    """The INT8 kernel choice (a KernelChoice as a dict; None without INT8 weights) as gauges."""
    if choice is None:
        return
    for part in ("decoder", "vision"):
        INT8_KERNEL.labels(part=part, kernel=choice[part]).set(1)
    for kernel, figures in choice["measured"].items():
        INT8_KERNEL_MS.labels(kernel=kernel, rows="1").set(figures["decode_ms"])
        INT8_KERNEL_MS.labels(kernel=kernel, rows=str(figures["rows"])).set(figures["prefill_ms"])


# Batch jobs: lines in the job store by state (every instance sees the same store), lines this instance ran
BATCH_LINES = Gauge(
    "qwen3vl_batch_lines", "batch lines in the job store, by state", ["state"], multiprocess_mode="livemax"
)
BATCH_LINES_RUNNING = Gauge(
    "qwen3vl_batch_lines_running", "batch lines this instance is running now", multiprocess_mode="livesum"
)
BATCH_LINES_RUN = Counter("qwen3vl_batch_lines_run_total", "batch lines this instance ran, by result", ["result"])
JOB_STORE_USABLE = Gauge(
    "qwen3vl_job_store_usable",
    "1 while the job store answers; 0: the Batch API answers 503 (SQLite file unusable, replaced or removed; "
    "Redis unreachable), the rest serves",
    multiprocess_mode="livemostrecent",  # a process that never used the store (the master) has no say
)


# Shared state (service/shared/): the Redis every machine's instances keep conversations in, and affinity
SHARED_STATE_USABLE = Gauge(
    "qwen3vl_shared_state_usable",
    "1 while the shared store (Redis) answers; 0: conversations are served from this instance's own state "
    "(a conversation of another instance starts afresh here), deletes answer 503",
    multiprocess_mode="livemostrecent",
)
SHARED_STATE_CONFLICTS = Counter(
    "qwen3vl_shared_state_conflicts_total",
    "records changed here while the shared store could not be reached, dropped when it was back because "
    "another instance had changed (or deleted) them meanwhile: the store's version kept, by kind",
    ["kind"],
)
AFFINITY_CONTINUATIONS = Counter(
    "qwen3vl_affinity_continuations_total",
    "requests whose affinity key (what the proxy routes by) came before, by API",
    ["api"],
)
AFFINITY_MISSES = Counter(
    "qwen3vl_affinity_misses_total",
    "of them, those whose key's previous request ran on another instance: its KV cache was computed elsewhere",
    ["api"],
)
AFFINITY_APIS = ("chat", "responses", "messages", "native")


def show_affinity() -> None:
    """Every API's affinity series at zero from the start (for the dashboard's miss rate)."""
    for api in AFFINITY_APIS:
        AFFINITY_CONTINUATIONS.labels(api)
        AFFINITY_MISSES.labels(api)


def record_batch_lines(counts: dict[str, int]) -> None:
    for state in ("pending", "leased", "done", "skipped"):
        BATCH_LINES.labels(state).set(counts.get(state, 0))


# Exact speculative decoding: guessed tokens by where they came from (grammar, lookup) and verdict
DRAFT_TOKENS = Counter("qwen3vl_draft_tokens_total", "guessed tokens verified", ["source", "result"])

# Structured outputs: grammars compiled per request (hit: reused from the compile cache; invalid: a 400)
GRAMMARS = Counter("qwen3vl_grammars_total", "answer grammars requested, by how compiling went", ["result"])

# Caches (conversation KV and vision features)
CACHE_HITS = Counter("qwen3vl_cache_hits_total", "cache lookups that reused something", ["cache"])
CACHE_MISSES = Counter("qwen3vl_cache_misses_total", "cache lookups that reused nothing", ["cache"])
CACHE_REUSED_TOKENS = Counter("qwen3vl_cache_reused_tokens_total", "prompt tokens taken from the KV cache")
SEARCH_ITEMS = Counter("qwen3vl_search_items_total", "inputs embedded or documents scored (search requests)", ["task"])
SEARCH_SECONDS = Histogram(
    "qwen3vl_search_seconds",
    "a search request's forwards, from its first step to its result",
    ["task"],
    buckets=_LATENCY,
)
CACHE_EVICTIONS = Counter("qwen3vl_cache_evictions_total", "entries evicted", ["cache", "reason"])
CACHE_BYTES = Gauge("qwen3vl_cache_bytes", "bytes held by each cache", ["cache"], multiprocess_mode="livesum")
CACHE_ENTRIES = Gauge("qwen3vl_cache_entries", "entries held by each cache", ["cache"], multiprocess_mode="livesum")

# The conversation cache's disk tier (service/caches/kv_disk/); its hits, misses, evictions and
# budget are the cache metrics above with cache="kv_disk". One store serves the machine's instances.
KV_DISK_READ_BYTES = Counter("qwen3vl_kv_disk_read_bytes_total", "bytes of keys and values read from the disk tier")
KV_DISK_WRITTEN_BYTES = Counter("qwen3vl_kv_disk_written_bytes_total", "bytes written to the disk tier")
KV_DISK_LOAD_SECONDS = Histogram(
    "qwen3vl_kv_disk_load_seconds", "reading a prefix's keys and values from the disk tier", buckets=_LATENCY
)
KV_DISK_REJECTED = Counter(
    "qwen3vl_kv_disk_rejected_files_total",
    "disk-tier entries not used (and removed): foreign, truncated, corrupt (another block's content too), "
    "not_a_file, unreadable",
    ["reason"],
)
KV_DISK_READ_TIMEOUTS = Counter(
    "qwen3vl_kv_disk_read_timeouts_total", "disk-tier reads given up at their deadline (the request recomputed)"
)
KV_DISK_USABLE = Gauge(
    "qwen3vl_kv_disk_usable",
    "1 while the disk tier's folder is usable; 0: the tier is off (not a folder, read-only, unwritable, no inodes)",
    multiprocess_mode="livemostrecent",  # set where the tier is made (the master, with PRELOAD) or turned off
)
KV_DISK_PENDING = Gauge(
    "qwen3vl_kv_disk_pending_writes", "kept conversations not yet written to the disk tier", multiprocess_mode="livesum"
)
KV_DISK_BYTES = Gauge(
    "qwen3vl_kv_disk_bytes", "bytes the disk tier's files hold (at the last scan)", multiprocess_mode="livemax"
)


# Tenants (service/api/access/tenants.py): by tenant name, a bounded set — the first MAX_TENANT_LABELS names of
# the keys in force, sorted; any other is counted as "other" ("" without keys).
MAX_TENANT_LABELS = 64
_tenant_labels: frozenset[str] = frozenset()
TENANT_REQUESTS = Counter(
    "qwen3vl_tenant_requests_total", "HTTP requests with a key, by tenant and status", ["tenant", "status"]
)
TENANT_TOKENS = Counter(
    "qwen3vl_tenant_tokens_total",
    "tokens by tenant: prompt (cached ones included), cached, completion",
    ["tenant", "kind"],
)
TENANT_REFUSED = Counter(
    "qwen3vl_tenant_refused_total",
    "requests refused (429) by a tenant's own limit: queue, rpm, tpm",
    ["tenant", "limit"],
)
TENANT_PLACES = Gauge(
    "qwen3vl_tenant_batch_places",
    "places in the batch each tenant's requests hold",
    ["tenant"],
    multiprocess_mode="livesum",
)
TENANT_QUEUE_DEPTH = Gauge(
    "qwen3vl_tenant_queue_depth",
    "each tenant's requests waiting for the model",
    ["tenant"],
    multiprocess_mode="livesum",
)


def show_tenants(names: list[str]) -> None:
    """The tenant names that get a label of their own (at most MAX_TENANT_LABELS), their series at zero."""
    global _tenant_labels
    _tenant_labels = frozenset(sorted(names)[:MAX_TENANT_LABELS])
    for name in _tenant_labels:
        TENANT_PLACES.labels(name)
        TENANT_QUEUE_DEPTH.labels(name)


def tenant_label(name: str) -> str:
    """A tenant's label: its name if it has one of its own, else "other" ("" for no tenant)."""
    return name if not name or name in _tenant_labels else "other"


def render() -> tuple[bytes, str]:
    """The exposition text of every worker (multiprocess) or of this process."""
    RSS.labels(pid=str(os.getpid())).set(psutil.Process().memory_info().rss)
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry), "text/plain; version=0.0.4; charset=utf-8"
    from prometheus_client import REGISTRY

    return generate_latest(REGISTRY), "text/plain; version=0.0.4; charset=utf-8"
