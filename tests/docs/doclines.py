"""The code blocks and shell lines of README.md and docs/**/*.md, in reading order, and their cheap forms.

A documented line is run by the tests either as written or in a cheap form:
the same command with the documented flags that make it small (fewer steps,
samples, repeats; a small input for a torchvision model). :func:`cheap_form`
makes that rewrite mechanically, so what runs is what the docs say plus
flags that only shrink the work. A line runs in its cheap form only when its
block says so, on the line just before it (invisible on the site):
``<!-- docs-test: cheap (why) -->``. ``<!-- docs-test: skip (why) -->`` keeps
a block from running (its optkit, make and torchrun lines must then name the
test that runs them in :data:`COVERED_ELSEWHERE`), and ``<!-- docs-test:
write FILE -->`` saves a block as FILE.

Reading order (:func:`reading_order`) is how a new user meets the pages: the
README, then the site's pages in the order of ``mkdocs.yml``'s nav.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
MARKER = re.compile(r"<!--\s*docs-test:\s*(?P<action>skip|write|cheap)\b\s*(?P<arg>.*?)\s*-->\s*$")
SKIP = re.compile(r"<!--\s*docs-test:\s*skip\b")
SHELL_LANGS = {"bash", "sh", "shell", "console"}
PROGRAMS = {"optkit", "make", "torchrun"}
SYNTHETIC_FASHION = "synthetic:256:1x28x28:10"
#: The input and classifier a torchvision model gets in a cheap run when the line names none.
SMALL_INPUT = ["--input-shape", "1,3,32,32", "--num-classes", "10"]


@dataclass(frozen=True)
class Block:
    """One fenced code block.

    Attributes:
        page: the file, relative to the repository root.
        line: the line of its opening fence.
        lang: the fence's language (``bash``, ``python``, ``toml``...).
        body: its text, dedented to the fence.
        action: its ``docs-test`` marker's action (``skip``, ``write``, ``cheap``), or ``None``.
        arg: the marker's argument (the reason, or the file name of ``write``).
    """

    page: str
    line: int
    lang: str
    body: str
    action: str | None = None
    arg: str = ""

    @property
    def is_shell(self) -> bool:
        return self.lang in SHELL_LANGS

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    def lines(self) -> list[DocLine]:
        """Its shell commands (comments dropped, continuations joined), as :class:`DocLine` s."""
        return [DocLine(self.page, self.line, command, self.action) for command in _commands(self.body)]


@dataclass(frozen=True)
class DocLine:
    """One documented command.

    Attributes:
        page: the file, relative to the repository root (``README.md``, ``docs/faq.md``).
        line: the line of the code block's opening fence.
        command: the command, comments dropped and continuations joined.
        action: its block's ``docs-test`` marker (``skip``, ``cheap``), or ``None``: run as written
            (``tests/test_docs.py`` runs every unmarked block of ``docs/``; tests/docs/test_every_line.py runs
            every line but the skipped ones, in reading order).
    """

    page: str
    line: int
    command: str
    action: str | None = None

    @property
    def skipped(self) -> bool:
        return self.action == "skip"

    @property
    def cheap(self) -> bool:
        return self.action == "cheap"

    @property
    def env(self) -> dict[str, str]:
        """The ``NAME=value`` settings the command starts with."""
        env = {}
        for word in shlex.split(self.command):
            if not re.fullmatch(r"[A-Z_]+=.*", word):
                break
            key, _, value = word.partition("=")
            env[key] = value
        return env

    @property
    def words(self) -> list[str]:
        """The command's words without leading ``NAME=value`` environment settings."""
        words = shlex.split(self.command)
        while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
            words.pop(0)
        return words

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    """README.md and every page under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def reading_order() -> list[Path]:
    """README.md, then the pages of ``mkdocs.yml``'s nav in its order, then any other page under docs/."""
    import yaml

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    docs = ROOT / config.get("docs_dir", "docs")

    def walk(entries) -> list[str]:
        found = []
        for entry in entries if isinstance(entries, list) else [entries]:
            if isinstance(entry, dict):
                for value in entry.values():
                    found += walk(value)
            elif isinstance(entry, str) and entry.endswith(".md"):
                found.append(entry)
        return found

    nav = [docs / name for name in walk(config.get("nav", []))]
    return [ROOT / "README.md", *nav, *(p for p in sorted(docs.rglob("*.md")) if p not in nav)]


def page_blocks(page: Path) -> list[Block]:
    """The fenced code blocks of a page, with the ``docs-test`` marker on the line before each."""
    text = page.read_text(encoding="utf-8")
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").splitlines()
        marker = MARKER.search(before[-1]) if before else None
        body = "\n".join(line[len(match["indent"]):] for line in match["body"].splitlines())
        found.append(Block(str(page.relative_to(ROOT)), text.count("\n", 0, match.start()) + 1, match["lang"], body,
                           marker["action"] if marker else None, marker["arg"] if marker else ""))
    return found


def blocks_in_order() -> list[Block]:
    """Every code block of README.md and docs/, in :func:`reading_order`."""
    return [block for page in reading_order() for block in page_blocks(page)]


def shell_lines() -> list[DocLine]:
    """Every command of every shell block, in :func:`reading_order`."""
    return [line for block in blocks_in_order() if block.is_shell for line in block.lines()]


def documented_lines() -> list[DocLine]:
    """Every shell line that runs ``optkit``, ``make`` or ``torchrun``, in reading order."""
    return [line for line in shell_lines() if line.words and line.words[0] in PROGRAMS]


def _commands(script: str) -> list[str]:
    joined = re.sub(r"\\\n\s*", " ", script)
    lines = (shlex.join(shlex.split(line, comments=True)) for line in joined.splitlines() if line.strip())
    return [line for line in lines if line]


def cheap_form(words: list[str], *, fashion: bool) -> list[str]:
    """``words`` (an ``optkit`` command) with the documented flags that make it quick.

    Args:
        words: the command's words, ``optkit`` first.
        fashion: whether Fashion-MNIST is installed; without it ``fashion-mnist``
            becomes synthetic images of the same shape and classes.

    Returns:
        the arguments after ``optkit``.
    """
    args = [w if fashion or w != "fashion-mnist" else SYNTHETIC_FASHION for w in words[1:]]
    command = args[0] if args else ""
    extra: list[str] = []
    if any(w.startswith("torchvision:") for w in args[1:2]) and "--input-shape" not in args:
        extra += SMALL_INPUT
    if (command == "finetune" or "--finetune" in args) and "--recipe" not in args:
        extra += ["--max-steps", "2", "--max-train-samples", "64", "--batch-size", "32", "--workers", "0"]
    if "--export" in args and "--latency" not in args:
        extra += ["--no-latency"]
    if "--eval" in args:
        extra += ["--eval-samples", "64"]
    if "--int8" in args:
        extra += ["--calibration-batches", "2", "--calib-batch-size", "8", "--int8-eval-samples", "64"]
    if command == "sensitivity":
        extra += ["--samples", "32", "--calibration-samples", "32", "--ratios", "0.5"]
    if command == "bench":
        extra += ["--warmup", "1", "--repeats", "3", "--threads", "1"]
    return args + extra


def promised_files(args: list[str]) -> list[str]:
    """The files the docs promise a command writes into its ``--out`` folder (or beside ``--onnx``).

    A Hugging Face folder's result is a ``save_pretrained`` folder (``config.json``) instead of ``model.pt``.
    """
    command = args[0]
    if command == "sensitivity":
        return ["sensitivity.json", "sensitivity.md", "sensitivity.png", "recipe.toml"]
    if command not in ("optimize", "finetune"):
        return []
    source = args[1] if len(args) > 1 else ""
    hf_folder = source.startswith("hf:") or (Path(source) / "config.json").is_file()
    files = ["config.json" if hf_folder else "model.pt", "recipe.toml", "report.json", "report.md"]
    if command == "optimize":
        files.append("channels.png")
    if "--export" in args:
        files.append("model.onnx")
    if "--int8" in args:
        files.append("model.int8.onnx")
    steps = int(option_value(args, "--iterative-steps") or 1)
    if command == "finetune" or "--finetune" in args:
        files += ["finetune.ckpt"] if steps == 1 else [f"finetune-{k}.ckpt" for k in range(1, steps + 1)]
    return files


def option_value(args: list[str], option: str) -> str | None:
    """The value after ``option`` in ``args``, or ``None``."""
    return args[args.index(option) + 1] if option in args else None


def make_variable(name: str) -> str:
    """The value of a ``NAME := ...`` variable of the Makefile, continuations joined."""
    text = re.sub(r"\\\n\s*", " ", (ROOT / "Makefile").read_text(encoding="utf-8"))
    match = re.search(rf"^{name}\s*:?=\s*(.*)$", text, re.M)
    assert match, f"the Makefile defines no {name}"
    return match[1].strip()


def demo_command() -> list[str]:
    """The optkit command ``make demo`` runs when Fashion-MNIST is installed, as words (``optkit`` first)."""
    words = shlex.split(make_variable("DEMO_TRAINED").replace("$(DEMO_MODEL)", make_variable("DEMO_MODEL")))
    assert words[0] == "$(BIN)/optkit", words
    return ["optkit", *words[1:]]


#: Documented lines another test runs (or that cannot run inside the test suite), with those tests' node ids.
#: The first id is the default run's; a second, when there is one, runs the line at full size in the slow tier.
COVERED_ELSEWHERE: dict[str, tuple[str, ...]] = {
    "make test": ("tests/docs/test_documented_commands.py::test_make_test_runs_the_test_command",),
    "optkit optimize weights.pt --arch torchvision:resnet50 --num-classes 10 --prune 0.3 --out runs/r50": (
        "tests/test_docs.py::test_code_blocks_run",  # getting-started.md: the same line with resnet18 at 64x64
        "tests/docs/test_every_line.py::test_every_line_runs_in_document_order"),
    "optkit optimize model.pt --target-macs 0.5 --allocation sensitivity --calib-data fashion-mnist --out "
    "runs/sens-pruned": (
        "tests/cli/test_sensitivity_cli.py::test_optimize_with_sensitivity_allocation_reports_it",
        "tests/docs/test_every_line.py::test_every_line_runs_in_document_order"),
    "optkit optimize model.pt --target-macs 0.5 --export onnx --int8 --calib-data fashion-mnist --out runs/int8": (
        "tests/cli/test_export_int8.py::test_optimize_export_onnx_int8_runs_and_writes_one_recipe_of_prune_export_int8",
        "tests/docs/test_every_line.py::test_every_line_runs_in_document_order"),
    "optkit optimize torchvision:fasterrcnn_mobilenet_v3_large_320_fpn --num-classes 5 --prune 0.3 --export onnx "
    "--out runs/det": ("tests/kinds/test_builtin_kinds.py::test_detection_by_name_detects_the_same_boxes_after_export",),
    "torchrun --nproc_per_node=4 -m optkit optimize model.pt --prune 0.5 --finetune imagefolder:/data/imgs --out "
    "runs/ddp": (
        "tests/passes/finetune/test_distributed.py::test_two_cpu_processes_end_with_identical_weights",
        "tests/passes/finetune/test_distributed.py::test_torchrun_prune_and_finetune_writes_once"),
    "optkit optimize optkit/demo/fashion_resnet.pt --target-latency 3ms --export onnx --deploy --calib-data "
    "fashion-mnist --out runs/budget": (
        "tests/passes/deploy/test_budget_cli.py::"
        "test_a_budget_met_unpruned_keeps_the_most_accurate_deployment_and_reports_the_frontier",),
    "optkit optimize optkit/demo/python_docs_lm --prune 0.2 --export onnx --deploy --calib-data text --eval text "
    "--out runs/lm-deploy": (
        "tests/passes/deploy/test_tokens.py::test_the_cli_deploys_a_language_model_among_its_candidates_and_reports_them",
        "tests/passes/deploy/test_tokens.py::test_the_shipped_language_model_pruned_and_deployed_among_every_candidate"),
    "torchrun --nproc_per_node 8 -m optkit optimize hf:models/llama-8b --prune 0.3 --finetune text --distill "
    "--sharding fsdp --out runs/llm-fsdp": (
        "tests/passes/finetune/test_fsdp.py::test_fsdp_distillation_on_two_processes_matches_one",
        "tests/passes/finetune/test_fsdp.py::test_torchrun_prune_and_distill_with_fsdp_writes_a_stock_folder"),
}
