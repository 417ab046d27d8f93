"""Every document the code, gin files, tests and docs cite exists in the repository, anchors included."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = [p for pattern in ("midas_jax/**/*.py", "gin/**/*.gin", "tests/*.py", "launch/*.py", "setup.py",
                             "requirements/*.txt", "notebooks/*.py")
           for p in ROOT.glob(pattern) if p.name != "test_docs.py"]
DOCS = [ROOT / "README.md", *ROOT.glob("docs/*.md"), ROOT / "launch" / "README.md"]
# A cited document: a path ending in .md, optionally with a #anchor.
CITATION = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w.-]+\.md)(#[\w-]+)?")
# Files the code writes into its outputs (an export's README, `midas report`, `midas compare`) and
# placeholders of command lines: named in code, but not documents of this repository.
WRITTEN_BY_CODE = {"README.md", "report.md", "comparison.md", "DIR/report.md", "FILE.md", "study.md", "DIR/study.md"}


def slug(heading: str) -> str:
  """GitHub's anchor for a Markdown heading."""
  text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
  return text.replace(" ", "-")


def anchors(page: pathlib.Path) -> set:
  return {slug(line.lstrip("#")) for line in page.read_text().splitlines() if line.startswith("#")}


def resolve(citing: pathlib.Path, target: str, root: pathlib.Path = ROOT):
  for base in (root, citing.parent):
    if (base / target).is_file():
      return base / target
  return None


def check_citations(files, link_pattern=CITATION, root=ROOT):
  missing = []
  for path in files:
    for number, line in enumerate(path.read_text().splitlines(), start=1):
      for match in link_pattern.finditer(line):
        target, anchor = match.group(1), match.group(2)
        if target in WRITTEN_BY_CODE and not anchor:
          continue
        page = resolve(path, target, root)
        where = f"{path.name}:{number}"
        if page is None:
          missing.append(f"{where}: {target} is not in the repository")
        elif anchor and anchor[1:] not in anchors(page):
          missing.append(f"{where}: {target} has no heading for {anchor}")
  return missing


def test_code_cites_only_documents_in_the_repository():
  assert SOURCES and check_citations(SOURCES) == []


def test_docs_links_resolve():
  link = re.compile(r"\]\(((?:[\w.-]+/)*[\w.-]+\.md)(#[\w-]+)?\)")
  assert check_citations(DOCS, link) == []


def test_a_missing_document_or_anchor_is_caught(tmp_path):
  bad = tmp_path / "bad.py"
  bad.write_text("# see " + "DESIGN" + ".md, decision 4, and docs/architecture.md#no-such-heading;\n"
                 "# docs/architecture.md#stacked-layers is fine\n")
  problems = check_citations([bad], root=ROOT)
  assert len(problems) == 2 and "is not in the repository" in problems[0] and "no heading" in problems[1]


def test_configs_import_nothing_of_the_package_but_errors_and_each_other():
  imports = set()
  for path in (ROOT / "midas_jax" / "configs").glob("*.py"):
    imports |= set(re.findall(r"^\s*(?:from|import) (midas_jax[\w.]*)", path.read_text(), flags=re.M))
  assert {"midas_jax.errors", "midas_jax.configs.model"} <= imports
  assert imports - {"midas_jax.errors"} <= {f"midas_jax.configs.{name}" for name in
                                            ("model", "mesh", "optimizer", "data", "trainer", "stacking", "run")}
