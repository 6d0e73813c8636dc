"""bench/'s plan: every scenario a module bench/bench_*.py that `python -m bench` lists and runs with
the arguments given; bench/RESULTS.md one section per scenario and machine, the latest run."""

from __future__ import annotations

import pytest

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
