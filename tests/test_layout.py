"""The package's layout, checked by reading its source (no process, no import of torch): no import
circle, counting imports placed inside functions; the runtime (the loop and what it uses) never
imports a CLI verb's module; no module reaches for another's private names; the user's error type
lives in `errors.py`; what only one backend has (DeepSpeed's partitioned parameters, FSDP's
modules, the accelerate plugins) is named only in `toolkit/backends/`. Modules are named by their
dotted path under `toolkit` (`backends.deepspeed`). Run by hand: `python -m pytest tests/test_layout.py -q`."""

import ast
import re

from helpers import ROOT

PACKAGE = ROOT / "toolkit"


def name_of(path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, ast.Module]:
    return {name_of(p): ast.parse(p.read_text(), str(p)) for p in PACKAGE.rglob("*.py")}


def package_of(name: str, tree_is_package: bool) -> list[str]:
    return name.split(".") if tree_is_package else name.split(".")[:-1]


def verbs() -> set[str]:
    """The modules `cli.VERBS` dispatches to, and the CLI itself."""
    text = (PACKAGE / "cli.py").read_text()
    block = text[text.index("VERBS = {"):text.index("}\n", text.index("VERBS = {"))]
    return {f"verbs.{m}" for m in re.findall(r'\("(\w+)", "', block)} | {"cli", "__main__"}


def imports(name: str, tree: ast.Module, known: set[str]) -> list[tuple[str, list[str]]]:
    """(module imported, names taken from it) for each relative import of module `name`
    (`from . import x`, `from .x import y`, `from ..x import y`), as dotted names under toolkit."""
    is_package = (PACKAGE / name.replace(".", "/") / "__init__.py").is_file() if name else True
    here = package_of(name, is_package) if name else []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level >= 1:
            base = here[:len(here) - (node.level - 1)]
            target = ".".join(base + (node.module.split(".") if node.module else []))
            names = [a.name for a in node.names]
            submodules = [f"{target}.{n}" if target else n for n in names]
            if any(m in known for m in submodules):  # `from . import x`: x is a module
                found += [(m, []) for m in submodules if m in known]
            else:
                found.append((target, names))
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: {m for m, _ in imports(name, tree, set(mods)) if m in mods and m != name}
            for name, tree in mods.items()}


def cycle(edges: dict[str, set[str]]) -> list[str]:
    """One import circle, as the modules along it, or [] when there is none."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(v: str) -> list[str]:
        state[v] = 1
        path.append(v)
        for w in sorted(edges[v]):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        state[v] = 2
        path.pop()
        return []

    for v in sorted(edges):
        if v not in state and (found := visit(v)):
            return found
    return []


def test_no_import_circle():
    assert cycle(graph()) == []


def test_the_check_finds_a_circle():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_runtime_never_imports_a_verb():
    edges, verb = graph(), verbs()
    assert {f"verbs.{v}" for v in ("estimate", "generate", "evaluate", "merge", "convert", "plot", "doctor")} <= verb
    wrong = {m: sorted(edges[m] & verb) for m in edges if m not in verb and edges[m] & verb}
    assert wrong == {}


def test_no_private_name_crosses_a_module():
    mods = modules()
    wrong = []
    for name, tree in mods.items():
        for module, names in imports(name, tree, set(mods)):
            wrong += [f"{name}: from .{module} import {n}" for n in names if n.startswith("_") and n != "__version__"]
        aliases = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level >= 1
                   and not node.module for a in node.names}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                wrong.append(f"{name}: {node.value.id}.{node.attr}")
    assert wrong == []


def test_the_graph_sees_subpackages():
    edges = graph()
    assert {"backends.base", "backends.deepspeed", "backends.fsdp", "backends.ddp"} <= edges["backends"]
    assert "backends" in edges["training.run"] and "backends.deepspeed_config" in edges["backends.deepspeed"]
    assert "backends.launch_config" in edges["backends.base"]


# What only one backend has; outside toolkit/backends/ only the modules that read the configs users
# bring (their JSON and YAML, before any launch) may say these words.
BACKEND_WORDS = re.compile(r"\b(ds_id|ds_shape|ds_tensor|zero_optimization_stage|deepspeed_plugin|fsdp_plugin|"
                           r"FSDPModule|DeepSpeedEngine|safe_get_full_\w+|safe_set_full_\w+|was_step_applied)\b")
READS_CONFIGS = {"verbs.doctor", "verbs.estimate"}


def test_backend_specifics_live_in_backends():
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        name = name_of(path)
        if name.startswith("backends") or name in READS_CONFIGS:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if BACKEND_WORDS.search(line.split("#")[0]):
                wrong.append(f"{name}:{i}: {line.strip()}")
    assert wrong == []


def test_the_user_error_type_lives_in_errors():
    defined = [name for name, tree in modules().items() for node in ast.walk(tree)
               if isinstance(node, ast.ClassDef) and node.name == "ToolkitError"]
    assert defined == ["errors"]


def test_test_modules_take_helpers_from_helpers_not_conftest():
    """conftest.py holds fixtures and hooks only; what test modules import lives in tests/helpers.py."""
    wrong = [p.name for p in (ROOT / "tests").glob("*.py") if re.search(r"^\s*(from conftest import|import conftest)",
                                                                        p.read_text(), re.M)]
    assert wrong == []
    conftest = ast.parse((ROOT / "tests" / "conftest.py").read_text())
    plain = [n.name for n in conftest.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("pytest_")
             and not any("fixture" in ast.unparse(d) for d in n.decorator_list)]
    assert plain == [], "helpers belong in tests/helpers.py"


# The parts from the ground up: a module imports only from its own part or the parts below it. The
# ground is the vocabulary every part speaks (the recipe, the user's error, signals, fault seams);
# the entry (the CLI) sits on top. docs/architecture.md draws the same order.
LAYERS = ["ground", "storage", "observe", "model", "data", "backends", "rollout", "training", "verbs", "entry"]
GROUND = {"errors", "faults", "stops", "config"}
# ground that is a folder of modules: the recipe's schema, loading and validation; the optimizers and schedules
# the recipe names (what a name means is checked when the recipe loads)
GROUND_PACKAGES = {"config", "optim"}
ENTRY = {"", "cli", "__main__"}


def layer_of(module: str) -> str:
    if module in GROUND or module.split(".")[0] in GROUND_PACKAGES:
        return "ground"
    if module in ENTRY:
        return "entry"
    part = module.split(".")[0]
    assert part in LAYERS, f"toolkit/{part}: a part not in LAYERS (add it where it belongs in the order)"
    return part


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    rank = {name: i for i, name in enumerate(LAYERS)}
    return sorted(f"{m} ({layer_of(m)}) imports {t} ({layer_of(t)})" for m, targets in edges.items() for t in targets
                  if rank[layer_of(t)] > rank[layer_of(m)])


def test_parts_import_only_downward():
    assert upward_imports(graph()) == []


def test_the_order_check_finds_an_upward_import():
    assert upward_imports({"storage.disk": {"training.run"}, "training.run": set()}) == [
        "storage.disk (storage) imports training.run (training)"]


def test_every_module_lives_in_a_part():
    top = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert top == GROUND - GROUND_PACKAGES | (ENTRY - {""})
    assert {p.name for p in PACKAGE.iterdir()
            if p.is_dir() and (p / "__init__.py").is_file()} == set(LAYERS) - {"ground", "entry"} | GROUND_PACKAGES


def test_exit_codes_are_declared_in_one_table():
    """Every `EXIT_* = ...` lives in errors.py, and its table describes each code."""
    declared = {name: [t.id for node in ast.walk(tree) if isinstance(node, ast.Assign) for t in node.targets
                       if isinstance(t, ast.Name) and t.id.startswith("EXIT_")] for name, tree in modules().items()}
    assert {name for name, found in declared.items() if found} == {"errors"}
    from toolkit import errors

    codes = {getattr(errors, n) for n in declared["errors"] if n != "EXIT_CODES"}
    assert codes == set(errors.EXIT_CODES)


def test_the_architecture_page_names_every_module():
    """docs/architecture.md's layout block lists each module on its part's line (continuation lines
    included), so a new module is placed there too."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("```")[1]
    lines_of: dict[str, str] = {}
    part = None
    for line in block.splitlines():
        head = line.split()[0] if line.strip() and not line.startswith(" ") else None
        if head:
            part = head.rstrip("/")
        if part:
            lines_of[part] = lines_of.get(part, "") + " " + line
    missing = []
    for path in PACKAGE.rglob("*.py"):
        name = name_of(path)
        if path.name == "__init__.py":
            continue
        where = layer_of(name)
        if not re.search(rf"\b{re.escape(path.stem)}\b", lines_of.get(where, "")):
            missing.append(name)
    assert missing == []


def test_the_loop_reads_in_one_screen():
    """`fit` <= 60 lines, `train_step` <= 80 (one optimizer step), `build` <= 60 (a list of stages)."""
    limits = {("training.loop", "fit"): 60, ("training.loop", "train_step"): 80, ("training.build", "build"): 60}
    mods = modules()
    lengths = {(m, f): next(n.end_lineno - n.lineno + 1 for n in mods[m].body
                            if isinstance(n, ast.FunctionDef) and n.name == f) for m, f in limits}
    assert {k: v for k, v in lengths.items() if v > limits[k]} == {}


# The objectives' own modules, and the registry that names them: the only places a method's name is compared.
OBJECTIVE_MODULES = {"config.methods", "config.objectives", "config.validate_objectives", "training.objectives",
                     "training.dpo_losses", "training.kto", "training.reward_training", "training.online",
                     "training.online_setup", "training.policy_loss", "training.rl_log", "training.rewards",
                     "training.distill",
                     "config.trl_config"}  # TRL's SFTConfig, DPOConfig and GRPOConfig read as recipes: tables by kind


def method_comparisons(tree: ast.Module, names: set[str]) -> list[int]:
    """The lines of `tree` that compare a method (anything named `method`: `recipe.rl.method`, `p.method`) with a
    value or a collection (`==`, `!=`, `in`, `not in`; `is None`, whether a section is set, is not a name), or
    that key a table by two or more methods' names."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = any(isinstance(x, ast.Attribute) and x.attr == "method" or isinstance(x, ast.Name)
                        and x.id == "method" for x in sides)
            if named and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops):
                found.append(node.lineno)
        elif isinstance(node, ast.Dict):
            keys = {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
            if len(keys & names) >= 2:
                found.append(node.lineno)
    return found


def method_names() -> set[str]:
    tree = ast.parse((PACKAGE / "config" / "methods.py").read_text())
    return {n.args[0].value for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "Method"
            and n.args and isinstance(n.args[0], ast.Constant)}


def test_only_the_objectives_compare_a_methods_name():
    """Outside the objectives' modules and their registry (config/methods.py), code asks `method_of(recipe)` what a
    method is; it never compares its name (issue 66: adding an objective touches its own files only)."""
    names = method_names()
    assert {"sft", "dpo", "kto", "reward", "grpo", "rloo", "distill"} <= names
    found = {name: lines for name, tree in modules().items() if name not in OBJECTIVE_MODULES
             and (lines := method_comparisons(tree, names))}
    assert found == {}


def test_the_check_finds_a_planted_comparison():
    source = (PACKAGE / "training" / "build.py").read_text()
    names = method_names()
    assert method_comparisons(ast.parse(source), names) == []
    planted = source + '\n\nif recipe.preference.method == "kto":\n    pass\n'
    assert method_comparisons(ast.parse(planted), names) == [source.count("\n") + 3]
    assert method_comparisons(ast.parse('x = recipe.rl.method in ("grpo", "rloo")'), names) == [1]
    assert method_comparisons(ast.parse('RATES = {"dpo": 1, "kto": 2}'), names) == [1]
    assert method_comparisons(ast.parse('if recipe.rl.method is None:\n    pass'), names) == []
