"""The package's layering: every import points down the floor table, nothing imports in a circle, and
the package's own modules are imported at the top of a module, where readers and tools see them.

The floor table lives in docs/architecture.md (between the `floors` markers) and is read from there:
a module may import its own floor and the floors below, never one above. Imports are read with
`ast`, at module level and inside functions alike.
"""

import ast
import collections
import pathlib
import re
from typing import Dict, List, NamedTuple, Optional, Sequence

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "midas_jax"
ARCHITECTURE = ROOT.joinpath("docs/architecture.md")  # its #layering section

# Third-party libraries a module may import inside a function, and why: each is heavy to import and
# needed by few commands, so a run that does not use it never pays for it. Everything else, and
# every module of the package itself, is imported at module level.
LAZY_LIBRARIES = {
    "tensorflow": "seconds and a GiB to import; only seqio/TFDS sources and the t5 reference use it (data extra)",
    "tensorflow_datasets": "imports TensorFlow; only TFDS sources read it (data extra)",
    "seqio": "imports TensorFlow; only seqio sources and seqio vocabularies (data extra)",
    "t5": "the span-corruption reference of `midas bench data`, installed apart without its dependencies",
    "apache_beam": "only `midas data prepare` runs Beam (data extra)",
    "pyarrow": "only parquet sources read it (data extra)",
    "torch": "only conversion reads torch state dicts (convert extra)",
    "transformers": "only conversion uses it, and it imports torch (convert extra)",
    "safetensors": "only conversion writes and reads safetensors (convert extra)",
    "sentencepiece.sentencepiece_model_pb2": "needs protobuf, which only the data extra brings; guarded",
    "matplotlib": "only figures need it, and pyplot picks a backend on import",
    "scipy": "scipy.stats takes half a second to import; only the stacking study's intervals use it",
    "tensorboardX": "a second to import; only process 0 of a run that writes events needs it",
    "lm_eval": "only `midas eval --suite=lm_eval` runs the harness, and it imports datasets (eval extra)",
    "wandb": "only a run with TrainerConfig.trackers including 'wandb' imports it (wandb extra)",
    "huggingface_hub": "only conversion plans shards with it; it comes with transformers (convert extra)",
}


class Import(NamedTuple):
  source: str  # the importing module
  target: str  # the imported module of the package, or the third-party module's dotted name
  line: int
  in_function: bool


def floor_table(text: str) -> Dict[str, int]:
  """{module or package name below midas_jax: floor} from the table between the `floors` markers."""
  block = re.search(r"<!-- floors -->(.*?)<!-- /floors -->", text, re.S)
  assert block, f"{ARCHITECTURE} has no <!-- floors --> table"
  floors = {}
  for row in block.group(1).splitlines():
    cells = [c.strip() for c in row.strip().strip("|").split("|")]
    if len(cells) < 2 or not cells[0].isdigit():
      continue
    for name in re.findall(r"`([\w.]+)`", cells[1]):
      floors[name] = int(cells[0])
  return floors


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
  parts = list(path.relative_to(root).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts = parts[:-1]
  return ".".join(parts)


def read_imports(root: pathlib.Path, package: str = PACKAGE) -> Dict[str, List[Import]]:
  """Every module of `package` under `root` and what it imports."""
  modules = {module_name(p, root): p for p in (root / package).rglob("*.py")}
  found = {}
  for name, path in modules.items():
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found[name] = [imp for node, in_function in _import_nodes(tree)
                   for imp in _resolve(name, is_package, node, in_function, modules)]
  return found


def _import_nodes(tree: ast.AST):
  """(import node, whether it sits inside a function) for every import of the tree."""
  def visit(node, in_function):
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.Import, ast.ImportFrom)):
        yield child, in_function
      yield from visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))
  yield from visit(tree, False)


def _resolve(module: str, is_package: bool, node, in_function: bool, modules) -> List[Import]:
  if isinstance(node, ast.Import):
    names = [a.name for a in node.names]
  else:
    base = node.module or ""
    if node.level:  # relative: from the importing module's package
      package = module if is_package else module.rpartition(".")[0]
      for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
      base = f"{package}.{base}" if base else package
    names = [f"{base}.{a.name}" for a in node.names]
  out = []
  for name in dict.fromkeys(names):
    target = name
    while target not in modules and "." in target and target.split(".")[0] == module.split(".")[0]:
      target = target.rpartition(".")[0]  # `from module import name`: the module; a submodule stays
    out.append(Import(module, target, node.lineno, in_function))
  return out


def own(imp: Import, package: str = PACKAGE) -> bool:
  return imp.target == package or imp.target.startswith(package + ".")


def floor_of(module: str, floors: Dict[str, int], package: str = PACKAGE) -> Optional[int]:
  """The floor of the longest table entry that is `module` or a package holding it (the root package
  itself, which holds only a docstring, is the ground)."""
  if module == package:
    return 0
  parts = module.split(".")[1:]
  for n in range(len(parts), 0, -1):
    if ".".join(parts[:n]) in floors:
      return floors[".".join(parts[:n])]
  return None


def upward_imports(imports: Dict[str, List[Import]], floors: Dict[str, int]) -> List[str]:
  bad = []
  for module, imps in sorted(imports.items()):
    for imp in imps:
      if own(imp) and floor_of(imp.target, floors) > floor_of(module, floors):
        bad.append(f"{module}:{imp.line} (floor {floor_of(module, floors)}) imports {imp.target} "
                   f"(floor {floor_of(imp.target, floors)})")
  return bad


def cycles(edges: Dict[str, set]) -> List[List[str]]:
  """The strongly connected components of more than one node (Tarjan), each sorted."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def connect(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(edges.get(v, ())):
      if w not in index:
        connect(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for v in sorted(edges):
    if v not in index:
      connect(v)
  return found


def module_edges(imports: Dict[str, List[Import]]) -> Dict[str, set]:
  return {m: {i.target for i in imps if own(i) and i.target != m} for m, imps in imports.items()}


def folder_edges(imports: Dict[str, List[Import]]) -> Dict[str, Dict[str, set]]:
  """{folder: the imports between its parts}, for the package ("") and every folder at any depth.

  An import counts in the deepest folder that holds both its ends, as an edge between the parts that
  hold them there: a sub-folder as a whole (everything under it), or the folder's own modules, its
  __init__ among them, as one part named after the folder. At the top each module is a part of its
  own (errors, cli) beside the folders (data, train). So data/'s own modules importing data/store/
  while data/store/ imports them is the cycle data <-> data.store, found in folder data; two sibling
  folders importing each other (data.store <-> data.ul2) are a cycle there too.
  """
  folders = {m for m in imports if any(other.startswith(m + ".") for other in imports)}

  def holders(module: str) -> List[str]:  # the folders holding `module` below the package, outermost first
    parts = module.split(".")[1:]
    return parts if module in folders else parts[:-1]

  edges = collections.defaultdict(lambda: collections.defaultdict(set))
  for module, imps in imports.items():
    for imp in imps:
      if not own(imp) or PACKAGE in (module, imp.target):  # the package itself holds only a docstring
        continue
      a, b = holders(module), holders(imp.target)
      depth = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
      folder = ".".join(a[:depth])
      part = lambda held, name: (".".join(held[:depth + 1]) if len(held) > depth  # noqa: E731
                                 else folder or name.split(".")[1])
      source, target = part(a, module), part(b, imp.target)
      if source != target:
        edges[folder][source].add(target)
  return edges


def folder_cycles(imports: Dict[str, List[Import]]) -> List[List[str]]:
  """The cycles among the parts of each folder (folder_edges), the package's own first."""
  return [c for _, edges in sorted(folder_edges(imports).items()) for c in cycles(edges)]


def function_level_imports(imports: Dict[str, List[Import]], lazy: Sequence[str]) -> List[str]:
  """Imports inside functions of the package itself, or of a library not in `lazy`."""
  bad = []
  for module, imps in sorted(imports.items()):
    for imp in imps:
      allowed = not own(imp) and any(imp.target == name or imp.target.startswith(name + ".") for name in lazy)
      if imp.in_function and not allowed:
        bad.append(f"{module}:{imp.line} imports {imp.target} inside a function")
  return bad


@pytest.fixture(scope="module")
def imports():
  return read_imports(ROOT)


@pytest.fixture(scope="module")
def floors():
  return floor_table(ARCHITECTURE.read_text())


def test_every_module_has_a_floor(imports, floors):
  assert [m for m in imports if floor_of(m, floors) is None] == []
  assert set(floors) <= {m.split(".", 1)[1] for m in imports if "." in m}, "the table names a module that is gone"


def test_no_import_points_up_a_floor(imports, floors):
  assert upward_imports(imports, floors) == []


def test_no_module_and_no_folder_imports_in_a_circle(imports):
  assert cycles(module_edges(imports)) == []
  assert folder_cycles(imports) == []


def test_the_package_is_imported_at_module_level_and_only_heavy_libraries_lazily(imports):
  assert function_level_imports(imports, tuple(LAZY_LIBRARIES)) == []


def test_each_check_fails_on_a_package_that_breaks_it(tmp_path):
  """A small package with one of each mistake: every check names it."""
  pkg = tmp_path / PACKAGE
  (pkg / "low").mkdir(parents=True)
  (pkg / "__init__.py").write_text("")
  (pkg / "low" / "__init__.py").write_text("")
  (pkg / "low" / "a.py").write_text("from midas_jax.high import b\n")  # points up
  (pkg / "low" / "c.py").write_text("from midas_jax.low import d\n")  # c <-> d
  (pkg / "low" / "d.py").write_text("from . import c\n")
  (pkg / "high.py").write_text("import os\n\ndef f():\n  from midas_jax.low import c\n  import json\n"
                               "  import matplotlib.pyplot\n")
  (pkg / "b.py").write_text("")
  (pkg / "low" / "sub").mkdir()  # low's own modules and its sub-folder import each other: low <-> low.sub
  (pkg / "low" / "sub" / "__init__.py").write_text("")
  (pkg / "low" / "sub" / "e.py").write_text("from midas_jax.low import d\n")
  (pkg / "low" / "f.py").write_text("from midas_jax.low.sub import e\n")
  found = read_imports(tmp_path)
  floors = {"low": 1, "high": 2, "b": 2}
  assert upward_imports(found, floors) == ["midas_jax.low.a:1 (floor 1) imports midas_jax.high (floor 2)"]
  assert cycles(module_edges(found)) == [["midas_jax.low.c", "midas_jax.low.d"]]
  assert folder_cycles(found) == [["high", "low"], ["low", "low.sub"]]
  assert function_level_imports(found, ("matplotlib",)) == ["midas_jax.high:4 imports midas_jax.low.c inside a function",
                                                              "midas_jax.high:5 imports json inside a function"]
  assert floor_of("midas_jax.low.a", floors) == 1 and floor_of("midas_jax.other", floors) is None
