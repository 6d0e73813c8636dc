"""Deployment on a low-memory server: threads, start-up, memory under the default budget, worker
recovery, the memory-mapped mode.

    flock /tmp/heavy.lock python -m bench.bench_deploy            # 2B-shaped INT8 checkpoint, 2 threads

1. Threads: time to first token (one 448×448 picture + a question) and decode tokens/s of the
   engine with 1 and with 2 threads (fresh processes).
2. Start → ready: a Gunicorn instance from process start to `/ready` 200, the code of `--baseline`
   against today's, alternating (A B B A).
3. Memory: one Gunicorn instance (the default deployment on this machine) answering 30 requests —
   10 three-turn conversations, each opening with a picture — with the defaults (no
   MAX_MEMORY_MB), with MAX_MEMORY_MB=3500, and inside a 4 GiB memory cgroup (a small server):
   RSS after loading, at the end and at its peak, the cgroup's peak, cache hits, refusals.
4. Recovery: SIGKILL of the worker mid-stream → the instance answering /ready again.
5. Memory-mapped weights (a budget too small for the packed ones): TTFT and decode with bf16
   activations (today) and fp32 ones (before), against the packed mode; greedy agreement with it.
"""

from __future__ import annotations

import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

import psutil
import requests
from tqdm import tqdm

from bench.core import ROOT
from bench.core.client import picture_conversations
from bench.core.harness import isolated, parse, parser, short_rev, tree_at
from bench.core.results import markdown_table, report
from bench.core.servers import gunicorn_server, memory_cgroup, metric
from bench.core.session import Session

BASELINE = "6ed1729"  # the session's start: FBGEMM packing, the worker loads the model
MIB = 1024**2


def measure(model_path: str, threads: int, max_memory_mb: int | None = None, mapped_activations: str | None = None):
    """W1 time to first token, decode tokens/s and the greedy tokens of one engine in this process;
    `mapped_activations`: those of memory-mapped weights (a MAX_MEMORY_MB too small for packed ones)."""
    session = Session(model_path, threads, max_memory_mb=max_memory_mb)
    if mapped_activations is not None:
        from service.quant.int8_linear import MappedInt8Linear

        for module in session.model.modules():
            if isinstance(module, MappedInt8Linear):
                module.activations = mapped_activations
    return session.first_token_and_decode(repeats=1, decode_tokens=32)


def start_to_ready(env: dict, root: Path, log_path: Path) -> float:
    t0 = time.monotonic()
    with gunicorn_server(env, log_path, timeout=600, root=root, poll=0.05):
        return time.monotonic() - t0


def _worker(pid: int) -> psutil.Process:
    children = psutil.Process(pid).children()
    return children[0] if children else psutil.Process(pid)


def _rss(pid: int) -> int:
    """RSS minus file-backed pages of the Gunicorn worker (the process the budget counts)."""
    info = _worker(pid).memory_info()
    return info.rss - info.shared


def _peak_rss(pid: int) -> int:
    status = Path(f"/proc/{_worker(pid).pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM"))) * 1024


def conversations(env: dict, log_path: Path, cgroup=None) -> dict:
    """10 three-turn picture conversations through one Gunicorn instance: memory and outcomes."""
    with gunicorn_server(env, log_path, timeout=900, preexec_fn=cgroup.enter if cgroup else None) as (base, proc):
        loaded_rss = _rss(proc.pid)
        statuses = picture_conversations(base)
        return {
            "loaded_gib": loaded_rss / 1024**3,
            "end_gib": _rss(proc.pid) / 1024**3,
            "peak_gib": _peak_rss(proc.pid) / 1024**3,
            "budget_mib": metric(base, "qwen3vl_memory_budget_bytes") / MIB,
            "kv_budget_mib": metric(base, "qwen3vl_cache_budget_bytes", 'cache="conversation"') / MIB,
            "kv_hits": metric(base, "qwen3vl_cache_hits_total", 'cache="conversation"'),
            "ok": statuses.count(200),
            "refused": statuses.count(503),
            "requests": len(statuses),
            "cgroup_peak_gib": cgroup.peak_bytes() / 1024**3 if cgroup else None,
            "oom_kills": cgroup.oom_kills() if cgroup else None,
        }


def recovery(env: dict, log_path: Path) -> float:
    """Seconds from SIGKILL of the worker, mid-stream, to /ready 200 again."""
    with gunicorn_server(env, log_path, timeout=900) as (base, proc):
        worker = psutil.Process(proc.pid).children()[0]
        with requests.post(
            base + "/v1/chat", json={"prompt": "Talk forever.", "max_tokens": 500}, stream=True, timeout=60
        ) as stream:
            next(stream.iter_lines())
            killed = time.monotonic()
            os.kill(worker.pid, signal.SIGKILL)
        while True:
            try:
                if (
                    requests.get(base + "/ready", timeout=1).status_code == 200
                    and psutil.Process(proc.pid).children()[0].pid != worker.pid
                ):
                    return time.monotonic() - killed
            except (requests.RequestException, IndexError):
                pass
            time.sleep(0.02)


def main(argv=None) -> int:
    p = parser(__doc__, baseline=BASELINE)
    p.add_argument("--mapped-budget-mb", type=int, default=1500, help="MAX_MEMORY_MB that forces the mapped mode")
    args = parse(p, argv)
    model_path = args.model_path
    logs = Path(tempfile.mkdtemp(prefix="bench-deploy-"))
    bar = tqdm(total=17, desc="bench_deploy", unit="step")
    sections = []

    # 1. threads
    threads = {}
    for n in (1, 2):
        threads[n] = isolated("bench.bench_deploy:measure", model_path=str(model_path), threads=n)
        bar.update()
    sections.append(
        markdown_table(
            ["threads", "W1 time to first token (s)", "decode (tok/s)"],
            [[n, r["ttft_s"], r["decode_tokens_per_s"]] for n, r in threads.items()]
            + [
                [
                    "2 vs 1",
                    f"{threads[1]['ttft_s'] / threads[2]['ttft_s']:.2f}x faster",
                    f"{threads[2]['decode_tokens_per_s'] / threads[1]['decode_tokens_per_s']:.2f}x",
                ]
            ],
        )
    )

    # 2. start -> ready
    env = {"MODEL_PATH": str(model_path), "THREADS": str(args.threads), "LOG_LEVEL": "warning"}
    starts: dict[str, list[float]] = {"before": [], "now": []}
    with tree_at(args.baseline, extra=("wsgi.py", "gunicorn.conf.py")) as old:
        for kind in ("before", "now", "now", "before"):
            starts[kind].append(start_to_ready(env, old if kind == "before" else ROOT, logs / f"start-{kind}.log"))
            bar.update()
    before, now = (statistics.median(starts[k]) for k in ("before", "now"))
    sections.append(
        markdown_table(
            ["code", "process start → /ready 200 (s), each run", "median (s)"],
            [
                [f"before ({short_rev(args.baseline)})", ", ".join(f"{t:.1f}" for t in starts["before"]), before],
                ["now", ", ".join(f"{t:.1f}" for t in starts["now"]), now],
            ],
        )
        + f"\n\nTarget start <= 8 s: {now:.1f} s ({'met' if now <= 8 else 'missed'})."
    )

    # 3. memory
    runs = {
        "defaults (no MAX_MEMORY_MB, 24 GiB machine)": (env, None),
        "MAX_MEMORY_MB=3500": ({**env, "MAX_MEMORY_MB": "3500"}, None),
        "defaults in a 4 GiB cgroup": (env, 4096 * MIB),
    }
    rows = []
    for label, (run_env, limit) in runs.items():
        if limit:
            with memory_cgroup(limit) as cgroup:
                r = conversations(run_env, logs / "memory.log", cgroup)
        else:
            r = conversations(run_env, logs / "memory.log")
        bar.update()
        rows.append(
            [
                label,
                f"{r['budget_mib']:.0f}",
                f"{r['kv_budget_mib']:.0f}",
                f"{r['loaded_gib']:.2f}",
                f"{r['end_gib']:.2f}",
                f"{r['peak_gib']:.2f}",
                "" if r["cgroup_peak_gib"] is None else f"{r['cgroup_peak_gib']:.2f} ({r['oom_kills']} OOM kills)",
                f"{r['ok']}/{r['requests']}",
                r["refused"],
                int(r["kv_hits"]),
            ]
        )
    sections.append(
        markdown_table(
            [
                "run",
                "budget (MiB)",
                "KV cache budget (MiB)",
                "worker after load (GiB)",
                "at the end (GiB)",
                "peak (GiB)",
                "cgroup peak",
                "answered",
                "503",
                "KV cache hits",
            ],
            rows,
        )
        + "\n\nRSS minus file-backed pages of the worker (what the budget counts; its weights are shared with the "
        "preloading master); peak = the worker's VmHWM (all resident pages)."
    )

    # 4. recovery
    back = [recovery(env, logs / "recovery.log") for _ in range(3)]
    bar.update(3)
    sections.append(
        f"SIGKILL of the worker mid-stream → `/ready` 200 from its replacement: "
        f"{', '.join(f'{t:.2f}' for t in back)} s (target <= 3 s: "
        f"{'met' if max(back) <= 3 else 'missed'})."
    )

    # 5. mapped mode
    packed = isolated("bench.bench_deploy:measure", model_path=str(model_path), threads=args.threads)
    bar.update()
    mapped = {
        a: isolated(
            "bench.bench_deploy:measure",
            model_path=str(model_path),
            threads=args.threads,
            max_memory_mb=args.mapped_budget_mb,
            mapped_activations=a,
        )
        for a in ("fp32", "bf16")
    }
    bar.update(2)
    same = {a: sum(x == y for x, y in zip(r["tokens"], packed["tokens"])) for a, r in mapped.items()}
    sections.append(
        markdown_table(
            ["weights", "W1 time to first token (s)", "decode (tok/s)", "greedy tokens equal to packed"],
            [
                ["packed (INT8 kernels)", packed["ttft_s"], packed["decode_tokens_per_s"], ""],
                *[
                    [
                        f"mapped, {a} activations{' (before)' if a == 'fp32' else ''}",
                        r["ttft_s"],
                        r["decode_tokens_per_s"],
                        f"{same[a]}/{len(packed['tokens'])}",
                    ]
                    for a, r in mapped.items()
                ],
            ],
        )
        + (
            f"\n\nMAX_MEMORY_MB={args.mapped_budget_mb} forces the mapped mode. Targets: mapped decode >= 4x before: "
            f"{mapped['bf16']['decode_tokens_per_s'] / mapped['fp32']['decode_tokens_per_s']:.1f}x; mapped TTFT <= 3x "
            f"packed: {mapped['bf16']['ttft_s'] / packed['ttft_s']:.1f}x."
        )
    )
    bar.close()
    return report(
        args,
        "Deployment: threads, start-up, memory budget, recovery, mapped weights",
        {"MODEL_PATH": model_path.name, "THREADS": args.threads},
        "\n\n".join(sections),
    )


if __name__ == "__main__":
    raise SystemExit(main())
