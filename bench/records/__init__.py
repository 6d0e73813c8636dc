"""Decision records: benchmarks that measured a choice once — per-token INT8 against per-tensor
(`bench_int8`), the KV cache growing in place against torch.cat (`bench_kv`), the lean decode step
against transformers' forward (`bench_decode`), one computation per token against the code before
it (`bench_exactness`), the fixed-order float operations against torch's (`bench_every_cpu`), OpenCV
against PIL (`image_decoding`).

Each is frozen at the commit its bench/RESULTS.md section names: that section is the record, and
rerunning it means running the benchmark as it was there, e.g.

    git worktree add /tmp/record c1f5f5d && cd /tmp/record && python -m bench.bench_int8

The copies here are kept to read what was measured, on today's bench core; they are not kept
running against today's service (their baselines predate its layout). Regression benchmarks —
what the current service must keep — are bench/'s other modules.
"""
