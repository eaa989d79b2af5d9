"""The documentation is part of the product: every link in README.md, DEVELOPERS.md, docs/ and benchmarks/README.md
resolves (files and #anchors), every ``sglightning fit|validate`` command in them parses (``--print_config``), every
``python benchmarks/…`` command names a script that exists and flags that script defines, every extra a
``pip install -e ".[…]"`` names is declared, and the README's results table repeats numbers that benchmarks/README.md
carries (where each has its command, box and date)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from sglightning.cli import cli_main

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "DEVELOPERS.md", ROOT / "benchmarks" / "README.md",
        *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"```[a-z]*\n(.*?)```", re.S)
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_INLINE = re.compile(r"`([^`]+)`")


def _prose(text: str) -> str:
    """The text with fenced blocks blanked (links inside code are not links)."""
    return _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces → '-'."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    heads = re.findall(r"^#{1,6} (.+)$", _prose(path.read_text()), re.M)
    return {_slug(h) for h in heads}


def _links() -> list[tuple[str, str]]:
    return [(str(doc.relative_to(ROOT)), target) for doc in DOCS for target in _LINK.findall(_prose(doc.read_text()))
            if not target.startswith(("http://", "https://", "mailto:"))]


@pytest.mark.parametrize("doc,target", _links())
def test_every_link_resolves(doc, target):
    source = ROOT / doc
    path, _, anchor = target.partition("#")
    dest = (source.parent / path).resolve() if path else source
    assert dest.exists(), f"{doc}: link to {target}: no such file {dest}"
    assert ROOT in dest.parents or dest == ROOT, f"{doc}: {target} points outside the repository"
    if anchor:
        assert dest.suffix == ".md", f"{doc}: {target}: an anchor into a file that is not Markdown"
        assert anchor in _anchors(dest), f"{doc}: {target}: no heading with the anchor #{anchor} in {dest.name}"


def test_the_link_checker_catches_a_broken_anchor_and_file(tmp_path):
    """The checks above can fail: a missing file and a missing anchor are both seen."""
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## A section\n\n[ok](#a-section) [bad](#no-section) [gone](missing.md)\n")
    assert _slug("## The guidance tokens' share".lstrip("# ")) == "the-guidance-tokens-share"
    assert "a-section" in _anchors(page) and "no-section" not in _anchors(page)
    assert not (tmp_path / "missing.md").exists()


def _commands() -> list[tuple[str, list[str]]]:
    """Shell commands of the docs: every line of a fenced block (continuations joined, ``&&`` chains split, leading
    ``VAR=value`` and ``srun`` dropped), and inline code spans that are whole ``sglightning fit|validate`` commands
    without placeholders."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        name = str(doc.relative_to(ROOT))
        lines = []
        for block in _FENCE.findall(text):
            lines += block.replace("\\\n", " ").splitlines()
        for span in _INLINE.findall(_prose(text)):
            span = " ".join(span.split())
            if re.match(r"sglightning (fit|validate) --config \S+\.yaml", span) and "…" not in span \
                    and not re.search(r"(^| )[A-Z]( |$)", span):
                lines.append(span)
            elif span.startswith("python benchmarks/"):
                lines.append(span.replace("[", " ").replace("]", " "))
        for line in lines:
            for part in line.split("&&"):
                try:
                    words = shlex.split(part, comments=True)
                except ValueError:
                    continue
                while words and re.match(r"^[A-Z_]+=", words[0]):
                    words = words[1:]
                if words and words[0] == "srun":
                    words = words[1:]
                if words:
                    found.append((name, words))
    return found


def _ids(cases):
    return [f"{doc}:{' '.join(words)[:60]}" for doc, words in cases]


_SGL = [(d, w) for d, w in _commands() if w[0] == "sglightning"]


def test_the_docs_have_commands():
    assert len(_SGL) >= 10, _SGL  # the extraction itself works


@pytest.mark.parametrize("doc,words", _SGL, ids=_ids(_SGL))
def test_every_sglightning_command_parses(doc, words, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr("sys.argv", ["sglightning"])  # the command line is `args`, not pytest's
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "extending"))  # the extending example's PYTHONPATH
    args = words[1:]
    if "--help" not in args and "--print_config" not in args:
        args = [*args, "--print_config"]
    with pytest.raises(SystemExit) as exc:
        cli_main(args)
    assert exc.value.code in (0, None), f"{doc}: `{' '.join(words)}` failed: {capsys.readouterr().err[-500:]}"
    out = capsys.readouterr().out
    assert ("model:" in out) if "--print_config" in args else ("--model." in out), f"{doc}: {' '.join(words)}"


_BENCH = [(d, w) for d, w in _commands() if w[:2] and w[0] == "python" and w[1].startswith("benchmarks/")]


def test_the_docs_have_benchmark_commands():
    assert len(_BENCH) >= 5, _BENCH


@pytest.mark.parametrize("doc,words", _BENCH, ids=_ids(_BENCH))
def test_every_benchmark_command_names_a_script_and_its_flags(doc, words):
    script = ROOT / words[1]
    assert script.exists(), f"{doc}: {words[1]} does not exist"
    source = script.read_text()
    args = words[2:]
    if "--" in args:  # what follows `--` goes to the trainer
        args = args[:args.index("--")]
    for flag in (a.split("=")[0] for a in args if a.startswith("--")):
        assert f'"{flag}"' in source, f"{doc}: {script.name} defines no {flag}"


def test_every_extra_the_docs_install_is_declared():
    text = (ROOT / "pyproject.toml").read_text()  # (no tomllib on Python 3.10)
    section = text[text.index("[project.optional-dependencies]"):]
    section = section[:section.index("\n[", 1)]
    extras = set(re.findall(r"^([\w-]+) = \[", section, re.M))
    named = {e.strip() for doc in DOCS for group in re.findall(r'pip install -e "\.\[([^\]]+)\]"', doc.read_text())
             for e in group.split(",")}
    assert named and named <= extras, named - extras


def test_the_readme_results_are_the_benchmark_pages_numbers():
    """Each bold number of the README's results table appears in benchmarks/README.md."""
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Results"):readme.index("## Docker")]
    bench = (ROOT / "benchmarks" / "README.md").read_text()
    numbers = re.findall(r"\*\*([^*]+)\*\*", table)
    assert len(numbers) >= 6
    for number in numbers:
        assert number in bench, f"README results: {number} is not in benchmarks/README.md"


def test_the_floor_lane_pins_the_lower_bounds_pyproject_declares():
    """`bash .ci/versions floor` tests the lowest versions `pyproject.toml` accepts, read from it
    (`.ci/floor_pins.py`): the Python, every runtime dependency and the embedded model's gguf, each at its bound."""
    import runpy

    text = (ROOT / "pyproject.toml").read_text()
    pins = runpy.run_path(str(ROOT / ".ci" / "floor_pins.py"))["floor_pins"](text)
    assert pins[0] == "python3.10" and 'requires-python = ">=3.10"' in text
    deps = text[text.index("dependencies = ["):]
    declared = re.findall(r'^    "([^"]+)",?$', deps[:deps.index("]\n")], re.M)
    assert len(declared) >= 8 and [p.replace("==", ">=") for p in pins[1:]] == declared + ["gguf>=0.17.1"]
    assert 'smollm2 = ["gguf>=0.17.1"]' in text
    assert "python3 .ci/floor_pins.py" in (ROOT / ".ci" / "versions").read_text()


def test_the_readme_python_is_the_one_pyproject_accepts():
    text = (ROOT / "pyproject.toml").read_text()
    lowest = re.search(r'requires-python = ">=(3\.\d+)"', text).group(1)
    said = re.findall(r"Python (3\.\d+) or newer", (ROOT / "README.md").read_text())
    assert said == [lowest], (said, lowest)


def test_each_readme_result_is_one_short_number():
    """The results table: one number per cell (a spread after ± allowed), read at a glance; readings go to
    benchmarks/README.md."""
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Results"):readme.index("## Docker")]
    rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) >= 10 and rows[0][1].strip() == "result"
    for what, result in rows[1:]:
        value = result.strip().replace("*", "")
        assert len(value) <= 24, (what, value)
        main = value.split("±")[0]
        assert len(re.findall(r"\d+(?:\.\d+)?", main.replace(" min ", ".").replace(",", ""))) <= 1, (what, value)


def test_every_config_field_doc_is_short_and_plain():
    """Each ``*Config`` field's docstring is what ``sglightning fit --help`` prints for its key: at most 25 words, and
    no Sphinx roles (``:func:`` and the like print verbatim there). The depth goes to docs/."""
    import ast

    roles = (":func:", ":class:", ":mod:", ":meth:")
    long, roled, seen = [], [], 0
    for path in sorted((ROOT / "src" / "sglightning").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ClassDef) and node.name.endswith("Config")):
                continue
            for field, doc in zip(node.body, node.body[1:]):
                if not (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
                        and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                        and isinstance(doc.value.value, str)):
                    continue
                seen += 1
                key = f"{path.relative_to(ROOT)}:{node.name}.{field.target.id}"
                words = len(doc.value.value.split())
                if words > 25:
                    long.append(f"{key} ({words} words)")
                if any(role in doc.value.value for role in roles):
                    roled.append(key)
    assert seen > 100, seen  # the walk finds the config fields
    assert not long, f"config field docs over 25 words (move the depth to docs/): {long}"
    assert not roled, f"config field docs with a Sphinx role (write plain words): {roled}"
