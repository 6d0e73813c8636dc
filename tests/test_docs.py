"""The README a newcomer reads: short, its links lead somewhere, its figures cite results that exist."""

from __future__ import annotations

import re

from conftest import ROOT

README = ROOT / "README.md"
RESULTS = ROOT / "bench" / "RESULTS.md"
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
CITED_SECTION = re.compile(r"RESULTS\.md[^)]*\)?,? § “([^”]+)”")


def test_the_readme_fits_a_first_read():
    assert len(README.read_text().splitlines()) <= 250


def test_every_local_link_in_the_readme_and_docs_leads_to_a_file():
    for page in [README, *(ROOT / "docs").glob("*.md")]:
        for target in LINK.findall(page.read_text()):
            if not target.startswith(("http://", "https://", "mailto:")):
                assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"


def test_the_headline_figures_cite_sections_that_bench_results_holds():
    text = README.read_text()
    cited = CITED_SECTION.findall(text)
    assert len(cited) >= 4, "the headline table cites its bench/RESULTS.md sections"
    titles = {line[3:].strip() for line in RESULTS.read_text().splitlines() if line.startswith("## ")}
    for title in cited:
        assert any(t.startswith(title) for t in titles), f"README cites “{title}”, not in bench/RESULTS.md"
