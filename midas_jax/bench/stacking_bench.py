"""`midas bench stacking`: measured wall-clock speedup of MIDAS Prop-1 (k = 4) against the baseline.

Both runs train the same config for the same steps (midas_jax/compare.py); the measured speedup is
the ratio of their training wall time (evaluation and checkpointing excluded, growth and
recompiles included), set against the schedule's theoretical speedup from FLOP counts. Target:
measured >= 0.9 x theoretical. Each stage's train step is compiled ahead of time in the background
while the stage before it trains (train/stages.py), as in any stacked run.
"""

from __future__ import annotations

import dataclasses
from typing import Dict

from midas_jax import compare
from midas_jax.configs import RunConfig, StackingConfig
from midas_jax.data.vocab.factory import make_vocabulary
from midas_jax.stacking.schedule import flop_speedup, layer_only_speedup_of, schedule_from_config

BENCH_STACKING = StackingConfig(num_stages=4, operator="midas", alpha=1.0)


def run(config: RunConfig, workdir: str) -> Dict[str, object]:
  config = dataclasses.replace(config, stacking=BENCH_STACKING,
                               trainer=dataclasses.replace(config.trainer, progress_bar=False))
  report = compare.compare(config, workdir, save_checkpoints=False)  # checkpoint cost: bench checkpoint
  schedule = schedule_from_config(BENCH_STACKING, config.trainer.num_steps, config.model.num_layers)
  model = config.model.with_vocab(make_vocabulary(config.data).vocab_size)
  theory = flop_speedup(model, config.data.seq_len, schedule)
  return dict(report, theoretical_speedup=theory, layer_only_speedup=layer_only_speedup_of(schedule),
              measured_over_theoretical=report["measured_speedup"] / theory)


def format_report(r: Dict[str, object]) -> str:
  base, stacked = r["runs"]
  return "\n".join([
      r["table"], "",
      f"measured speedup      {r['measured_speedup']:.3f}x  (baseline {base['train_seconds']:.2f} s / "
      f"MIDAS {stacked['train_seconds']:.2f} s of training, growth {stacked['growth_seconds']:.2f} s)",
      f"theoretical speedup   {r['theoretical_speedup']:.3f}x from FLOPs "
      f"({r['layer_only_speedup']:.3f}x counting layers only)",
      f"measured/theoretical  {r['measured_over_theoretical']:.3f}  (target >= 0.9)",
      f"final eval loss       baseline {base['final_eval_loss']:.4f}, MIDAS {stacked['final_eval_loss']:.4f}",
  ])
