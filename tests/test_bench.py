"""bench/'s plan: every scenario a module bench/bench_*.py that `python -m bench` lists and runs with
the arguments given."""

from __future__ import annotations

import pytest
from conftest import ROOT

from bench.__main__ import SCENARIOS, main


def test_the_registry_lists_every_scenario_module():
    modules = sorted(p.stem.removeprefix("bench_") for p in (ROOT / "bench").glob("bench_*.py"))
    assert sorted(SCENARIOS) == modules


def test_bench_list_names_every_scenario_with_what_it_measures(capsys):
    assert main(["list"]) == 0
    listed = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines()[2:])
    assert listed.keys() == {*SCENARIOS, "all"}
    assert all(len(about) > 20 for about in listed.values())


def test_a_scenario_runs_with_the_arguments_given(capsys):
    assert main(["load", "--help"]) == 0  # argparse's exit 0 is the scenario's success
    assert "--clients" in capsys.readouterr().out  # bench_load's own parser read them
    with pytest.raises(SystemExit) as refused:
        main(["load", "--no-such-option"])
    assert refused.value.code == 2


def test_an_unknown_scenario_is_refused_with_the_list(capsys):
    assert main(["nope"]) == 2
    assert "peer" in capsys.readouterr().err
