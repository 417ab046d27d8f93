"""One stage's build: its model, optimizer, mesh and state layout, checked before anything compiles.

A stacked run has one StageBuild per depth (train/stages.py builds them); every other program that
trains a model at one depth (the benchmarks, the studies' measurements) builds one too. All of a
run's builds share the vocabulary and the step-addressed data pipeline.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Dict, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from midas_jax import optimizer as optimizer_lib
from midas_jax import console, hosts, sharding
from midas_jax.configs import ModelConfig, RunConfig
from midas_jax.data.factory import AnyPipeline, load_data
from midas_jax.data.vocab.vocabulary import Vocabulary
from midas_jax.model import Decoder, dot_support, dummy_batch
from midas_jax.train import step as step_lib
from midas_jax.train_state import StateLayout, TrainState, create_train_state, state_layout


@dataclasses.dataclass
class StageBuild:
  """Everything one stage trains with. model_config: config.model with the vocabulary's size and
  this stage's depth, as the user wrote it otherwise (the Decoder resolves attention='auto'), except
  matmul_operands = "float32" where the CPU cannot run the steps' bfloat16 matmuls (build_stage)."""

  config: RunConfig
  model_config: ModelConfig
  vocab: Optional[Vocabulary]
  pipeline: Optional[AnyPipeline]
  mesh: Mesh
  rules: Tuple[Tuple[str, Any], ...]
  model: Decoder
  tx: optax.GradientTransformation
  lr_schedule: optax.Schedule
  layout: StateLayout
  # (train step, eval step) as compiled and run by build_stage's check, for the stage to use rather
  # than compile them again; None where no check ran.
  checked: Optional[Tuple[Any, Any]] = None

  @contextlib.contextmanager
  def context(self):
    """Mesh and logical-axis rules for tracing: activation sharding constraints resolve here."""
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(list(self.rules)):
      yield

  def init_state(self) -> TrainState:
    with self.context():
      return create_train_state(self.model, self.tx, self.layout,
                                jax.random.key(self.config.trainer.seed), self.config.data.seq_len)

  def init_state_from_params(self, params) -> TrainState:
    """Step 0 with the given parameters (e.g. an imported model) and fresh optimizer state."""
    def init(p):
      return TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=self.tx.init(p))
    with self.context():
      return jax.jit(init, out_shardings=self.layout.shardings)(params)

  def jit_train_step(self, unroll_microbatches: bool = False):
    """The jitted train step; unroll_microbatches unrolls its microbatch loop (for the compiler's
    cost analysis, which counts a loop's body once: analysis/cost_model.py)."""
    trainer = self.config.trainer
    step = step_lib.make_train_step(self.model, self.tx, self.lr_schedule, self.config.optimizer.z_loss,
                                    microbatches=trainer.microbatches, loss_chunk=trainer.loss_chunk,
                                    grad_shardings=self.layout.shardings.params,
                                    defer_fsdp=trainer.defer_fsdp_reduction,
                                    unroll_microbatches=unroll_microbatches)
    return jax.jit(step, in_shardings=(self.layout.shardings, sharding.batch_sharding(self.mesh)),
                   out_shardings=(self.layout.shardings, sharding.replicated(self.mesh)),
                   donate_argnums=0)

  def jit_eval_step(self):
    return jax.jit(step_lib.make_eval_step(self.model, self.config.trainer.loss_chunk),
                   in_shardings=(self.layout.shardings.params, sharding.batch_sharding(self.mesh)),
                   out_shardings=sharding.replicated(self.mesh))

  def abstract_args(self) -> Tuple[TrainState, Dict[str, jax.ShapeDtypeStruct]]:
    """Shapes and shardings of (state, global batch): enough to compile the train step."""
    layout = self.layout
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         layout.abstract, layout.shardings)
    rows, where = self.config.data.batch_size, sharding.batch_sharding(self.mesh)
    shapes = (self.pipeline.batch(0, "train", 0, 1) if self.pipeline is not None
              else jax.eval_shape(lambda: dummy_batch(rows, self.config.data.seq_len)))
    batch = {k: jax.ShapeDtypeStruct((rows,) + v.shape[1:], v.dtype, sharding=where) for k, v in shapes.items()}
    return state, batch

  def checked_steps(self) -> Optional[Tuple[Any, Any]]:
    """The train and eval steps compiled and run once on zeros (model/dot_support.py), or None when
    the backend cannot run one of them. Only asked where ModelConfig.matmul_operands needs it."""
    state, batch = self.abstract_args()
    with self.context():
      train = dot_support.compiled_if_runs(lambda: self.jit_train_step().lower(state, batch).compile(),
                                           (state, batch))
      evaluate = train and dot_support.compiled_if_runs(
          lambda: self.jit_eval_step().lower(state.params, batch).compile(), (state.params, batch))
    return (train, evaluate) if evaluate else None

  def one_device_share(self) -> "StageBuild":
    """This stage as one device of its mesh multiplies it, built on this process's first local
    device: the same model and depth, each device's rows of the global batch (batch_size over the
    data x fsdp axes, split into the same microbatches), the same seq_len. Its programs involve no
    other process, so running them (runs_on_one_device) cannot leave anything in the cross-process
    transport. The sharded steps gather the fsdp-sharded weights before their dots, so d_model is
    the full width in both. Where the axis rules map heads, mlp or vocab to mesh axes of more than
    one device (the tensor axis by default), each device's dots see num_heads, num_kv_heads, d_ff
    and vocab_size divided by those axes: the share's model has them divided too (head_dim kept).
    A sequence-sharded rule is not followed (dot_product attention gathers the sequence)."""
    rules = dict(self.rules)

    def ways(logical: str) -> int:  # how many devices split a logical axis
      axes = rules.get(logical) or ()
      return int(np.prod([self.mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes)]))

    cfg = self.model_config
    heads, mlp, vocab = ways("heads"), ways("mlp"), ways("vocab")
    if heads > 1:
      cfg = dataclasses.replace(cfg, num_heads=cfg.num_heads // heads, num_kv_heads=cfg.kv_heads // heads,
                                head_dim=cfg.resolved_head_dim)
    if mlp > 1:
      cfg = dataclasses.replace(cfg, d_ff=cfg.d_ff // mlp)
    if vocab > 1:
      cfg = dataclasses.replace(cfg, vocab_size=cfg.vocab_size // vocab)
    data = self.config.data
    rows = sharding.batch_sharding(self.mesh).shard_shape((data.batch_size, data.seq_len))[0]
    mesh_config = dataclasses.replace(self.config.mesh, data=1, fsdp=1, tensor=1, dcn_data=1, dcn_fsdp=1)
    config = dataclasses.replace(self.config, data=dataclasses.replace(data, batch_size=rows), mesh=mesh_config)
    mesh = sharding.make_mesh(mesh_config, jax.local_devices()[:1])
    model, tx, schedule, rules, layout = model_and_layout(config, mesh, cfg, platform=self.model.platform)
    return StageBuild(config=config, model_config=cfg, vocab=self.vocab, pipeline=self.pipeline, mesh=mesh,
                      rules=rules, model=model, tx=tx, lr_schedule=schedule, layout=layout)

  def runs_on_one_device(self) -> bool:
    """Whether this process runs one device's share of the train and eval steps (one_device_share),
    compiled and run once on zeros (model/dot_support.py)."""
    return self.one_device_share().checked_steps() is not None

  def host_batch(self, step: int, split: str = "train") -> Dict[str, np.ndarray]:
    """This process's rows of the global batch at `step`."""
    return self.pipeline.batch(step, split, jax.process_index(), jax.process_count())

  def device_batch(self, step: int, split: str = "train") -> Dict[str, jax.Array]:
    return sharding.shard_batch(self.host_batch(step, split), self.mesh)

  def evaluate(self, eval_step, params) -> Dict[str, float]:
    """Loss on the first `eval_batches` batches of the held-out split (the same batches every time)."""
    totals = None
    for i in range(self.config.trainer.eval_batches):
      aux = jax.device_get(eval_step(params, self.device_batch(i, "validation")))
      totals = aux if totals is None else jax.tree.map(np.add, totals, aux)
    out = {"loss": float(totals["objective_loss_sum"].sum() / max(totals["tokens"], 1e-9))}
    out.update(step_lib.per_objective_losses(totals["objective_loss_sum"], totals["objective_weight_sum"]))
    return out


def learning_rate(config: RunConfig, growth_steps: Sequence[int] = ()) -> optax.Schedule:
  """The global schedule, re-warmed after each growth step when StackingConfig.lr_schedule = "rewarm"."""
  schedule = optimizer_lib.learning_rate_schedule(config.optimizer, config.trainer.num_steps)
  if config.stacking.lr_schedule != "rewarm":
    return schedule
  rewarm = config.stacking.resolved_rewarm_steps(config.optimizer.warmup_steps)
  return optimizer_lib.with_rewarm(schedule, growth_steps, rewarm)


def _platform(device) -> str:
  """A device's platform for ModelConfig.attention = 'auto': jax names AMD GPUs 'gpu' too, but cuDNN is NVIDIA's."""
  if device.platform == "gpu" and "rocm" in getattr(device.client, "platform_version", "").lower():
    return "rocm"
  return device.platform


def model_and_layout(config: RunConfig, mesh: Mesh, model_config: ModelConfig, platform: Optional[str] = None,
                     growth_steps: Sequence[int] = ()) -> tuple:
  """(model, optimizer, lr schedule, axis rules, state layout) on `mesh`, checked and allocating nothing.

  platform: where the step will run, for ModelConfig.attention = 'auto' (model.Decoder resolves
  it); None takes the mesh's devices' platform (an abstract mesh has none: then jax's default
  backend). growth_steps: the run's stage boundaries, where a "rewarm" learning rate warms up again.
  """
  sharding.check_divisibility(model_config, mesh, config.data.batch_size, config.trainer.microbatches)
  if platform is None and isinstance(mesh, Mesh):
    platform = _platform(mesh.devices.flat[0])
  model = Decoder(model_config, platform=platform)
  schedule = learning_rate(config, growth_steps)
  tx = optimizer_lib.make_optimizer(config.optimizer, config.trainer.num_steps, schedule)
  rules = config.mesh.rules_as_tuples()
  return model, tx, schedule, rules, state_layout(model, tx, mesh, rules, config.data.seq_len)


def build_stage(config: RunConfig, devices=None, data: Optional[Tuple[Vocabulary, AnyPipeline]] = None,
                num_layers: Optional[int] = None, growth_steps: Sequence[int] = (),
                model_config: Optional[ModelConfig] = None) -> StageBuild:
  """Reads the data, checks every shape against the mesh, and lays out the state, compiling nothing.

  data: (vocab, pipeline) to reuse instead of loading them again; num_layers: the depth of this
  stage's model when it differs from the final depth; growth_steps: as in model_and_layout;
  model_config: config.model with the vocabulary filled in, when the caller has it already.
  """
  mesh = sharding.make_mesh(config.mesh, devices)
  vocab, pipeline = data or load_data(config)
  model_config = model_config or config.model.with_vocab(vocab.vocab_size)
  if num_layers is not None:
    # A stage shallower than the final model: a 'final' residual init scales by the depth the run grows to.
    final = model_config.residual_init_layers or model_config.num_layers
    model_config = dataclasses.replace(model_config, num_layers=num_layers, residual_init_layers=(
        final if model_config.residual_init_depth == "final" else model_config.residual_init_layers))

  def assemble(model_config: ModelConfig) -> StageBuild:
    model, tx, schedule, rules, layout = model_and_layout(config, mesh, model_config, growth_steps=growth_steps)
    return StageBuild(config=config, model_config=model_config, vocab=vocab, pipeline=pipeline, mesh=mesh,
                      rules=rules, model=model, tx=tx, lr_schedule=schedule, layout=layout)

  build = assemble(model_config)
  if dot_support.needs_check(model_config, build.model.platform):
    if hosts.multi_process():
      # Not the sharded steps: one stopped part-way would leave data in the cross-process transport
      # for the next collective to meet. Every process runs one device's share locally, and if any
      # cannot, all widen, so that every process builds the same program. (A decision of its own name:
      # the next stage is built on a background thread, hosts.py.)
      runs = all(hosts.exchange("matmul_operands", build.runs_on_one_device()))
    else:
      build.checked = build.checked_steps()  # the compiled steps are the stage's: nothing compiles twice
      runs = build.checked is not None
    if not runs:
      build = assemble(dot_support.widened(model_config))  # the same products, as float32 operands
      if jax.process_index() == 0:
        console.say(f"matmul operands: float32 at depth {model_config.num_layers} (this CPU cannot run the "
                    f"step's {model_config.dtype} x {model_config.dtype} -> float32 matmuls; "
                    "ModelConfig.matmul_operands, docs/model.md#on-a-cpu-that-cannot-run-them)")
  return build
