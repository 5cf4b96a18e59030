"""The shell lines of README.md and docs/**/*.md that run optkit, make or torchrun, and their cheap forms.

A documented line is run by the tests either as written or in a cheap form:
the same command with the documented flags that make it small (fewer steps,
samples, repeats; a small input for a torchvision model). :func:`cheap_form`
makes that rewrite mechanically, so what runs is what the docs say plus
flags that only shrink the work.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
SKIP = re.compile(r"<!--\s*docs-test:\s*skip\b")
SHELL_LANGS = {"bash", "sh", "shell", "console"}
PROGRAMS = {"optkit", "make", "torchrun"}
SYNTHETIC_FASHION = "synthetic:256:1x28x28:10"
#: The input and classifier a torchvision model gets in a cheap run when the line names none.
SMALL_INPUT = ["--input-shape", "1,3,32,32", "--num-classes", "10"]


@dataclass(frozen=True)
class DocLine:
    """One documented command.

    Attributes:
        page: the file, relative to the repository root (``README.md``, ``docs/faq.md``).
        line: the line of the code block's opening fence.
        command: the command, comments dropped and continuations joined.
        skipped: whether its block carries a ``<!-- docs-test: skip (...) -->`` marker
            (``tests/test_docs.py`` runs every other block of ``docs/``).
    """

    page: str
    line: int
    command: str
    skipped: bool

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


def documented_lines() -> list[DocLine]:
    """Every shell line of :func:`pages` that runs ``optkit``, ``make`` or ``torchrun``, in page order."""
    found = []
    for page in pages():
        text = page.read_text(encoding="utf-8")
        for block in FENCE.finditer(text):
            if block["lang"] not in SHELL_LANGS:
                continue
            before = text[: block.start()].rstrip("\n").splitlines()
            skipped = bool(before and SKIP.search(before[-1]))
            start = text.count("\n", 0, block.start()) + 1
            for command in _commands(block["body"]):
                line = DocLine(str(page.relative_to(ROOT)), start, command, skipped)
                if line.words and line.words[0] in PROGRAMS:
                    found.append(line)
    return found


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
    """The files the docs promise a command writes into its ``--out`` folder (or beside ``--onnx``)."""
    command = args[0]
    if command == "sensitivity":
        return ["sensitivity.json", "sensitivity.md", "sensitivity.png", "recipe.toml"]
    if command not in ("optimize", "finetune"):
        return []
    files = ["model.pt", "recipe.toml", "report.json", "report.md"]
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
        "tests/docs/test_readme_commands.py::test_readme_line_runs_as_written"),
    "optkit optimize model.pt --target-macs 0.5 --allocation sensitivity --calib-data fashion-mnist --out "
    "runs/sens-pruned": (
        "tests/cli/test_sensitivity_cli.py::test_optimize_with_sensitivity_allocation_reports_it",
        "tests/docs/test_readme_commands.py::test_readme_line_runs_as_written"),
    "optkit optimize model.pt --target-macs 0.5 --export onnx --int8 --calib-data fashion-mnist --out runs/int8": (
        "tests/cli/test_export_int8.py::test_optimize_export_onnx_int8_runs_and_writes_one_recipe_of_prune_export_int8",
        "tests/docs/test_readme_commands.py::test_readme_line_runs_as_written"),
    "optkit optimize torchvision:fasterrcnn_mobilenet_v3_large_320_fpn --num-classes 5 --prune 0.3 --export onnx "
    "--out runs/det": ("tests/kinds/test_builtin_kinds.py::test_detection_by_name_detects_the_same_boxes_after_export",),
    "optkit optimize hf:models/tiny-llama --prune 0.3 --drop-blocks 1 --seq-len 128 --export onnx --out runs/llm": (
        "tests/io/test_hf_folder.py::test_optimize_writes_a_folder_the_stock_class_loads",),
    "optkit optimize lm.pt --arch my_package.models:MyLM --seq-len 128 --prune 0.3 --out runs/lm": (
        "tests/kinds/test_inference_and_cli.py::test_optimize_prunes_a_token_model_given_as_state_dict_and_arch",),
    "torchrun --nproc_per_node=4 -m optkit optimize model.pt --prune 0.5 --finetune imagefolder:/data/imgs --out "
    "runs/ddp": (
        "tests/passes/finetune/test_distributed.py::test_two_cpu_processes_end_with_identical_weights",
        "tests/passes/finetune/test_distributed.py::test_torchrun_prune_and_finetune_writes_once"),
    "torchrun --nproc_per_node 8 -m optkit optimize hf:models/llama-8b --prune 0.3 --finetune text --distill "
    "--sharding fsdp --out runs/llm-fsdp": (
        "tests/passes/finetune/test_fsdp.py::test_fsdp_distillation_on_two_processes_matches_one",
        "tests/passes/finetune/test_fsdp.py::test_torchrun_prune_and_distill_with_fsdp_writes_a_stock_folder"),
}
