"""bench/'s plan: every scenario a module bench/bench_*.py that `python -m bench` lists and runs with
the arguments given; bench/RESULTS.md one section per scenario and machine, the latest run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import service
from bench.__main__ import SCENARIOS, main
from bench.core import results

from conftest import ROOT


def test_the_registry_lists_every_scenario_module():
    modules = sorted(p.stem.removeprefix("bench_") for p in (ROOT / "bench").glob("bench_*.py"))
    assert sorted(SCENARIOS) == modules


def test_bench_list_names_every_scenario_with_what_it_measures(capsys):
    assert main(["list"]) == 0
    listed = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines()[2:])
    assert listed.keys() == {*SCENARIOS, "all"}
    assert all(len(about) > 20 for about in listed.values())


def test_a_scenario_runs_with_the_arguments_given(capsys):
    assert main(["fuzz", "--help"]) == 0  # argparse's exit 0 is the scenario's success
    assert "--examples" in capsys.readouterr().out  # bench_fuzz's own parser read them
    with pytest.raises(SystemExit) as refused:
        main(["fuzz", "--no-such-option"])
    assert refused.value.code == 2


def test_an_unknown_scenario_is_refused_with_the_list(capsys):
    assert main(["nope"]) == 2
    assert "peer" in capsys.readouterr().err


@pytest.fixture
def results_file(tmp_path, monkeypatch):
    """bench/RESULTS.md as a scratch file; a run's machine and command as the test sets them."""
    monkeypatch.setattr(results, "RESULTS", tmp_path / "RESULTS.md")
    monkeypatch.setattr(results, "commit", lambda: "abc1234")
    run = {"machine": "AMX Xeon", "command": "python -m bench.bench_peer"}
    monkeypatch.setattr(results, "this_machine", lambda: run["machine"])
    monkeypatch.setattr(results, "scenario_command", lambda: run["command"])
    return run


def _written(title: str, body: str) -> None:
    results.write_section(results.section(title, {"THREADS": 2}, body))


def test_a_rerun_replaces_its_scenarios_section_on_its_machine_only(results_file):
    _written("Peer: 4b", "first run")
    results_file["command"] = "python -m bench.bench_start"
    _written("Start", "start")
    results_file["command"] = "python -m bench.bench_peer"
    _written("Peer: 4b", "second run")  # the same scenario, the same machine: in its place
    results_file["machine"] = "AVX2-only EPYC"
    _written("Peer: 4b", "on the EPYC")  # another machine: beside the scenario's other section
    found = results.sections(results.RESULTS.read_text())
    assert [title for title, _ in found] == [
        "Peer: 4b · AMX Xeon · python -m bench.bench_peer",
        "Peer: 4b · AVX2-only EPYC · python -m bench.bench_peer",
        "Start · AMX Xeon · python -m bench.bench_start",
    ]
    assert "second run" in found[0][1] and "first run" not in results.RESULTS.read_text()
    assert "on the EPYC" in found[1][1]


def test_a_machine_is_named_by_its_widest_vector_extension_and_cpu_family():
    assert results.machine_name("Intel(R) Xeon(R) Processor", ["avx2", "avx512f", "amx_tile"]) == "AMX Xeon"
    assert results.machine_name("AMD EPYC", ["avx2", "avx512f", "avx512_vnni"]) == "AVX-512 EPYC"
    assert results.machine_name("AMD EPYC 7763 64-Core Processor", ["avx2"]) == "AVX2-only EPYC 7763 64-Core"
    line = f"2026-12-01 17:28 UTC · {results.machine_line(2)}"
    assert results.machine_of(line) == results.machine_name(results.cpu_model(), results.instruction_sets())


def test_every_decode_figure_of_the_results_says_whether_speculation_was_on():
    """Exact speculation on random weights accepts guesses a real model would not: a decode figure is
    raw decode only where its section says speculation was off (issue 58)."""
    with_figure = [(t, s) for t, s in results.sections(results.RESULTS.read_text()) if results.DECODE_FIGURE.search(s)]
    assert with_figure, "bench/RESULTS.md gives decode figures"
    unstated = [t for t, s in with_figure if f"\n{results.SPECULATION_PREFIX}" not in s]
    assert unstated == [], "sections with a decode figure but no “Speculation:” line"


def test_a_section_with_a_decode_figure_cannot_be_written_without_its_speculation_setting(results_file):
    with pytest.raises(ValueError, match="speculation"):
        _written("Peer: 4b", "| decode | 12.3 tok/s |")
    results.write_section(results.section("Peer: 4b", {}, "| decode | 12.3 tok/s |", speculation="off (test)"))
    assert "\nSpeculation: off (test)\n" in results.RESULTS.read_text()


def test_the_benchmarks_decode_with_speculation_off_unless_asked(monkeypatch, tiny_dir):
    from bench.core.harness import parse, parser

    monkeypatch.setenv("SPECULATIVE", "on")  # the service's default; restored after the test
    args = parse(parser("A benchmark."), ["--model-path", str(tiny_dir), "--no-save"])
    assert args.speculative == "off"
    assert os.environ["SPECULATIVE"] == "off"  # what every Session and server the benchmark starts reads
    assert parse(parser("A benchmark."), ["--model-path", str(tiny_dir), "--speculative", "on"]).speculative == "on"
    assert os.environ["SPECULATIVE"] == "on"


def test_llama_cpp_runs_without_the_thread_settings_the_service_gave_the_benchmark():
    """bench imports the service first (its settings before torch): the peer must not inherit them."""
    shell = {name: value for name, value in os.environ.items() if name not in service.SETTINGS}
    code = (
        "import os\nfrom bench.core.servers import peer_environment\n"
        "peer = peer_environment()\nprint(sorted(set(os.environ) - set(peer)), peer['PATH'] == os.environ['PATH'])"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=shell, capture_output=True, text=True, timeout=99)
    assert done.stdout.split("\n")[0] == f"{sorted(service.SETTINGS)} True", done.stderr
