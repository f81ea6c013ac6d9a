"""Every section a comment cites exists: `docs/<file>.md §N.M` names a heading of that file, and
`docs/reference-differences.md Gn` a labelled difference. No comment cites a document outside the repository."""

import re

import pytest
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


# ---------------------------------------------------------------- the README's quickstart figures


def _quickstart_paragraph() -> str:
    readme = (ROOT / "README.md").read_text()
    start = readme.index("On 2 CPU cores a first run of the quickstart")
    return readme[start : readme.index("\n\n", start)]


REMEASURE = ".venv/bin/python benchmarks/quickstart_figures.py"


def assert_measured_with_this_code(figures: dict) -> None:
    """The recorded figures were measured by the code of this checkout: each stage key the JSON carries (config
    slice + every module the stage runs) is the one computed now, without training."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from quickstart_figures import stage_keys

    now, recorded = stage_keys(), figures.get("stage_keys", {})
    changed = [
        f"{stage}: measured at {recorded.get(stage)}, now {key}"
        for stage, key in now.items()
        if recorded.get(stage) != key
    ]
    assert not changed, (
        "the quickstart's code or config changed since docs/results/quickstart.json was measured "
        f"({'; '.join(changed)}): its figures may have moved. Re-measure with `{REMEASURE}` and update the "
        "README's quickstart paragraph"
    )


def test_a_changed_key_fails_the_figures_check():
    """The check fails when a stage key moves (here: the recorded train key edited), naming the command that
    re-measures."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from quickstart_figures import stage_keys

    figures = {"stage_keys": stage_keys()}
    assert_measured_with_this_code(figures)  # today's keys pass
    stage = next(s for s in figures["stage_keys"] if s.startswith("train["))
    figures["stage_keys"][stage] = "0" * 24
    with pytest.raises(AssertionError, match=re.escape(f"{stage}: measured at {'0' * 24}, now ")) as err:
        assert_measured_with_this_code(figures)
    assert REMEASURE in str(err.value)


def test_the_readme_quotes_the_last_measured_quickstart_run():
    """README's quickstart figures are those of docs/results/quickstart.json (benchmarks/quickstart_figures.py,
    a real run), and that file describes the quickstart config as it is: a config changed since (more steps,
    another model) fails here until the figures are measured again."""
    import json
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from quickstart_figures import config_digest

    figures = json.loads((ROOT / "docs" / "results" / "quickstart.json").read_text())
    from strategies.options import load_config

    assert figures["steps"] == load_config(str(ROOT / "configs" / "quickstart.yaml")).train.steps
    assert figures["config_digest"] == config_digest(), "configs/quickstart.yaml changed: run quickstart_figures.py"
    assert_measured_with_this_code(figures)
    text = " ".join(_quickstart_paragraph().split())  # as read, whatever the line breaks
    v, e = figures["val_loss"], figures["eval"]
    for quoted in (
        f"**{figures['steps']:,} steps**",
        f"**{v['first']:.3f}** (step {v['first_step']:,})",
        f"**{v['last']:.3f}** (step {v['last_step']:,})",
        f"eval/nelbo **{e['nelbo']:.3f}**",
        f"gen_ppl **{e['gen_ppl']:.1f}** and entropy **{e['entropy']:.2f}**",
        f"data row's {e['data_gen_ppl']:.1f} / {e['data_entropy']:.2f}",
        f"measured {figures['measured_on']}",
    ):
        assert quoted in text, (quoted, text)
    low, high = map(float, re.search(r"takes (\d+(?:\.\d+)?)–(\d+(?:\.\d+)?) minutes", text).groups())
    assert low * 60 <= figures["wall_seconds"] <= high * 60, (low, high, figures["wall_seconds"])
    minutes = figures["wall_seconds"] // 60
    seconds = round(figures["wall_seconds"] - 60 * minutes)
    assert f"{int(minutes)} min {seconds:02d} s" in text
    make_line = next(ln for ln in (ROOT / "README.md").read_text().splitlines() if ln.startswith("make quickstart"))
    assert f"{low:g}–{high:g} min" in make_line, make_line


# ---------------------------------------------------------------- the README's length and its layout block

PACKAGES = ("flows", "tasks", "strategies", "dllm_common")
PATH_TOKEN = re.compile(r"[\w.-]+(?:/|\.\w+)")  # `name/` or `name.ext`


def _layout_block(readme: str) -> list[str]:
    """The lines of the first fenced block under the "Repository layout" heading."""
    heading = re.search(r"^#+ Repository layout\s*$", readme, flags=re.MULTILINE)
    assert heading, "README.md has no 'Repository layout' heading"
    fence = re.compile(r"^\s*(```|~~~)")
    lines = readme[heading.end() :].splitlines()
    start = next(i for i, ln in enumerate(lines) if fence.match(ln))
    end = next(i for i in range(start + 1, len(lines)) if fence.match(lines[i]))
    return lines[start + 1 : end]


def _layout_paths(readme: str) -> list[str]:
    """Every path the layout block names, as a repository-relative path (folders end in `/`), in order.

    A line names the path-like tokens it starts with (`name/`, `name.py`, ..., several on one line allowed), or
    a bare first token set off from its description by two spaces (`Makefile   what it does`); a folder's
    entries are the lines indented under it. Other lines (a description's continuation) name nothing."""
    paths, stack = [], []  # stack: (indent, folder path)
    for line in _layout_block(readme):
        stripped = line.lstrip(" ")
        if not stripped.strip():
            continue
        indent = len(line) - len(stripped)
        names = []
        for token in stripped.split(" "):
            if not PATH_TOKEN.fullmatch(token):
                break
            names.append(token)
        if not names:
            bare = re.match(r"([\w.-]+)(?:\s{2,}|\s*$)", stripped)
            if not bare:
                continue
            names = [bare.group(1)]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1] if stack else ""
        paths += [parent + name for name in names]
        folders = [name for name in names if name.endswith("/")]
        if len(folders) == 1 and len(names) == 1:
            stack.append((indent, parent + folders[0]))
    return paths


def _modules_to_name(named: list[str]) -> list[str]:
    """What the layout must name: every module of a first-party package but `__init__.py`, and every subpackage;
    a subpackage's own modules too where the block lists any of them."""
    required, folders = [], [ROOT / p for p in PACKAGES]
    while folders:
        folder = folders.pop()
        for child in sorted(folder.iterdir()):
            rel = child.relative_to(ROOT).as_posix()
            if child.is_file() and child.suffix == ".py" and child.name != "__init__.py":
                required.append(rel)
            elif child.is_dir() and (child / "__init__.py").is_file():
                required.append(rel + "/")
                if any(p.startswith(rel + "/") and p != rel + "/" for p in named):
                    folders.append(child)
    return required


def test_the_readme_has_at_most_250_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def test_the_readme_layout_names_every_package_and_module_exactly_once():
    named = _layout_paths((ROOT / "README.md").read_text())
    required = _modules_to_name(named)
    assert len(required) > 50 and {p + "/" for p in PACKAGES} <= set(named)  # the parser reads the real block
    missing = [p for p in required if p not in named]
    repeated = sorted({p for p in named if named.count(p) > 1})
    assert (missing, repeated) == ([], []), "README.md 'Repository layout': add the missing, name the repeated once"


def test_every_name_in_the_readme_layout_exists():
    named = _layout_paths((ROOT / "README.md").read_text())
    absent = [p for p in named if not ((ROOT / p).is_dir() if p.endswith("/") else (ROOT / p).is_file())]
    assert absent == []


def test_the_layout_check_would_catch_a_missing_repeated_or_invented_name():
    readme = (ROOT / "README.md").read_text()
    block = "\n".join(_layout_block(readme))
    edited = block.replace("  loop.py ", "  lop.py ", 1).replace("  mdlm/ ", "  mdlm/ scdd/ ", 1)
    assert edited != block
    named = _layout_paths(readme.replace(block, edited))
    assert (
        "tasks/training/loop.py" not in named
        and "tasks/training/lop.py" in named
        and named.count("strategies/scdd/") == 2
    )


# ---------------------------------------------------------------- the strategy lists, derived from the registry

STRATEGY_DOCS = ("README.md", "docs/strategies.md", "docs/architecture.md", "docs/configuration.md")
NUMBER_WORDS = "one two three four five six seven eight nine ten eleven twelve".split()
# "all six train…", "the six strategies", "of the six strategies": the registry's count, written as a word
REGISTRY_COUNT = re.compile(r"\b(?:all|the|of the) (\w+)\s+(?:strategies|train)\b", re.IGNORECASE)
COMPARE_COUNT = re.compile(r"\bthe (\w+) dLLM strategies\b")  # configs/compare.yaml's list
SAMPLER_CHOICES = re.compile(r"--sampler auto((?:\|[\w-]+)+)")


def _registry():
    from strategies.registry import REGISTRY, SAMPLERS

    return list(REGISTRY), sorted(SAMPLERS)


def _first_column(table_start: str, text: str) -> list[str]:
    """The backticked name opening each row of the markdown table after the line that contains `table_start`."""
    lines = text.split(table_start, 1)[1].splitlines()[1:]
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return [m.group(1) for m in (re.match(r"\| `(\w+)`", row) for row in rows[2:]) if m]


def test_the_strategy_tables_list_the_registered_strategies_in_order():
    names, _ = _registry()
    readme = (ROOT / "README.md").read_text()
    listed = _first_column("Strategies plug in behind one API", readme)
    assert listed == names, f"README.md's strategy table lists {listed}; the registry has {names}"
    strategies_md = (ROOT / "docs/strategies.md").read_text()
    listed = _first_column("strategies at a glance", strategies_md)
    assert listed == names, f"docs/strategies.md's table at a glance lists {listed}; the registry has {names}"
    # every config the README's table names ships
    table = readme.split("Strategies plug in behind one API", 1)[1].split("\n\n", 2)[1]
    assert all((ROOT / "configs" / config).is_file() for config in re.findall(r"`([\w-]+\.yaml)`", table))
    # one §8 section per strategy, and the package listing of "How a strategy plugs in"
    sections = re.findall(r"^### §8\.\d+ `(\w+)`", strategies_md, re.MULTILINE)
    assert sections == names, f"docs/strategies.md §8 has sections for {sections}; the registry has {names}"
    architecture = (ROOT / "docs/architecture.md").read_text()
    listing = re.search(r"^  ((?:\w+/ )+\w+/)$", architecture, re.MULTILINE)
    packages = listing.group(1).replace("/", "").split() if listing else []
    assert packages == names, f"docs/architecture.md's package listing has {packages}; the registry has {names}"


def test_the_strategy_counts_are_the_registrys():
    import yaml

    names, _ = _registry()
    compared = yaml.safe_load((ROOT / "configs/compare.yaml").read_text())["pipeline"]["strategies"]
    found = 0
    for doc in STRATEGY_DOCS:
        text = (ROOT / doc).read_text()
        for pattern, count in ((REGISTRY_COUNT, len(names)), (COMPARE_COUNT, len(compared))):
            for match in pattern.finditer(text):
                word = match.group(1).lower()
                if word in NUMBER_WORDS:
                    found += 1
                    assert NUMBER_WORDS.index(word) + 1 == count, f"{doc}: {match.group(0)!r}, but there are {count}"
    assert found >= 4  # README's "all six" and "of the six", strategies.md's two, the compare counts


def test_the_sampler_choices_are_the_registered_samplers():
    _, samplers = _registry()
    found = 0
    for doc in STRATEGY_DOCS:
        for match in SAMPLER_CHOICES.finditer((ROOT / doc).read_text()):
            found += 1
            assert sorted(match.group(1).strip("|").split("|")) == samplers, f"{doc}: --sampler auto{match.group(1)}"
    assert found >= 1


def test_the_samplers_by_strategy_table_is_the_registrations():
    """docs/strategies.md §11.3: each strategy's samplers, its own first, as its registration declares them."""
    from strategies.registry import REGISTRY

    section = (ROOT / "docs/strategies.md").read_text().split("### §11.3", 1)[1].split("\n### ", 1)[0]
    rows = re.findall(r"^\| (\w+) \| ((?:`[\w-]+`(?:, )?)+) \|", section, re.MULTILINE)
    table = {name: re.findall(r"`([\w-]+)`", samplers) for name, samplers in rows}
    declared = {name: list(reg.samplers) for name, reg in REGISTRY.items()}
    assert table == declared, f"docs/strategies.md §11.3 says {table}; the registrations declare {declared}"
