"""analysis/hlo_loops.py reads which loops each collective of an optimized HLO module runs in."""

from midas_jax.analysis import hlo_loops

# The shape of a libtpu module with a microbatch loop around a scanned layer stack: a reduction in
# ENTRY, one in the microbatch loop's body, one in a fusion the layer loop's body calls, an async
# all-gather pair in the layer body, and a computation nobody calls.
MODULE = """HloModule jit_step, entry_computation_layout={...}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  ROOT %add = f32[] add(%a, %b)
}

%fused_grad (p: f32[64]) -> f32[8] {
  %p = f32[64]{0} parameter(0)
  ROOT %rs = f32[8]{0} reduce-scatter(%p), channel_id=3, replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add
}

%layer_body (t: (s32[], f32[64])) -> (s32[], f32[64]) {
  %ag = (f32[8]{0}, f32[64]{0}) all-gather-start(%x), channel_id=4, dimensions={0}
  %agd = f32[64]{0} all-gather-done(%ag)
  %f = f32[8]{0} fusion(%agd), kind=kLoop, calls=%fused_grad
  ROOT %t = (s32[], f32[64]) tuple(%i, %agd)
}

%layer_cond (t: (s32[], f32[64])) -> pred[] {
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%micro_body (t: (s32[], f32[64])) -> (s32[], f32[64]) {
  %w = (s32[], f32[64]) while(%t), condition=%layer_cond, body=%layer_body
  %ar = f32[64]{0} all-reduce(%g), channel_id=2, replica_groups=[1,8]<=[8], to_apply=%add
  ROOT %r = (s32[], f32[64]) tuple(%i, %ar)
}

%micro_cond (t: (s32[], f32[64])) -> pred[] {
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%unused (p: f32[64]) -> f32[64] {
  ROOT %ar = f32[64]{0} all-reduce(%p), channel_id=9, to_apply=%add
}

ENTRY %main (p0: f32[64]) -> f32[64] {
  %loop = (s32[], f32[64]) while(%init), condition=%micro_cond, body=%micro_body
  %sum = f32[]{:T(128)} all-reduce(%loss), channel_id=1, replica_groups=[1,8]<=[8], to_apply=%add
  ROOT %out = f32[64]{0} get-tuple-element(%loop), index=1
}
"""


def test_each_collective_is_found_in_the_loops_it_runs_in():
  found = {(c.op, c.loops) for c in hlo_loops.collectives(MODULE)}
  assert found == {("all-reduce", ()), ("all-reduce", ("micro_body",)),
                   ("all-gather", ("micro_body", "layer_body")), ("reduce-scatter", ("micro_body", "layer_body"))}
  assert len(hlo_loops.collectives(MODULE)) == 4  # the async pair once; the computation nobody calls not at all
  assert hlo_loops.reductions_by_depth(hlo_loops.collectives(MODULE)) == {0: 1, 1: 1, 2: 1}


def test_a_module_without_loops_runs_everything_once():
  flat = MODULE.replace("%loop = (s32[], f32[64]) while(%init), condition=%micro_cond, body=%micro_body",
                        "%loop = (s32[], f32[64]) tuple(%init)")
  assert hlo_loops.reductions_by_depth(hlo_loops.collectives(flat)) == {0: 1}
