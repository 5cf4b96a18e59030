"""Every option of every command in the CLI reference is given by at least one test (#31).

An option counts as exercised for a command when a test invokes that command
with it: a list or tuple in a test file holding the command's name and the
option (directly, or through a module-level list it unpacks), or a documented
line that the docs tests run. This reads the tests; it does not run them.
"""

from __future__ import annotations

import ast
from pathlib import Path

from doclines import ROOT, documented_lines
from optkit.cli import main

TESTS = ROOT / "tests"
#: Options no test was found to give when this check was written (#31): a gap to close, never to grow.
#: Some are given through fixtures or helpers the scan cannot follow; a test that names them closes the entry.
NOT_YET_EXERCISED = frozenset({
    'optkit bench --random-weights', 'optkit export --int4-scheme', 'optkit export --random-weights',
    'optkit export --weight-block-size', 'optkit finetune --random-weights', 'optkit finetune --save-pt',
    'optkit optimize --int4-scheme', 'optkit optimize --weight-block-size', 'optkit sensitivity --random-weights',
    'optkit --version', 'optkit bench --arch', 'optkit bench --kind',
    'optkit bench --seq-len', 'optkit bench --trust', 'optkit export --calib-batch-size',
    'optkit export --calibration-batches', 'optkit export --calibration-method', 'optkit export --eval',
    'optkit export --eval-batch-size', 'optkit export --eval-samples', 'optkit export --exporter',
    'optkit export --int8-eval-samples', 'optkit export --int8-exclude', 'optkit export --int8-mode',
    'optkit export --int8-op-types', 'optkit export --int8-seed', 'optkit export --int8-timing-threads',
    'optkit export --kind', 'optkit export --max-accuracy-drop', 'optkit export --max-excluded',
    'optkit export --min-agreement', 'optkit export --opset', 'optkit export --random-calibration',
    'optkit export --rtol', 'optkit export --simplify', 'optkit export --static-batch',
    'optkit export --trust', 'optkit finetune --alpha', 'optkit finetune --arch',
    'optkit finetune --checkpoint-every', 'optkit finetune --device', 'optkit finetune --eval',
    'optkit finetune --eval-batch-size', 'optkit finetune --eval-samples', 'optkit finetune --grad-clip',
    'optkit finetune --kind', 'optkit finetune --lr', 'optkit finetune --seed', 'optkit finetune --seq-len',
    'optkit finetune --temperature', 'optkit finetune --train-amp', 'optkit finetune --trust',
    'optkit finetune --warmup', 'optkit finetune --weight-decay', 'optkit inspect --all-layers',
    'optkit inspect --arch', 'optkit inspect --kind', 'optkit inspect --trust',
    'optkit optimize --batch', 'optkit optimize --calib-batch-size',
    'optkit optimize --calibration-batches', 'optkit optimize --calibration-method',
    'optkit optimize --eval-batch-size', 'optkit optimize --exporter',
    'optkit optimize --fp16',
    'optkit optimize --insert-bn', 'optkit optimize --int8-eval-samples', 'optkit optimize --int8-exclude',
    'optkit optimize --int8-mode', 'optkit optimize --int8-op-types', 'optkit optimize --int8-seed',
    'optkit optimize --int8-timing-threads', 'optkit optimize --max-accuracy-drop',
    'optkit optimize --max-excluded', 'optkit optimize --opset',
    'optkit optimize --rtol', 'optkit optimize --simplify',
    'optkit optimize --static-batch',
    'optkit optimize --trust', 'optkit sensitivity --arch',
    'optkit sensitivity --as-pruned-weight', 'optkit sensitivity --eval-batch-size',
    'optkit sensitivity --importance', 'optkit sensitivity --input-shape', 'optkit sensitivity --kind',
    'optkit sensitivity --metric', 'optkit sensitivity --num-classes', 'optkit sensitivity --seq-len',
    'optkit sensitivity --time-budget', 'optkit sensitivity --trust',
})
#: Options every click command has; they are exercised by the CLI reference's own test (`--help` per command).
UNIVERSAL = {"--help", "-h"}


def reference() -> dict[str, set[str]]:
    """``{command: {option, ...}}`` as `optkit COMMAND --help` lists them."""
    options = {name: {opt for param in main.get_command(None, name).params for opt in getattr(param, "opts", [])
                      + getattr(param, "secondary_opts", []) if opt.startswith("-")}
               for name in main.list_commands(None)}
    options[""] = {opt for param in main.params for opt in param.opts + param.secondary_opts if opt.startswith("-")}
    return options


def _strings(node: ast.AST, constants: dict[str, list[str]]) -> list[str]:
    """The string words a list/tuple literal holds, with module-level lists it unpacks (``*QUICK``) expanded."""
    words: list[str] = []
    for item in getattr(node, "elts", []):
        if isinstance(item, ast.Constant) and isinstance(item.value, str):
            words += item.value.split() if item.value.startswith("--") else [item.value]
        elif isinstance(item, ast.Starred) and isinstance(item.value, ast.Name):
            words += constants.get(item.value.id, [])
    return [w.split("=")[0] if w.startswith("--") else w for w in words]


def _module_constants(tree: ast.Module) -> dict[str, list[str]]:
    constants = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, (ast.List, ast.Tuple)):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    constants[target.id] = _strings(node.value, {})
    return constants


def exercised_by_tests(commands: set[str]) -> dict[str, set[str]]:
    """Options the tests give each command: per test function (or helper), the options in it go to the commands
    it invokes (a list starting with the command's name, or a call of a helper named after it, ``_optimize(...)``)."""
    found: dict[str, set[str]] = {name: set() for name in commands}
    for path in TESTS.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        constants = _module_constants(tree)
        for function in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
            named, options = set(), set()
            for node in ast.walk(function):
                if isinstance(node, (ast.List, ast.Tuple)):
                    words = _strings(node, constants)
                    named |= {w for w in words[:1] if w in found}
                    options |= {w for w in words if w.startswith("--")}
                elif isinstance(node, ast.Call):
                    called = getattr(node.func, "id", getattr(node.func, "attr", ""))
                    named |= {name for name in found if name and name in called.lower()}
                    options |= {w for w in _strings(ast.Tuple(elts=node.args), constants) if w.startswith("--")}
            if options & {"--debug", "--version"} and "" in found:
                named.add("")
            for name in named:
                found[name] |= options
    return found


def exercised_by_docs(commands: set[str]) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {name: set() for name in commands}
    for line in documented_lines():
        words = line.words
        if words[0] == "optkit" and len(words) > 1 and words[1] in found:
            found[words[1]] |= {w.split("=")[0] for w in words[2:] if w.startswith("-")}
    return found


def unexercised() -> set[str]:
    options = reference()
    by_tests, by_docs = exercised_by_tests(set(options)), exercised_by_docs(set(options))
    return {f"optkit {name} {option}".replace("  ", " ")
            for name, opts in options.items() for option in opts - UNIVERSAL
            if option not in by_tests[name] | by_docs[name]}


def test_every_option_of_the_cli_reference_is_exercised_by_a_test():
    """New options come with a test; the known gaps (:data:`NOT_YET_EXERCISED`) only shrink."""
    missing = unexercised()
    new = sorted(missing - NOT_YET_EXERCISED)
    assert not new, "options of the CLI reference that no test gives:\n" + "\n".join(new)
    covered = sorted(NOT_YET_EXERCISED - missing)
    assert not covered, "a test now gives these; remove them from NOT_YET_EXERCISED:\n" + "\n".join(covered)


def test_the_scan_sees_a_known_invocation():
    """The scan is not vacuous: it finds options that tests/cli/test_sensitivity_cli.py gives through `*QUICK`."""
    found = exercised_by_tests({"sensitivity"})
    assert {"--samples", "--ratios", "--target-macs", "--data"} <= found["sensitivity"]
    assert Path(TESTS / "cli" / "test_sensitivity_cli.py").is_file()
