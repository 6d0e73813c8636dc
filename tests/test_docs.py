"""The README a newcomer reads: short, its links lead somewhere, its figures cite results that exist;
and every file the docs, docstrings and comments name is there, with the name they point at."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

from conftest import ROOT

README = ROOT / "README.md"
RESULTS = ROOT / "bench" / "RESULTS.md"
SETTINGS_DOC = ROOT / "docs" / "settings.md"
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
CITED_SECTION = re.compile(r"RESULTS\.md[^)]*\)?,? § “([^”]+)”")


def test_the_readme_fits_a_first_read():
    assert len(README.read_text().splitlines()) <= 250


def test_every_local_link_in_the_readme_docs_and_results_leads_to_a_file():
    for page in [README, RESULTS, *(ROOT / "docs").glob("*.md")]:
        for target in LINK.findall(page.read_text()):
            if not target.startswith(("http://", "https://", "mailto:")):
                assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"


def test_the_headline_figures_cite_sections_that_bench_results_holds():
    text = README.read_text()
    cited = CITED_SECTION.findall(text)
    assert len(cited) >= 4, "the headline table cites its bench/RESULTS.md sections"
    titles = {line[3:].strip() for line in RESULTS.read_text().splitlines() if line.startswith("## ")}
    for title in cited:  # a section's heading, or its start: one scenario on one machine
        matching = [t for t in titles if t.startswith(title)]
        assert len(matching) == 1, f"README cites “{title}”: {len(matching)} sections of bench/RESULTS.md"


# A decode figure (tok/s, tokens/s) and what says how it was measured.
DECODE_FIGURE = re.compile(r"\btok(?:ens)?/s\b")
SPECULATION_SETTING = re.compile(r"\bspeculation (?:off|on)\b")


def measured_rows(text: str) -> list[list[str]]:
    """The cells of each row of the README's table "What it does for a user, measured"."""
    table = text.split("\n## What it does for a user, measured\n", 1)[1].split("\n## ", 1)[0]
    return [
        [cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines() if line.startswith("| ")
    ]


def test_every_decode_figure_of_the_readme_says_whether_speculation_was_on():
    decode_rows = [row for row in measured_rows(README.read_text()) if DECODE_FIGURE.search(" ".join(row[:2]))]
    assert decode_rows, "the README's measured table gives decode figures"
    unstated = {row[0] for row in decode_rows if not SPECULATION_SETTING.search(" ".join(row[:2]))}
    assert not unstated, (
        f"README rows with a decode figure and no “speculation off” or “speculation on” (as its section of "
        f"bench/RESULTS.md says): {sorted(unstated)}"
    )


def test_the_benchmarks_page_names_every_scenario_of_the_registry():
    from bench.__main__ import SCENARIOS

    text = (ROOT / "docs" / "benchmarks.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `python -m bench ")]
    named = {name for row in rows for name in re.findall(r"`(?:python -m bench )?(\w+)", row.split("|")[1])}
    assert sorted(set(SCENARIOS) - named) == [], "scenarios docs/benchmarks.md's command table leaves out"


# -- docs/settings.md is the settings object's map ----------------------------------------------------

# `KV_DISK_MB`, `HOST`: a setting's environment variable, in a row's first cell; ENV_VARIABLE anywhere.
TABLE_NAME = re.compile(r"`([A-Z][A-Z0-9_]*)`")
ENV_VARIABLE = re.compile(r"(?<![\w/.-])[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+\b")
ENVIRON_READ = re.compile(r"environ(?:\.get|\.setdefault)?[(\[]\s*[\"']([A-Z][A-Z0-9_]*)[\"']")


def documented_settings(text: str) -> set[str]:
    """The variables the settings table names: the backticked names in each row's first cell."""
    rows = [line.split("|")[1] for line in text.splitlines() if line.startswith("| `")]
    return {name for cell in rows for name in TABLE_NAME.findall(cell)}


def test_the_settings_doc_names_every_setting_and_no_other():
    from service.settings import Settings

    fields = {name.upper() for name in Settings.model_fields}
    text = SETTINGS_DOC.read_text()
    documented = documented_settings(text)
    assert sorted(fields - documented) == [], "settings docs/settings.md's table leaves out"
    assert sorted(documented - fields) == [], "docs/settings.md's table names settings that do not exist"
    read_directly = {m for p in (ROOT / "service").rglob("*.py") for m in ENVIRON_READ.findall(p.read_text())}
    unknown = set(ENV_VARIABLE.findall(text)) - fields - read_directly
    assert sorted(unknown) == [], "docs/settings.md names variables the service never reads"


# -- every file and name the prose points at exists ------------------------------------------------

# `service/model/forward.py`, `service/native/*.c`, `service/model/forward.TextForward` (a module, then
# a name defined in it), `tests/conftest.py`, `bench/`: a path from the repository's root.
PATH_REFERENCE = re.compile(r"(?<![\w/.*-])(?:service|tests|bench)/[\w/.*-]*")
# `service.deploy.healthcheck`, `service.caches.lru.BudgetedLRU`: a module by its import name, then names in it.
DOTTED_REFERENCE = re.compile(r"(?<![\w/.-])service(?:\.[A-Za-z_]\w*)+")
# `block_files.py`, `int8_gemm.c`, `RESULTS.md`: a bare file name names a file somewhere in the repository.
BARE_FILE = re.compile(r"(?<![\w/.*-])[A-Za-z_][\w-]*(?:\.[\w-]+)*\.(?:py|c|h|md)\b")
# Files of other projects the prose names on purpose.
# llama.cpp's converter (bench/bench_peer.py); the official Qwen3-VL-Embedding code (service/model/search_prompts.py)
OUTSIDE_FILES = {"convert_hf_to_gguf.py", "qwen3_vl_embedding.py", "qwen3_vl_reranker.py", "reranker_template.jinja"}
C_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)


def prose(path: Path) -> Iterator[str]:
    """What of a file is written for people: a page of docs whole; a module's docstrings and comments;
    a C file's comments."""
    text = path.read_text()
    if path.suffix == ".md":
        yield text
    elif path.suffix == ".py":
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                yield ast.get_docstring(node, clean=False) or ""
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type == tokenize.COMMENT:
                yield token.string
    elif path.suffix in (".c", ".h"):
        yield from C_COMMENT.findall(text)


def prose_files() -> list[Path]:
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    code = [p for room in ("service", "tests", "bench") for p in sorted((ROOT / room).rglob("*"))]
    records = ROOT / "bench" / "records"  # decision records: frozen to the tree of the commit they measured
    return pages + [
        p
        for p in code
        if p.suffix in (".py", ".c", ".h") and "__pycache__" not in p.parts and not p.is_relative_to(records)
    ]


def _defined(scope: list[ast.stmt]) -> dict[str, ast.AST]:
    """The names a module or class body binds (through its ifs and trys, not inside functions)."""
    names: dict[str, ast.AST] = {}
    for node in scope:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update((n.id, n) for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(((a.asname or a.name).split(".")[0], node) for a in node.names)
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            bodies = [node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])]
            bodies += [h.body for h in getattr(node, "handlers", [])]
            for body in bodies:
                names.update(_defined(body))
    return names


def _instance_attributes(cls: ast.ClassDef) -> set[str]:
    return {
        n.attr
        for n in ast.walk(cls)
        if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name)
        if n.value.id == "self"
    }


def _missing_name(module: Path, names: list[str]) -> str | None:
    """Why `names` (a name, then names inside it while they are classes) is not defined in `module`."""
    scope: ast.Module | ast.ClassDef = ast.parse(module.read_text())
    where = module.relative_to(ROOT).as_posix()
    for name in names:
        defined = _defined(scope.body)
        if name not in defined and not (isinstance(scope, ast.ClassDef) and name in _instance_attributes(scope)):
            return f"{name} is not defined in {where}"
        if not isinstance(defined.get(name), ast.ClassDef):
            return None  # what follows is an attribute of something that is not a class: not checked
        scope, where = defined[name], f"{where}:{name}"
    return None


def _module_file(path: Path) -> Path | None:
    """The Python file of a module or package path without its suffix."""
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
    return path / "__init__.py" if (path / "__init__.py").is_file() else None


def _path_problem(reference: str) -> str | None:
    reference = reference.rstrip(".")
    *folders, last = reference.split("/")
    folder = ROOT.joinpath(*folders)
    if not folder.is_dir():
        return f"there is no folder {'/'.join(folders)}/"
    if "*" in last:
        return None if any(folder.glob(last)) else f"nothing matches {reference}"
    if last == "" or (folder / last).exists():
        return None
    stem, _, names = last.partition(".")
    module = _module_file(folder / stem)
    if module is None or not names or names in ("py", "c", "h", "md"):
        return f"there is no {reference}"
    return _missing_name(module, names.split("."))


def _dotted_problem(reference: str) -> str | None:
    parts = reference.split(".")
    for cut in range(len(parts), 0, -1):
        module = _module_file(ROOT.joinpath(*parts[:cut]))
        if module is not None:
            return _missing_name(module, parts[cut:]) if cut < len(parts) else None
    return f"there is no module {reference}"


def stale_references(text: str, file_names: set[str]) -> list[str]:
    """Each path, module or file name in `text` that names nothing in this repository, with why."""
    found = [(m, _path_problem(m)) for m in PATH_REFERENCE.findall(text)]
    found += [(m, _dotted_problem(m)) for m in DOTTED_REFERENCE.findall(text)]
    found += [
        (m, f"no file is named {m}") for m in BARE_FILE.findall(text) if m not in file_names and m not in OUTSIDE_FILES
    ]
    return [f"{reference}: {problem}" for reference, problem in found if problem]


def repository_file_names() -> set[str]:
    return {p.name for p in ROOT.rglob("*") if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)}


def test_every_path_named_in_docs_docstrings_and_comments_exists():
    names = repository_file_names()
    stale = [
        f"{path.relative_to(ROOT)}: {problem}"
        for path in prose_files()
        for text in prose(path)
        for problem in stale_references(text, names)
    ]
    assert not stale, "names that lead nowhere:\n" + "\n".join(stale)


def test_the_reference_check_catches_a_stale_path():
    names = repository_file_names()
    fine = (
        "service/model/forward.py, service/model/forward.TextForward, service/native/attention.c, "
        "service/native/*.c, service/caches/, tests/conftest.py, service.deploy.healthcheck, "
        "service.api.state.AppState.histories, the README.md; service/quant/int4_linear.py."
    )
    assert stale_references(fine, names) == []
    made_up = (
        "service/model/nowhere.py service/forward.TextForward service/model/forward.NoSuchThing "
        "service/native/*.cpp service.model.nowhere DESIGN.md"
    )
    assert stale_references(made_up, names) == [
        "service/model/nowhere.py: there is no service/model/nowhere.py",
        "service/forward.TextForward: there is no service/forward.TextForward",
        "service/model/forward.NoSuchThing: NoSuchThing is not defined in service/model/forward.py",
        "service/native/*.cpp: nothing matches service/native/*.cpp",
        "service.model.nowhere: nowhere is not defined in service/model/__init__.py",
        "DESIGN.md: no file is named DESIGN.md",
    ]
