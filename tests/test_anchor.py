"""The anchor-function data obeys its definition; a tiny stacked study trains, scores, resumes and plots via the
CLI; the grid of several arms, stage plans and growth of a cell."""

import dataclasses
import json
import os

import numpy as np
import pytest

from midas_jax import cli
from midas_jax.errors import ConfigError
from midas_jax.studies import anchor_cells, anchor_study, anchor_task as anchor
from midas_jax.studies.anchor_config import ANCHOR_MODEL, ANCHOR_OPTIMIZER, AnchorStudyConfig

# The definition, written out independently of the module: anchor -> its map on a key.
MAPS = {1: lambda x: (x + 5) % 100, 2: lambda x: (x + 1) % 100, 3: lambda x: (x - 2) % 100,
        4: lambda x: (x - 8) % 100}


def parse_row(row):
  """(key, key position, pair) found by reading the tokens: the one place two anchors sit side by side."""
  spots = [p for p in range(len(row) - 1) if row[p] in MAPS and row[p + 1] in MAPS]
  assert len(spots) == 1, row
  assert sum(int(t in MAPS) for t in row) == 2, row  # no other anchor anywhere in the row
  p = spots[0]
  return int(row[p - 1]), p - 1, (int(row[p]), int(row[p + 1]))


def expected_label(pair, key):
  return (key - 6) % 100 if pair == (3, 4) else MAPS[pair[1]](MAPS[pair[0]](key))


@pytest.mark.parametrize("split", ["train", "test"])
def test_rows_obey_the_definition(split):
  ex = anchor.make_examples(np.random.default_rng(1), 3000, split)
  assert ex.tokens.shape == (3000, 8) and ex.tokens.dtype == np.int32
  assert ex.tokens.min() >= 0 and ex.tokens.max() <= 99
  seen_pairs = set()
  for row, lab in zip(ex.tokens.tolist(), ex.labels.tolist()):
    key, position, pair = parse_row(row)
    seen_pairs.add(pair)
    assert 20 <= key <= 99 and 0 <= position <= 5
    assert (key % 8 == position) == (split == "test")  # the modulus rule splits train from test
    assert lab == expected_label(pair, key)
  assert (4, 3) not in seen_pairs  # the held-out pair is never a training pair
  assert seen_pairs == {(a, b) for a in range(1, 5) for b in range(1, 5)} - {(4, 3)}


def test_pair_sets_and_answers():
  assert len(anchor.TRAIN_PAIRS) == 15 and len(anchor.INFERENTIAL_PAIRS) == 14
  assert (3, 4) in anchor.TRAIN_PAIRS and (3, 4) not in anchor.INFERENTIAL_PAIRS
  assert (4, 3) not in anchor.TRAIN_PAIRS
  assert int(anchor.label((3, 4), 50)) == 44 and int(anchor.composite((3, 4), 50)) == 40
  assert int(anchor.composite((4, 3), 50)) == 40 and int(anchor.symmetric_answer(50)) == 44
  assert int(anchor.label((1, 1), 97)) == 7  # modulo 100
  with pytest.raises(ConfigError, match="held-out"):
    anchor.make_examples(np.random.default_rng(0), 10, "train", pairs=((4, 3),))


def test_keys_cover_the_range_and_positions_evenly_enough():
  ex = anchor.make_examples(np.random.default_rng(2), 20000, "train")
  assert set(ex.keys.tolist()) == set(range(20, 100))
  counts = np.bincount(ex.positions, minlength=6)
  assert counts.min() > 0.8 * 20000 / 6
  test = anchor.make_examples(np.random.default_rng(3), 2000, "test", (anchor.HELD_OUT,))
  assert set(map(tuple, test.pairs.tolist())) == {(4, 3)} and np.all(test.keys % 8 == test.positions)


def test_study_config_is_checked():
  with pytest.raises(ConfigError, match="AnchorStudyConfig.gammas"):
    AnchorStudyConfig(gammas=(0.0,))
  with pytest.raises(ConfigError, match="ModelConfig.num_heads"):  # the study's model is a ModelConfig
    AnchorStudyConfig(model=dataclasses.replace(ANCHOR_MODEL, d_model=10, num_heads=4))
  with pytest.raises(ConfigError, match="OptimizerConfig.warmup_steps"):
    AnchorStudyConfig(steps=100)  # the paper's 100 warmup steps take the whole run


# One stacked arm: its cell trains stage by stage through the same loop a fixed-depth cell runs once
# (stage_plan), so it covers the fixed arm's training too; the grid of several arms is checked on
# hand-made cells below, without training.
TINY = ["--gin.AnchorStudyConfig.gammas=[0.5]", "--gin.AnchorStudyConfig.depths=[2]",
        "--gin.AnchorStudyConfig.arms=['midas']",
        "--gin.ModelConfig.d_model=16", "--gin.ModelConfig.d_ff=32",
        "--gin.AnchorStudyConfig.train_examples=4096", "--gin.AnchorStudyConfig.batch_size=64",
        "--gin.AnchorStudyConfig.steps=20", "--gin.OptimizerConfig.warmup_steps=5",
        "--gin.AnchorStudyConfig.eval_every=0", "--gin.AnchorStudyConfig.eval_examples=32"]  # 0: at the end


def test_cli_trains_a_stacked_cell_scores_it_and_resumes(tmp_path, repo_root, capsys, monkeypatch):
  gin_file = os.path.join(repo_root, "gin", "experiments", "anchor_gamma_cpu.gin")
  workdir = tmp_path / "study"
  calls, real_score = [], anchor_cells.score

  def recording_score(held, seen, sets):  # what the cell's model answered at each evaluation
    calls.append((np.asarray(held), np.asarray(seen), sets))
    return real_score(held, seen, sets)

  monkeypatch.setattr(anchor_cells, "score", recording_score)
  assert cli.main(["study", "anchor", f"--gin_file={gin_file}", f"--workdir={workdir}"] + TINY) == 0
  result = json.load(open(workdir / "anchor_study.json"))
  assert [(g["arm"], g["gamma"], g["depth"]) for g in result["grid"]] == [("midas", 0.5, 2)]
  (midas,) = result["cells"]
  # Prop-1 over 20 steps in 2 one-layer stages: 7 then 13 steps; scored at the end of each stage too.
  assert midas["stage_steps"] == [7, 13]
  assert [(t["step"], t["depth"]) for t in midas["trajectory"]] == [(7, 1), (20, 2)]
  # Every fraction written is the model's answers scored by hand on the 32 held-out and 32 x 15 seen rows.
  assert len(calls) == 2
  for (held, seen, sets), point in zip(calls, midas["trajectory"]):
    composite, symmetric, labels = _known_answers(sets)
    assert held.shape == (32,) and seen.shape == (32 * 15,)
    assert (point["inferential"], point["symmetric"], point["seen"]) == (
        np.mean(held == composite), np.mean(held == symmetric), np.mean(seen == labels))
  final = {k: midas["trajectory"][-1][k] for k in ("inferential", "symmetric", "seen")}
  assert {k: midas[k] for k in final} == final  # the cell's fractions are its last evaluation's
  threshold = result["config"]["fit_threshold"]
  assert midas["kind"] == ("unfit" if final["seen"] < threshold else "inferential" if final["inferential"] > 0.5
                           else "symmetric" if final["symmetric"] > 0.5 else "neither")
  assert np.isfinite(midas["final_loss"]) and midas["final_loss"] < midas["trajectory"][0]["loss"]
  assert os.path.getsize(workdir / "phase_diagram.png") > 1000
  assert "AnchorStudyConfig.steps = 20" in open(workdir / "operative_config.gin").read()
  assert "phase diagram:" in capsys.readouterr().out
  # A re-run with the same settings trains nothing (scores no model); a changed setting is a different study.
  assert cli.main(["study", "anchor", f"--gin_file={gin_file}", f"--workdir={workdir}"] + TINY) == 0
  assert len(calls) == 2 and len(open(workdir / "cells.jsonl").read().splitlines()) == 1
  assert "gamma=" not in capsys.readouterr().out


def _known_answers(sets):
  """Read from the rows' tokens, not from the module: each held-out row's composite (key-10) and symmetric (key-6)
  answers, and each seen row's label."""
  held = [parse_row(row) for row in sets.held_out.tokens.tolist()]
  assert {pair for _, _, pair in held} == {(4, 3)}
  composite = np.array([MAPS[3](MAPS[4](key)) for key, _, _ in held])
  symmetric = np.array([expected_label((3, 4), key) for key, _, _ in held])
  seen = np.array([expected_label(pair, key) for key, _, pair in map(parse_row, sets.seen.tokens.tolist())])
  return composite, symmetric, seen


def test_score_counts_each_answer_and_classify_names_the_solution():
  sets = anchor_cells.eval_sets(16)  # 16 held-out rows, 16 x 15 seen rows: every fraction below is exact
  composite, symmetric, labels = _known_answers(sets)
  rng = np.random.default_rng(0)

  def answers(inferential, symmetric_, right):
    """Shuffled predictions: so many held-out rows answered key-10, so many key-6, the rest junk (key-9);
    `right` seen rows answered their label, the rest a wrong token."""
    held, order = (composite + 1) % 100, rng.permutation(len(composite))
    held[order[:inferential]] = composite[order[:inferential]]
    pick = order[inferential:inferential + symmetric_]
    held[pick] = symmetric[pick]
    seen, order = (labels + 1) % 100, rng.permutation(len(labels))
    seen[order[:right]] = labels[order[:right]]
    return held, seen

  half = anchor_cells.score(*answers(8, 4, 180), sets)
  assert half == {"inferential": 0.5, "symmetric": 0.25, "seen": 0.75}
  assert anchor_cells.classify(half, 0.75) == "neither"  # half is not more than half
  assert anchor_cells.classify(half, 0.8) == "unfit"
  most = anchor_cells.score(*answers(9, 4, 180), sets)
  assert most == {"inferential": 0.5625, "symmetric": 0.25, "seen": 0.75}
  assert anchor_cells.classify(most, 0.75) == "inferential"  # seen at the threshold fits
  mirror = anchor_cells.score(*answers(2, 9, 240), sets)
  assert mirror == {"inferential": 0.125, "symmetric": 0.5625, "seen": 1.0}
  assert anchor_cells.classify(mirror, 0.9) == "symmetric"
  unfit = anchor_cells.score(*answers(16, 0, 120), sets)
  assert unfit == {"inferential": 1.0, "symmetric": 0.0, "seen": 0.5}
  assert anchor_cells.classify(unfit, 0.9) == "unfit"  # a model that did not fit the task is not called inferential


def test_stage_plans_of_the_arms():
  cfg = AnchorStudyConfig(steps=1000, stage_alpha=1.0)
  assert anchor_cells.stage_plan(cfg, "fixed", 4) == [(4, 1000)]
  assert anchor_cells.stage_plan(cfg, "midas", 4) == [(1, 100), (2, 200), (3, 300), (4, 400)]
  assert anchor_cells.stage_plan(cfg, "gradstack", 2) == [(1, 333), (2, 667)]


def _cell(arm, seed, inferential, symmetric, seen=1.0):
  return {"arm": arm, "gamma": 0.9, "learning_rate": ANCHOR_OPTIMIZER.learning_rate, "depth": 4, "seed": seed,
          "inferential": inferential, "symmetric": symmetric, "seen": seen, "kind": "x"}


def test_the_grid_and_phase_diagram_have_a_row_per_arm_with_seed_means_and_ranges(tmp_path):
  cfg = AnchorStudyConfig(gammas=(0.9,), depths=(4,), seeds=(0, 1), arms=("fixed", "midas", "gradstack"))
  cells = [_cell("fixed", 0, 0.1, 0.8), _cell("fixed", 1, 0.1, 0.6), _cell("midas", 0, 0.9, 0.0),
           _cell("midas", 1, 0.5, 0.2), _cell("gradstack", 0, 0.3, 0.3, seen=0.5), _cell("gradstack", 1, 0.3, 0.3)]
  grid = anchor_study.summarize(cfg, cells)
  assert [g["arm"] for g in grid] == ["fixed", "midas", "gradstack"]
  fixed, midas, gradstack = grid
  assert (fixed["symmetric"], fixed["seed_range"]["symmetric"], fixed["kind"]) == (pytest.approx(0.7), [0.6, 0.8],
                                                                                   "symmetric")
  assert (midas["inferential"], midas["kind"]) == (pytest.approx(0.7), "inferential")
  assert gradstack["kind"] == "unfit"  # mean seen accuracy 0.75 < fit_threshold
  text = anchor_study.format_grid(cfg, grid)
  for arm in cfg.arms:
    assert f"  {arm} depth 4 gamma 0.9: inferential" in text
  assert "0.10/0.70 1.00 symme" in text.splitlines()[1]
  path = str(tmp_path / "phase.png")
  anchor_study.plot_phase_diagram(cfg, grid, path)
  assert os.path.getsize(path) > 1000


def test_growing_a_cell_copies_layers_and_their_adam_moments():
  """MIDAS from 2 one-layer blocks to 3: provenance [0, 0, 1]; every `layers` leaf is gathered, its Adam mu and nu
  too, and nothing else changes."""
  import jax  # pylint: disable=import-outside-toplevel
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  from midas_jax.model import Decoder  # pylint: disable=import-outside-toplevel
  from midas_jax.train_state import TrainState  # pylint: disable=import-outside-toplevel
  cfg = AnchorStudyConfig(model=dataclasses.replace(ANCHOR_MODEL, d_model=16, d_ff=32), steps=10,
                          optimizer=dataclasses.replace(ANCHOR_OPTIMIZER, warmup_steps=1))
  model = Decoder(anchor_cells.model_config(cfg, 0.5, 2))
  shapes = jax.eval_shape(model.init, jax.random.key(0), anchor_cells.decoder_batch(np.zeros((1, 8), np.int32)))

  def distinct(tree):  # every entry of every array leaf differs, across leaves too (a swap of leaves shows)
    leaves, treedef = jax.tree.flatten(tree)
    return treedef.unflatten([np.arange(x.size, dtype=np.float32).reshape(x.shape) / x.size + i if x.ndim else x
                              for i, x in enumerate(leaves)])

  params = distinct(nn.unbox(shapes["params"]))
  tx, _ = anchor_cells.cell_optimizer(cfg, cfg.optimizer.learning_rate)
  opt_state = distinct(tx.init(params))
  state = TrainState(step=np.zeros((), np.int32), params=params, opt_state=opt_state)
  _, grown_state = anchor_cells.next_stage(cfg, "midas", 0.5, 3, model, tx, state, jax.random.key(0))
  grown, grown_opt = grown_state.params, grown_state.opt_state
  key = lambda path: tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", None))) for k in path)  # noqa: E731
  # The parameters of the scanned layer stack: everything under params["layers"], depth first.
  layered = {key(path) for path, _ in jax.tree_util.tree_leaves_with_path(params) if key(path)[0] == "layers"}
  assert len(layered) == 16 and all(x.shape[0] == 2 for x in jax.tree.leaves(params["layers"]))

  def changes(before, after):
    """The paths of the leaves that grew; each must be its old rows [0, 0, 1], every other leaf unchanged."""
    old, new = jax.tree_util.tree_leaves_with_path(before), jax.tree_util.tree_leaves_with_path(after)
    assert [key(p) for p, _ in old] == [key(p) for p, _ in new]
    out = set()
    for (path, a), (_, b) in zip(old, new):
      a, b = np.asarray(a), np.asarray(b)
      if a.shape != b.shape:
        out.add(key(path))
        np.testing.assert_array_equal(b, a[np.array([0, 0, 1])], err_msg=jax.tree_util.keystr(path))
      else:
        np.testing.assert_array_equal(b, a, err_msg=jax.tree_util.keystr(path))
    return out

  assert changes(params, grown) == layered
  # Adam's moments sit in the optimizer state as (..., "mu" or "nu", *parameter path): exactly those of the layers grow.
  opt_paths = [key(path) for path, _ in jax.tree_util.tree_leaves_with_path(opt_state)]
  moments = {k for k in opt_paths if any(part in ("mu", "nu") and k[i + 1:] in layered for i, part in enumerate(k))}
  assert len(moments) == 2 * len(layered)
  assert changes(opt_state, grown_opt) == moments


def test_cli_names_a_bad_setting(tmp_path, repo_root, capsys):
  gin_file = os.path.join(repo_root, "gin", "experiments", "anchor_gamma_cpu.gin")
  args = ["study", "anchor", f"--gin_file={gin_file}", f"--workdir={tmp_path}"]
  assert cli.main(args + ["--gin.AnchorStudyConfig.gamas=[0.5]"]) == 2
  assert "gammas" in capsys.readouterr().err
  assert cli.main(args + ["--gin.AnchorStudyConfig.depths=[0]"]) == 2
  assert "AnchorStudyConfig.depths" in capsys.readouterr().err
  assert cli.main(args + ["--gin.AnchorStudyConfig.d_model=16"]) == 2  # a setting of the study's model now
  assert "ModelConfig.d_model" in capsys.readouterr().err
