"""Every measured table in the docs is rendered from its committed results file (DESIGN decision 13)."""

import json
import pathlib

import pytest

from midas_jax import results

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted(ROOT.glob("docs/*.md"))]
RESULTS = sorted(ROOT.glob("docs/results/*.json"))
# What a reader needs to know of any figure: what produced it, where, and at which commit.
PROVENANCE = ("command", "device", "commit", "date")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_each_marked_table_is_its_results_file_rendered(page):
  assert page.read_text() == results.render_page(page), (
      f"{page.name}: a marked table differs from its results file; re-render it with "
      f"`midas docs render` (and change figures in docs/results/, never in the page)")


def test_every_results_file_is_quoted_and_says_what_produced_it():
  quoted = {(page.parent / name).resolve() for page in PAGES for name, _ in results.marked_tables(page)}
  assert RESULTS and set(p.resolve() for p in RESULTS) == quoted
  for path in RESULTS:
    content = results.read(path)
    for name in content["tables"]:
      said = results.table_provenance(content, name)
      assert all(said.get(key) for key in PROVENANCE), (path.name, name, said)


def test_a_figure_typed_into_a_page_is_caught(tmp_path):
  (tmp_path / "results").mkdir()
  spec = results.table(["arm", "FLOPs", "loss", "gap"], [["baseline", 6.378e12, 2.539, -0.102], ["midas", 4.832e12,
                                                           2.437, "+0.1 ± 0.2"]], [None, ".3e", ".4f", "+.3f"])
  results.write(tmp_path / "results" / "run.json", {"final": spec}, {"device": "cpu", "commit": "abc1234"})
  page = tmp_path / "page.txt"
  page.write_text("Intro.\n\n<!-- table: results/run.json final -->\n<!-- /table -->\n\nAfter.\n")
  page.write_text(results.render_page(page))
  text = page.read_text()
  assert "| baseline | 6.378e12 | 2.5390 | -0.102 |" in text and "| midas | 4.832e12 | 2.4370 | +0.1 ± 0.2 |" in text
  assert "[results/run.json](results/run.json): cpu; commit abc1234." in text and text.endswith("After.\n")
  assert results.render_page(page) == text  # rendering is a fixed point
  page.write_text(text.replace("2.5390", "2.5391"))
  assert results.render_page(page) != page.read_text()
  assert json.loads((tmp_path / "results" / "run.json").read_text())["tables"]["final"]["rows"][0][1] == 6.378e12


def test_a_marker_naming_a_missing_table_fails_loudly(tmp_path):
  results.write(tmp_path / "r.json", {"t": results.table(["a"], [[1]])}, {})
  page = tmp_path / "page.txt"
  page.write_text("<!-- table: r.json other -->\n<!-- /table -->\n")
  with pytest.raises(KeyError, match="no table 'other'"):
    results.render_page(page)


def test_midas_docs_render_checks_then_rewrites_a_stale_page(tmp_path, capsys):
  from midas_jax import cli  # the whole command line: imported only by this test
  results.write(tmp_path / "r.json", {"t": results.table(["a", "b"], [[1, 0.5]], [None, ".2f"])}, {"commit": "abc"})
  page = tmp_path / "page.txt"
  page.write_text("<!-- table: r.json t -->\n| a | b |\n|---|---|\n| 1 | 0.49 |\n<!-- /table -->\n")
  assert cli.main(["docs", "render", "--check", str(page)]) == 1 and "0.49" in page.read_text()
  assert cli.main(["docs", "render", str(page)]) == 0 and "| 1 | 0.50 |" in page.read_text()
  assert cli.main(["docs", "render", "--check", str(page)]) == 0
  assert "1 of 1 pages differ from their results files" in capsys.readouterr().out
