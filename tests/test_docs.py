"""Every section a comment cites exists: `docs/<file>.md §N.M` names a heading of that file, and
`docs/reference-differences.md Gn` a labelled difference. No comment cites a document outside the repository."""

import re

from conftest import ROOT

SOURCES = [
    p for d in ("flows", "tasks", "strategies", "dllm_common", "tests", "benchmarks") for p in (ROOT / d).rglob("*.py")
]
SECTION = re.compile(r"docs/([\w-]+\.md) (§\d+(?:\.\d+)*)((?:, §\d+(?:\.\d+)*)*)")
LABEL = re.compile(r"docs/reference-differences\.md (G\d+)")


def _headings(doc: str) -> set[str]:
    text = (ROOT / "docs" / doc).read_text()
    return {m.group(1) for m in re.finditer(r"^#+ ((?:§|G)\d+(?:\.\d+)*)\b", text, flags=re.MULTILINE)}


def _citations():
    for path in SOURCES:
        for m in SECTION.finditer(path.read_text()):
            for section in [m.group(2), *re.findall(r"§\d+(?:\.\d+)*", m.group(3))]:
                yield path, m.group(1), section
        for m in LABEL.finditer(path.read_text()):
            yield path, "reference-differences.md", m.group(1)


def test_every_cited_section_is_a_heading_of_a_doc_in_the_repository():
    cited = list(_citations())
    assert len(cited) > 30  # the check looks at real citations
    missing = [
        f"{p.relative_to(ROOT)} cites {doc} {s}"
        for p, doc, s in cited
        if not (ROOT / "docs" / doc).is_file() or s not in _headings(doc)
    ]
    assert missing == []


def test_no_comment_cites_a_document_outside_the_repository():
    outside = re.compile(r"(?<![\w/.])spec §|shared/spec|\.\./shared")
    bad = [str(p.relative_to(ROOT)) for p in SOURCES if outside.search(p.read_text()) and p.name != "test_docs.py"]
    assert bad == []


def test_the_check_would_catch_a_missing_section(tmp_path):
    assert "§999" not in _headings("strategies.md") and "§7.2" in _headings("strategies.md")
