"""The code's shape: rooms (folders) in layers that import only downward, no import cycles inside
`service`, the HTTP layer imported by nothing else (bench/ included; its route modules by its app
factory alone, its serving and protocol modules free of Flask), bench's scenarios built on its core
alone, and every bench/RESULTS.md section a scenario on a machine, written by a command of bench/."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import ROOT

SERVICE = ROOT / "service"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(folders: tuple[str, ...] = ("service",)) -> dict[str, set[str]]:
    """module of `folders` → the modules of `folders` it imports (anywhere in it, lazy imports too).
    A module's own packages are not edges: Python imports them before it anyway."""
    modules = {_module_name(p): p for folder in folders for p in (ROOT / folder).rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
                targets = subs or [target]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name and not name.startswith(t + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


# The rooms, lowest first: a module may import its own room and the rooms before it, never one after
# (each room's __init__ says what it owns). The entry points at the end import anything below them.
LAYERS = [
    (
        "basics",
        [
            "service.settings",
            "service.errors",
            "service.metrics",
            "service.memory",
            "service.footprint",
            "service.threads",
            "service.startup",
        ],
    ),
    ("jobs", ["service.jobs"]),
    ("native", ["service.native"]),
    ("media", ["service.media"]),
    ("quant", ["service.quant"]),
    # Below the model room, which loads the embedded model it makes; above quant, whose writer it uses.
    ("random_checkpoints", ["service.random_checkpoints"]),
    ("vision", ["service.vision"]),
    ("answer", ["service.answer"]),
    ("model", ["service.model"]),
    ("caches", ["service.caches"]),
    ("shared", ["service.shared"]),
    ("contract", ["service.limits", "service.generation"]),
    ("engine", ["service.engine"]),
    ("entry points", ["service.api", "service.cli", "service.__main__", "service.deploy", "service"]),
]


def layer_of(module: str) -> int:
    """The index of the module's layer: the longest prefix naming it."""
    matches = [
        (len(prefix), i)
        for i, (_, prefixes) in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    assert matches, f"{module} is in no room: add it to a layer"
    return max(matches)[1]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps if layer_of(d) > layer_of(m))


def test_rooms_import_only_rooms_below_them():
    assert upward_imports(import_graph()) == []


def test_the_layer_check_finds_an_upward_import():
    graph = {"service.media.images": {"service.engine.engine"}, "service.engine.engine": {"service.media.images"}}
    assert upward_imports(graph) == ["service.media.images -> service.engine.engine"]


def test_every_room_says_what_it_owns_and_may_import():
    for init in (ROOT / "service").glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert len(doc) > 100 and "import" in doc.lower(), f"{init}: a paragraph on what it owns and may import"


def unnamed_modules(package: Path) -> list[str]:
    """The modules and sub-packages of `package` its __init__ docstring does not name."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    children = [p.stem for p in package.glob("*.py") if p.name != "__init__.py"]
    children += [p.name for p in package.iterdir() if (p / "__init__.py").exists()]
    return sorted(c for c in children if not re.search(rf"(?<![\w.]){re.escape(c)}\b", doc))


def test_every_room_names_each_of_its_modules():
    """A room's map cannot go stale: its __init__ names every module and sub-package in it."""
    missing = {
        str(init.parent.relative_to(ROOT)): unnamed_modules(init.parent)
        for init in SERVICE.rglob("__init__.py")
        if init.parent != SERVICE
    }
    assert {room: names for room, names in missing.items() if names} == {}


def test_the_module_check_finds_an_unnamed_module(tmp_path):
    (tmp_path / "__init__.py").write_text('"""Holds `alpha` and beta.py."""')
    for name in ("alpha", "beta", "gamma"):
        (tmp_path / f"{name}.py").write_text("")
    assert unnamed_modules(tmp_path) == ["gamma"]


def readme_rooms() -> list[str]:
    """The first cell of each row of the README's room table (its section "Where things are")."""
    text = (ROOT / "README.md").read_text().split("## Where things are", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    return [row.split("|")[1] for row in rows]


def test_the_readme_room_table_has_a_row_per_layer_in_their_order():
    """The README's map of the rooms follows LAYERS: one row per layer, in order, naming its rooms."""
    rows = readme_rooms()
    assert len(rows) == len(LAYERS), [name for name, _ in LAYERS]
    for (name, prefixes), cell in zip(LAYERS, rows):
        for prefix in prefixes:
            if prefix == "service":
                continue
            path = ROOT / prefix.replace(".", "/")
            shown = f"{path.name}/" if path.is_dir() else f"{path.name}.py"
            assert f"{shown}`" in cell, f"layer {name}: the README's row {cell!r} does not name {shown}"


def test_service_has_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_only_the_http_layer_imports_the_http_layer():
    graph = import_graph(("service", "bench"))
    outside = {
        m
        for m, deps in graph.items()
        if not m.startswith("service.api") and any(d.startswith("service.api") for d in deps)
    }
    assert outside == set()


def test_only_the_app_factory_imports_a_route_module():
    graph = import_graph()
    importers = {m for m, deps in graph.items() if any(d.endswith(".routes") for d in deps)}
    assert importers == {"service.api.app"}


def external_imports() -> dict[str, set[str]]:
    """service module → the top-level names of the packages outside `service` it imports."""
    found: dict[str, set[str]] = {}
    for path in SERVICE.rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names.add(node.module.split(".")[0])
        found[_module_name(path)] = names - {"service"}
    return found


WEB_FRAMEWORK = {"flask", "werkzeug"}


def framework_reaches(graph: dict[str, set[str]], externals: dict[str, set[str]]) -> list[str]:
    """Each `serving` or `protocol` module of service.api that imports the web framework, itself or
    through the service modules it imports: `module -> the importing module`."""
    found = []
    for module in sorted(graph):
        if not module.startswith("service.api.") or module.rpartition(".")[2] not in ("serving", "protocol"):
            continue
        seen, todo = set(), [module]
        while todo:
            current = todo.pop()
            if current not in seen:
                seen.add(current)
                todo += graph.get(current, ())
        found += [f"{module} -> {m}" for m in sorted(seen) if externals.get(m, set()) & WEB_FRAMEWORK]
    return found


def test_serving_and_protocol_modules_import_no_flask():
    assert framework_reaches(import_graph(), external_imports()) == []


def test_the_flask_check_finds_flask_behind_an_import():
    graph = {"service.api.chat.serving": {"service.api.core"}, "service.api.core": set(), "service.api.app": set()}
    externals = {"service.api.core": {"flask"}, "service.api.app": {"flask"}}
    assert framework_reaches(graph, externals) == ["service.api.chat.serving -> service.api.core"]


def test_scenarios_build_on_the_bench_core_not_on_each_other():
    graph = import_graph(("bench",))
    scenarios = {m for m in graph if m.startswith("bench.bench_")}
    assert scenarios, "no bench/bench_*.py"
    assert sorted(f"{m} -> {d}" for m in scenarios for d in graph[m] if d in scenarios) == []


def _command_exists(command: str) -> bool:
    """`python -m bench.X` (a module of bench/), or `python -m bench NAME` (a name of its registry)."""
    from bench.__main__ import SCENARIOS

    module, _, name = command.removeprefix("python -m ").partition(" ")
    if module == "bench":
        return name.split(" ")[0] in (*SCENARIOS, "all")
    path = ROOT / module.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__main__.py").exists()


def test_every_results_section_is_a_scenario_on_a_machine_with_the_command_that_wrote_it():
    from bench.core.results import RESULTS, SEPARATOR, machine_of, sections

    found = sections(RESULTS.read_text())
    assert found
    headings = [heading for heading, _ in found]
    assert len(headings) == len(set(headings)), "a scenario has more than one section on a machine"
    for heading, text in found:
        title, machine, command = heading.split(SEPARATOR)  # what it measured · where · its command
        assert machine == machine_of(text), f"{heading}: its machine line says {machine_of(text)}"
        assert re.fullmatch(r"python -m bench(\.\w+)+", command) and _command_exists(command), heading
        line = re.search(r"^Command: `(python -m bench[^`]*)` · commit \w+", text, re.M)
        assert line and _command_exists(line.group(1)), f"{heading}: no command line naming a command of bench/"


def test_the_architecture_page_has_a_section_per_layer_in_their_order():
    """docs/architecture.md, a newcomer's first page: a `##` section per layer, in LAYERS' order, each
    heading naming the layer's first room."""
    headings = re.findall(r"(?m)^## (.+)$", (ROOT / "docs" / "architecture.md").read_text())
    assert len(headings) == len(LAYERS)
    for (name, prefixes), heading in zip(LAYERS, headings):
        path = ROOT / prefixes[0].replace(".", "/")
        shown = f"{prefixes[0].replace('.', '/')}/" if path.is_dir() else f"{prefixes[0].replace('.', '/')}.py"
        assert f"`{shown}`" in heading, f"layer {name}: {heading!r}"
