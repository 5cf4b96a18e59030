"""The docs: every code block runs, the CLI reference is current, and the site builds with --strict.

Code blocks in ``docs/**/*.md`` run page by page, in order, in a fresh
temporary folder (so later blocks see the files earlier ones wrote):

* ``python`` blocks are executed (one namespace per page);
* ``bash`` blocks run line by line: ``optkit ...`` through click's CliRunner
  (in-process, so it is quick), ``python ...`` with this interpreter, and a
  few plain shell commands (``ls``, ``cat``, ``head``, ``mkdir``);
* ``toml`` blocks that hold ``[[pass]]`` tables are parsed as recipes.

HTML comments (invisible on the site), on the line just before a block,
change that: ``<!-- docs-test: skip (why) -->`` (not run; the reason is
required), ``<!-- docs-test: write FILE -->`` (saved as FILE instead of run)
and ``<!-- docs-test: cheap (why) -->`` (a block too long to run as written:
not run here; tests/docs/test_every_line.py runs its lines in their cheap
forms, in document order with every other documented line).
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
MARKER = re.compile(r"<!--\s*docs-test:\s*(?P<action>skip|write|cheap)\b\s*(?P<arg>.*?)\s*-->\s*$")
SHELL_COMMANDS = {"ls", "cat", "head", "mkdir"}


@dataclass
class Block:
    lang: str
    body: str
    line: int
    action: str | None
    arg: str


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of a page, with the docs-test marker before each."""
    text = page.read_text(encoding="utf-8")
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").splitlines()
        marker = MARKER.search(before[-1]) if before else None
        body = "\n".join(line[len(match["indent"]):] for line in match["body"].splitlines())
        found.append(Block(match["lang"], body, text.count("\n", 0, match.start()) + 1,
                           marker["action"] if marker else None, marker["arg"] if marker else ""))
    return found


def pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def page_id(page: Path) -> str:
    return str(page.relative_to(DOCS))


def commands(script: str) -> list[str]:
    """The commands of a bash block: comments dropped, backslash continuations joined."""
    joined = re.sub(r"\\\n\s*", " ", script)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def run_command(command: str, where: str) -> None:
    words = shlex.split(command, comments=True)
    env = {}
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    if words[0] == "optkit":
        from optkit.cli import main

        result = CliRunner(env=env).invoke(main, words[1:], catch_exceptions=False)
        assert result.exit_code == 0, f"{where}: `{command}` exited {result.exit_code}:\n{result.output}"
        return
    if words[0] == "python":
        words[0] = sys.executable
    elif words[0] not in SHELL_COMMANDS:
        pytest.fail(f"{where}: `{command}` is not a command the docs tests run; "
                    "mark the block <!-- docs-test: skip (why) --> or use optkit/python")
    completed = subprocess.run(words, capture_output=True, text=True, env=_env(env), timeout=300)
    assert completed.returncode == 0, f"{where}: `{command}` failed:\n{completed.stdout}{completed.stderr}"


def _env(extra: dict[str, str]) -> dict[str, str]:
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), ".", env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


RUNNABLE = [p for p in pages() if any(b.action not in ("skip", "cheap") and b.lang in ("python", "bash", "toml")
                                      for b in blocks(p))]


#: Pages whose examples take most of a minute (timed deployments, exports of several models): the slow tier runs them.
SLOW_PAGES = ("techniques/deployment.md", "techniques/export.md")


@pytest.mark.parametrize("page", [pytest.param(p, marks=pytest.mark.slow) if page_id(p) in SLOW_PAGES else p
                                  for p in RUNNABLE], ids=page_id)
def test_code_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    # A real module, so classes defined in the examples (dataclasses too) know where they live.
    module = types.ModuleType("docs_example_" + re.sub(r"\W", "_", page_id(page)))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    namespace = module.__dict__
    for block in blocks(page):
        where = f"{page_id(page)}:{block.line}"
        if block.action in ("skip", "cheap"):
            continue
        if block.action == "write":
            assert block.arg, f"{where}: docs-test: write needs a file name"
            Path(block.arg).parent.mkdir(parents=True, exist_ok=True)
            Path(block.arg).write_text(block.body + "\n", encoding="utf-8")
        elif block.lang == "python":
            exec(compile(block.body, where, "exec"), namespace)
        elif block.lang == "bash":
            for command in commands(block.body):
                run_command(command, where)
        elif block.lang == "toml" and "[[pass]]" in block.body:
            from optkit.core.pipeline import Pipeline

            Pipeline.from_toml(block.body, source=where)


def test_blocks_are_parsed_and_markers_are_known():
    for page in pages():
        text = page.read_text(encoding="utf-8")
        assert text.count("```") == 2 * len(blocks(page)), f"{page_id(page)}: unbalanced or unparsed code fence"
        for line in text.splitlines():
            if "docs-test" in line:
                marker = MARKER.search(line)
                assert marker, f"{page_id(page)}: unknown docs-test marker {line.strip()!r}"
                assert marker["arg"], (f"{page_id(page)}: {line.strip()!r} needs a reason (skip, cheap) or a file "
                                       "name (write)")


def test_cli_reference_is_current():
    spec = importlib.util.spec_from_file_location("gen_cli", DOCS / "gen_cli.py")
    gen_cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_cli)
    committed = (DOCS / "cli.md").read_text(encoding="utf-8")
    assert committed == gen_cli.generate(), "docs/cli.md is out of date: run `python docs/gen_cli.py`"


def cli_commands() -> list[list[str]]:
    from optkit.cli import main

    return [[]] + [[name] for name in main.list_commands(None)]


@pytest.mark.parametrize("command", cli_commands(), ids=lambda c: " ".join(["optkit", *c]))
def test_cli_reference_matches_help_output(command, capsys, monkeypatch):
    from optkit.cli import main

    # What `optkit ... --help` prints in an 80-column terminal (CliRunner would force its own width).
    monkeypatch.setenv("COLUMNS", "80")
    assert main.main([*command, "--help"], prog_name="optkit", standalone_mode=False) == 0
    assert f"```text\n{capsys.readouterr().out}```" in (DOCS / "cli.md").read_text(encoding="utf-8")


def test_quoted_results_files_exist():
    for page in pages():
        for path in re.findall(r"benchmarks/results/[\w./-]+\w", page.read_text(encoding="utf-8")):
            assert (ROOT / path).is_file(), f"{page_id(page)} quotes {path}, which is not committed"


def test_site_builds_strict(tmp_path):
    completed = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                                "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    assert (tmp_path / "site" / "index.html").is_file()


# Options the prose names as "`--option` of `optkit COMMAND`": each must be an option of that command.
PROSE_OPTION = re.compile(r"`(?P<option>--[\w-]+)[^`]*` of `optkit (?P<command>[\w-]+)`")


def test_options_named_in_the_prose_exist():
    from optkit.cli import main

    found = []
    for page in pages():
        text = re.sub(r"\s+", " ", FENCE.sub("", page.read_text(encoding="utf-8")))
        for match in PROSE_OPTION.finditer(text):
            command = main.get_command(None, match["command"])
            assert command is not None, f"{page_id(page)} names `optkit {match['command']}`, which does not exist"
            options = {opt for param in command.params for opt in getattr(param, "opts", [])}
            assert match["option"] in options, (f"{page_id(page)}: `{match['option']}` is not an option of "
                                                f"`optkit {match['command']}` ({', '.join(sorted(options))})")
            found.append(match.group(0))
    assert "`--train-amp` of `optkit finetune`" in found


def test_getting_started_quotes_what_inspect_prints():
    from optkit.cli import main

    page = (DOCS / "getting-started.md").read_text(encoding="utf-8")
    command = "optkit inspect torchvision:resnet18 --num-classes 10 --input-shape 1,3,64,64"
    assert command in page
    result = CliRunner().invoke(main, shlex.split(command)[1:], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    summary = [line.strip() for line in result.output.splitlines() if "structured prune" in line.lower()]
    assert summary, f"`{command}` no longer says which layers a structured prune leaves alone:\n{result.output}"
    prose = re.sub(r"\s+", " ", page)
    assert all(f"`{line}`" in prose for line in summary), f"getting-started.md should quote {summary}"
