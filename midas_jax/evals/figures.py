"""Figures the suites, the report and the studies draw: PNG files written through midas_jax.fs."""

from __future__ import annotations

from typing import Mapping, Optional, Sequence, Tuple

from midas_jax import fs


def pyplot():
  """matplotlib's pyplot on the Agg backend (files only, no display); imported when a figure is drawn."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  return plt


def bar_chart(path: str, values: Mapping[str, float], title: str, reference: Optional[float] = None,
              references: Optional[Mapping[str, float]] = None) -> str:
  """Accuracies as bars (0 to 1), with an optional dashed reference line (or one dash per bar, e.g. each
  task's chance level); returns the file name."""
  plt = pyplot()
  fig, ax = plt.subplots(figsize=(max(4.0, 1.1 * len(values) + 1.5), 3.6))
  names = list(values)
  ax.bar(range(len(names)), [values[n] for n in names], color="tab:blue")
  for i, n in enumerate(names):
    ax.text(i, values[n] + 0.01, f"{values[n]:.2f}", ha="center", va="bottom", fontsize=8)
  if reference is not None:
    ax.axhline(reference, color="gray", linestyle="--", linewidth=0.8, label="chance")
    ax.legend(fontsize=8)
  for i, n in enumerate(names):
    if references and n in references:
      ax.hlines(references[n], i - 0.45, i + 0.45, colors="gray", linestyles="--", linewidth=1.0,
                label="chance" if i == 0 else None)
  if references:
    ax.legend(fontsize=8)
  ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
  ax.set_ylim(0, 1.05)
  ax.set_ylabel("accuracy")
  ax.set_title(title, fontsize=9)
  fig.tight_layout()
  fs.write_figure(path, fig, dpi=100)
  plt.close(fig)
  return fs.basename(path)


def line_chart(path: str, series: Mapping[str, Sequence[float]], xs: Sequence[float], xlabel: str, ylabel: str,
               title: str, ylim: Optional[Tuple[float, float]] = (0, 1.05)) -> str:
  plt = pyplot()
  fig, ax = plt.subplots(figsize=(6, 3.8))
  for name, ys in series.items():
    ax.plot(list(xs), list(ys), marker="o", label=name)
  ax.set_xticks(list(xs))
  if ylim:
    ax.set_ylim(*ylim)
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.set_title(title, fontsize=9)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fs.write_figure(path, fig, dpi=100)
  plt.close(fig)
  return fs.basename(path)
