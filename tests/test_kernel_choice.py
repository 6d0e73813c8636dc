"""The INT8 kernel is chosen by measuring the available ones on this machine and checkpoint
(service/quant/kernel_choice.py), once: a restart reads the result; INT8_KERNEL forces one."""

from __future__ import annotations

import json

import pytest

from service.quant.int8_linear import available_kernels
from service.quant.kernel_choice import NATIVE_MARGIN, RESULTS_FILE, _decide, choose


def test_every_available_kernel_is_measured_and_the_fastest_serves(tiny_dir, tmp_path):
    choice = choose("auto", tiny_dir, tmp_path, threads=2, rows=128)
    assert set(choice.measured) == set(available_kernels()) >= {"fbgemm", "onednn", "native"}
    assert not choice.forced and not choice.cached
    per_token = {k: m["decode_ms"] + m["prefill_ms"] / m["rows"] for k, m in choice.measured.items()}
    prefill = {k: m["prefill_ms"] for k, m in choice.measured.items()}
    for chosen, cost in ((choice.decoder, per_token), (choice.vision, prefill)):
        fastest = min(cost, key=cost.get)
        assert chosen == fastest or (chosen == "native" and cost["native"] < NATIVE_MARGIN * cost[fastest])
    assert all(m["decode_ms"] > 0 and m["prefill_ms"] > 0 for m in choice.measured.values())
    assert choice.probe_seconds < 0.5  # what a first start pays (the tiny model's matrices: a lower bound)


def test_a_restart_reads_the_measurement_instead_of_measuring_again(tiny_dir, tmp_path):
    first = choose("auto", tiny_dir, tmp_path, threads=2, rows=128)
    again = choose("auto", tiny_dir, tmp_path, threads=2, rows=128)
    assert again.cached and (again.decoder, again.vision, again.measured) == (
        first.decoder,
        first.vision,
        first.measured,
    )
    # another thread count (or CPU, torch, checkpoint shape) is another machine: measured anew
    assert not choose("auto", tiny_dir, tmp_path, threads=1, rows=128).cached
    assert len(json.loads((tmp_path / RESULTS_FILE).read_text())) == 2


@pytest.mark.parametrize("content", ["{not json", '["a list"]', ""])
def test_a_damaged_results_file_is_measured_over(tiny_dir, tmp_path, content):
    (tmp_path / RESULTS_FILE).write_text(content)
    choice = choose("auto", tiny_dir, tmp_path, threads=2, rows=128)
    assert not choice.cached and choice.decoder in choice.measured
    assert choose("auto", tiny_dir, tmp_path, threads=2, rows=128).cached


@pytest.mark.parametrize("kernel", ["fbgemm", "onednn", "native"])
def test_int8_kernel_forces_one_for_every_part_without_measuring(tiny_dir, tmp_path, kernel):
    choice = choose(kernel, tiny_dir, tmp_path, threads=2, rows=128)
    assert (choice.decoder, choice.vision, choice.forced, choice.measured) == (kernel, kernel, True, {})
    assert not (tmp_path / RESULTS_FILE).exists()


def _figures(native: float, onednn: float) -> dict:
    return {
        "native": {"decode_ms": native, "prefill_ms": native * 10, "rows": 128},
        "onednn": {"decode_ms": onednn, "prefill_ms": onednn * 10, "rows": 128},
    }


def test_the_native_kernel_serves_unless_a_packed_one_is_clearly_faster():
    """FBGEMM's and oneDNN's layouts are packed at every start into each process's own memory; the
    native kernel reads the mapped checkpoint in place, so it wins what is close."""
    close = _decide(_figures(native=1.0, onednn=0.9), cached=True, probe_seconds=0)
    assert (close.decoder, close.vision) == ("native", "native")
    clear = _decide(_figures(native=1.0, onednn=0.7), cached=True, probe_seconds=0)
    assert (clear.decoder, clear.vision) == ("onednn", "onednn")
    slower = _decide(_figures(native=0.7, onednn=1.0), cached=True, probe_seconds=0)
    assert (slower.decoder, slower.vision) == ("native", "native")
