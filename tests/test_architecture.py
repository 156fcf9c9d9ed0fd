"""The package's architecture (docs/architecture.md): wings whose imports run one way, no import
circle, commands that never import one another, a trainer that reads on a screen, and registries
that are the one list of their members."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_alp"

# The wings from the top down, as docs/architecture.md states them; a wing may import the wings
# below it. Wings on one line sit side by side and do not import each other, except as listed.
ORDER = [
    {"cli", "commands"},
    {"trainer"},
    {"plan"},
    {"resolve"},
    {"batches", "diagnostics", "sync"},
    {"training", "rollout", "tir"},
    {"algorithms", "models", "data", "rewards"},
    {"config"},
    {"runtime"},
]
SIDEWAYS = {("tir", "rollout"), ("cli", "commands")}


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(("megatron_alp", *path.relative_to(PACKAGE).with_suffix("").parts))
        out[name.removesuffix(".__init__")] = ast.parse(path.read_text())
    return out


MODULES = _modules()


def _imports(name: str, tree: ast.Module) -> set[str]:
    """The package modules ``name`` imports anywhere in its text (type-checking blocks included)."""
    package = name if (PACKAGE / Path(*name.split(".")[1:]) / "__init__.py").exists() else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                if target in MODULES:
                    found.add(target)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in MODULES}
    return {t for t in found if t != name and not name.startswith(t + ".") and not t.startswith(name + ".")}


GRAPH = {name: _imports(name, tree) for name, tree in MODULES.items()}


def _wing(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "megatron_alp"


def _level(wing: str) -> int:
    return next(i for i, wings in enumerate(ORDER) if wing in wings)


def test_every_module_belongs_to_a_wing():
    wings = {_wing(m) for m in MODULES} - {"megatron_alp"}
    assert wings <= set().union(*ORDER), wings - set().union(*ORDER)


def test_imports_run_one_way_between_wings():
    wrong = []
    for module, targets in GRAPH.items():
        for target in targets:
            a, b = _wing(module), _wing(target)
            if a == b or a == "megatron_alp" or (a, b) in SIDEWAYS:
                continue
            if _level(b) <= _level(a):
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports against the wing order:\n" + "\n".join(sorted(wrong))


def test_no_import_circle():
    """Tarjan's strongly connected components of the module graph: every one is a single module."""
    index, low, stack, on, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not circles, circles


def test_commands_never_import_each_other():
    """A command is a module of commands/ with a ``run``; the others (context, session) serve them all."""
    commands = {m for m, tree in MODULES.items() if m.startswith("megatron_alp.commands.")
                and any(isinstance(n, ast.FunctionDef) and n.name == "run" for n in tree.body)}
    assert len(commands) >= 9, commands
    wrong = [(m, t) for m in commands for t in GRAPH[m] if t in commands]
    assert not wrong, wrong


def _span(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


def test_the_trainer_reads_on_a_screen():
    """The trainer drives components (learner, checkpointer, validator, calibrator, batch source);
    it does not grow their work back into itself."""
    tree = MODULES["megatron_alp.trainer.trainer"]
    trainer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RLTrainer")
    assert _span(trainer) <= 230
    iteration = next(f for f in trainer.body if isinstance(f, ast.FunctionDef) and f.name == "train_iteration")
    assert _span(iteration) <= 40
    imported = {t for t in GRAPH["megatron_alp.trainer.trainer"]}
    assert len(imported) <= 32, sorted(imported)


def test_no_long_function_in_the_trainer_and_plan_wings():
    long = [(name, f.name, _span(f)) for name, tree in MODULES.items()
            if _wing(name) in ("trainer", "plan") for f in ast.walk(tree)
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and _span(f) > 60]
    assert not long, long


def test_no_class_over_350_lines():
    large = [(f"{name}.{c.name}", _span(c)) for name, tree in MODULES.items() for c in ast.walk(tree)
             if isinstance(c, ast.ClassDef) and _span(c) > 350]
    assert not large, large


def test_registries_are_the_one_list_of_their_members():
    """model.tiny, smoke --family and make-tiny offer the registered families; the vLLM engine's
    sync methods are its transports'; every registry key of the schema names a registry."""
    import argparse

    from megatron_alp.commands import make_tiny, smoke
    from megatron_alp.models.families import FAMILIES
    from megatron_alp.resolve import REGISTRIES, config_from_dict
    from megatron_alp.rollout.vllm.engine import VLLMEngine
    from megatron_alp.rollout.transports import TRANSPORTS

    for module, option in ((smoke, "--family"), (make_tiny, "family")):
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        action = next(a for a in parser._actions if option in (a.dest, *a.option_strings))
        assert sorted(action.choices) == sorted(FAMILIES)
    for family in FAMILIES:
        assert config_from_dict({"model": {"tiny": family}}).model.tiny == family
    assert set(VLLMEngine.sync_methods) == {t.method for t in TRANSPORTS}
    from megatron_alp.config import RolloutConfig
    from megatron_alp.rollout.base import ENGINES

    owned = [key for engine in ENGINES.values() for key in engine.options]
    assert set(owned) <= set(RolloutConfig.model_fields) and len(owned) == len(set(owned)), owned

    from megatron_alp.config import Config

    def registry_keys(cls):
        for f in cls.model_fields.values():
            if isinstance(f.annotation, type) and hasattr(f.annotation, "model_fields"):
                yield from registry_keys(f.annotation)
            elif f.json_schema_extra and "registry" in f.json_schema_extra:
                yield f.json_schema_extra["registry"]

    assert set(registry_keys(Config)) == set(REGISTRIES)


@pytest.mark.parametrize("data, message", [
    ({"model": {"tiny": "gpt2"}}, "model.tiny: unknown model family 'gpt2'"),
    ({"model": {"tiny": "qwen2"}, "reward": {"name": "bleu"}}, "reward.name: unknown reward 'bleu'"),
    ({"model": {"tiny": "qwen2"}, "rollout": {"engine": "trt"}}, "rollout.engine: unknown rollout engine 'trt'"),
    ({"model": {"tiny": "qwen2"}, "rollout": {"sync_method": "nfs"}}, "rollout.sync_method: unknown weight sync method"),
    ({"model": {"tiny": "qwen2"}, "rollout": {"sglang_port": 31000}},
     "rollout.sglang_port: an option of rollout.engine sglang, which this run does not use"),
    ({"model": {"tiny": "qwen2"}, "rollout": {"engine": "sglang", "engine_process": "subprocess"}},
     "rollout.engine_process: an option of rollout.engine vllm"),
])
def test_registry_names_are_checked_when_the_config_is_resolved(data, message):
    from megatron_alp.config import ConfigError
    from megatron_alp.resolve import config_from_dict

    with pytest.raises(ConfigError, match=message):
        config_from_dict(data)


def test_engine_options_at_their_defaults_are_no_refusal():
    """A config dumped whole and read back (the plan's advice, the scaling model) names every key,
    another engine's too, at its default: that is not setting it."""
    from megatron_alp.resolve import config_from_dict

    cfg = config_from_dict({"model": {"tiny": "qwen2"}})
    assert config_from_dict(cfg.model_dump()).model_dump() == cfg.model_dump()
    sglang = config_from_dict({"model": {"tiny": "qwen2"}, "rollout": {"engine": "sglang", "sglang_port": 31000}})
    assert config_from_dict(sglang.model_dump()).rollout.sglang_port == 31000


def test_the_trainer_refuses_an_unresolved_config():
    from megatron_alp.config import validate_schema
    from megatron_alp.resolve import resolve
    from megatron_alp.trainer.trainer import RLTrainer

    cfg = validate_schema({"model": {"tiny": "qwen2"}})
    assert cfg.perturbation.enabled is None and cfg.loss.clip_low is None
    with pytest.raises(ValueError, match="resolved config"):
        RLTrainer(cfg)
    resolved = resolve(cfg)
    assert resolved.perturbation.enabled is True and resolved.loss.clip_low == 0.2 and resolved.resolved
    assert resolve(resolved).model_dump() == resolved.model_dump()  # resolving twice changes nothing


def test_scripts_import_only_names_that_exist():
    """A benchmark runs rarely, so a name it imports from our code that has moved
    is found by this, not by a user (bench_convert once imported a removed ``build_model``)."""
    import importlib
    import importlib.util

    root = PACKAGE.parent
    ours = ("megatron_alp", "checkpoint_tools")
    siblings = {p.stem: p for p in (root / "benchmarks").glob("*.py")}
    missing = []
    for script in sorted(siblings.values()):
        for node in ast.walk(ast.parse(script.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            if node.module in siblings:  # benchmarks/ is not a package: read the sibling's top level
                tree = ast.parse(siblings[node.module].read_text())
                have = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
                have |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
                         if isinstance(t, ast.Name)}
            elif node.module.split(".")[0] in ours:
                module = importlib.import_module(node.module)
                have = {a.name for a in node.names if hasattr(module, a.name)
                        or importlib.util.find_spec(f"{node.module}.{a.name}") is not None}
            else:
                continue
            missing += [f"{script.relative_to(root)}:{node.lineno}: {node.module}.{a.name}"
                        for a in node.names if a.name not in have]
    assert not missing, "names imported that do not exist: " + ", ".join(missing)
