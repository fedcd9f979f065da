"""The docs a newcomer reads stay true to the code: code and docs cite sections of the pages in
docs/ that exist (never the old lab notebook or its session numbers), and the README's diagram of a
training step names every task of the step, and nothing else."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
RESULTS = DOCS / "results.md"
NOTEBOOK = "docs/archive/"
"""The lab notebook's folder: it may link to the page, nothing may cite it."""
OFF_STEP = {"evaluate-policy": "before the first step and after the last, not inside a step",
            "log-summary": "once, at the end of the run",
            "log-datasets": "once, when the run starts (the train and eval splits to MLflow)"}
"""Tasks of tasks/ that are not part of one training step, and why."""


def tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    keep = (".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".txt")
    return [REPO / p for p in out if p.endswith(keep) and not p.startswith(NOTEBOOK)
            and (REPO / p).is_file()]


def flat(text: str) -> str:
    """Whitespace collapsed, so a citation wrapped over two docstring lines reads as one."""
    return re.sub(r"\s+", " ", text)


def headings(markdown: str) -> set[str]:
    return {m.group(1).strip() for m in re.finditer(r"^#+ (.+)$", markdown, re.M)}


def sections(markdown: str) -> set[str]:
    """A page's headings as cited: whitespace collapsed, without backticks."""
    return {flat(h).replace("`", "") for h in headings(markdown)}


def names_a_section(cited: str, page_sections: set[str]) -> bool:
    """A citation names a heading whole, or its words before a parenthesis ("Readers and writers"
    for "Readers and writers (issue 24)")."""
    cited = cited.replace("`", "")
    return any(h == cited or h.startswith(cited + " (") for h in page_sections)


CITATION = re.compile(r'docs/(\w+)\.md\)?,? \(?"([^"]+)"')
SESSION = re.compile(r"\b[Ss]ession \d")


def test_citations_name_sections_that_exist_and_nothing_cites_the_notebook():
    pages = {p.stem: sections(p.read_text(encoding="utf-8")) for p in DOCS.glob("*.md")}
    cited, bad = {}, []
    for path in tracked_text_files():
        if path == Path(__file__).resolve():
            continue
        text = flat(path.read_text(encoding="utf-8", errors="replace"))
        rel = path.relative_to(REPO).as_posix()
        for m in CITATION.finditer(text):
            page = m.group(1)
            cited[page] = cited.get(page, 0) + 1
            if page not in pages:
                bad.append(f'{rel}: cites docs/{page}.md, which does not exist')
            elif not names_a_section(m.group(2), pages[page]):
                bad.append(f'{rel}: cites docs/{page}.md "{m.group(2)}", which has no such section')
        if rel != "docs/results.md":
            bad += [f"{rel}: cites the lab notebook ({NOTEBOOK})" for _ in re.finditer(re.escape(NOTEBOOK), text)]
            bad += [f"{rel}: cites a notebook session ('{m.group(0)}')" for m in SESSION.finditer(text)]
    assert cited.get("results", 0) >= 5 and cited.get("algorithm", 0) >= 3, (
        f"citations found per page: {cited}: is the pattern still right?")
    assert not bad, "\n".join(bad)


def test_at_a_glance_names_sections_that_exist():
    """docs/results.md's summary table ends each row with the section it comes from."""
    page = RESULTS.read_text(encoding="utf-8")
    table = page.split("## At a glance", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[-2].strip() for line in table.splitlines()
            if line.startswith("|") and not line.startswith("|---")][1:]  # the header left out
    assert len(rows) >= 8, rows
    bad = [r for r in rows if not names_a_section(r, sections(page))]
    assert not bad, f"At a glance names sections that do not exist: {bad}"


def test_the_citation_pattern_reads_wrapped_and_parenthesised_forms():
    """The check above is not vacuous: the forms used in docstrings and the README are read."""
    forms = ['(docs/results.md, "The default\n    run")', '[x](docs/results.md) ("First run")',
             'in docs/results.md ("A bad config fails fast")', '(docs/algorithm.md, "trace_core.tree")']
    assert [CITATION.search(flat(f)).group(2) for f in forms] == [
        "The default run", "First run", "A bad config fails fast", "trace_core.tree"]


def task_names() -> set[str]:
    """Every ``@task(name=...)`` in tasks/."""
    names = set()
    for path in sorted((REPO / "tasks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "task":
                names |= {k.value.value for k in node.keywords
                          if k.arg == "name" and isinstance(k.value, ast.Constant)}
    return names


def test_the_readme_step_diagram_names_every_task_of_the_step():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```mermaid\n(.*?)```", readme, re.S)
    assert block, "README.md has no mermaid diagram of the step"
    labels = re.findall(r'\["([^"<]+)', block.group(1))  # a box's first line: its task names
    drawn = {name.strip() for label in labels for name in re.split(r"[,:]", label)
             if re.fullmatch(r"[a-z]+(-[a-z]+)*", name.strip())}
    tasks = task_names()
    assert tasks >= set(OFF_STEP), "a task named in OFF_STEP no longer exists"
    assert drawn - tasks == set(), f"the diagram names tasks that do not exist: {sorted(drawn - tasks)}"
    missing = tasks - drawn - set(OFF_STEP)
    assert not missing, f"tasks of the step missing from the README's diagram: {sorted(missing)}"


ISSUE = re.compile(r"\b[Ii]ssues? #?\d+")
CODE = (".py", ".sh", ".toml", ".yaml", ".yml")


def test_nothing_cites_a_file_a_clone_lacks_and_code_cites_no_issue_numbers():
    """A user's clone has no DESIGN.md (the design card lives outside the repository): the code
    and docs cite docs/algorithm.md, docs/architecture.md and docs/schema.md instead. Code and
    tests say what happened and why, not which issue it was (docs may name issues)."""
    bad = []
    for path in tracked_text_files():
        if path == Path(__file__).resolve():
            continue
        rel = path.relative_to(REPO).as_posix()
        text = path.read_text(encoding="utf-8", errors="replace")
        bad += [f"{rel}: cites DESIGN.md" for _ in re.finditer(r"DESIGN\.md", text)]
        if rel.endswith(CODE):
            bad += [f"{rel}: cites '{m.group(0)}'" for m in ISSUE.finditer(text)]
    assert not bad, "\n".join(bad)


TOP = "bench|docs|tests|trace_core|trace_rl|flows|tasks|cli|deployments|scripts|studies|results|requirements|\\.ci"
REPO_PATH = re.compile(r"(?<![\w./:-])((?:%s)/[A-Za-z0-9_./-]*)(?![$<{*\w])" % TOP)
"""A path inside the repository (``bench/learning.py``, ``docs/algorithm.md``); not one qualified
by another repository or a revision (``owner/repo:path``, ``git show REV:path``), nor a pattern
(``test_*.py``, ``rl_$family``, ``synth_<x>``)."""
MODULE = re.compile(r"(?<![\w./:-])((?:bench|studies|trace_core|trace_rl|tasks|flows|cli|deployments)"
                    r"\.([a-z_]\w*))")
"""A module of the repository's packages (``bench.learning_sim``, ``trace_core.stats``)."""
EXTENSIONS = {"md", "py", "json", "jsonl", "yaml", "yml", "toml", "txt", "sh", "csv", "png", "html"}
CITING_OUT_OF_SCOPE = ()
"""Folders whose citations are not checked yet (their owners clean them up): none."""


def cited_but_missing(rel: str, text: str) -> list[str]:
    """The repository paths and modules ``text`` (the file ``rel``) names that do not exist."""
    bad = []
    for m in REPO_PATH.finditer(text):
        path = m.group(1).rstrip(".,-")
        stem, _, attr = path.rpartition(".")  # bench/allocation_trees.Grower: the module's name
        if not (REPO / path).exists() and not (attr[:1].isupper() and (REPO / f"{stem}.py").exists()):
            bad.append(f"{rel}: cites {path}, which is not in the repository")
    for m in MODULE.finditer(text):
        top, name = m.group(1).split(".")[0], m.group(2)
        if name in EXTENSIONS:  # a file name (docs/deployments.md, cli.jsonl), not a module
            continue
        if not ((REPO / top / f"{name}.py").exists() or (REPO / top / name / "__init__.py").exists()):
            bad.append(f"{rel}: cites the module {m.group(1)}, which is not in the repository")
    return bad


def test_every_cited_path_and_module_is_in_the_repository():
    """What the code and docs cite, a clone holds (the archive, history as it was, aside)."""
    bad = []
    for path in tracked_text_files():
        rel = path.relative_to(REPO).as_posix()
        if path == Path(__file__).resolve() or rel.startswith(("results/", *CITING_OUT_OF_SCOPE)):
            continue
        bad += cited_but_missing(rel, path.read_text(encoding="utf-8", errors="replace"))
    assert not bad, "\n".join(bad)


def test_the_citation_check_reads_paths_modules_and_leaves_patterns_alone():
    assert cited_but_missing("x", "see bench/learning.py, trace_core.stats and bench/allocation_trees.Grower") == []
    assert cited_but_missing("x", "in bench/results/allocation.txt and bench.sim.report") == [
        "x: cites bench/results/allocation.txt, which is not in the repository",
        "x: cites the module bench.sim, which is not in the repository"]
    assert cited_but_missing("x", "git show c4d25eb:bench/results/a.txt; Owner/repo:results/b.csv; "
                                  "tests/test_*.py, results/rl_$family, trace_rl/envs/synth_<x>/, "
                                  "docs/deployments.md") == []


def test_the_results_page_stays_under_600_lines():
    """One screen per claim: superseded text is replaced or archived, not appended to."""
    lines = RESULTS.read_text(encoding="utf-8").count("\n")
    assert lines < 600, f"docs/results.md has {lines} lines; move history to docs/archive/"

