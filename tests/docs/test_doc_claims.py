"""What the docs say about the tool is what the tool does (#31): checked against the tool, not the prose."""

from __future__ import annotations

import re

from click.testing import CliRunner

from doclines import ROOT
from optkit.cli import main

DOCS = ROOT / "docs"
NUMBERS = {2: "two", 3: "three", 4: "four", 5: "five"}


def flat(path) -> str:
    return " ".join(path.read_text(encoding="utf-8").split())


def test_a_pass_pattern_example_names_the_passes_it_lists():
    """concepts.md's `optkit passes "*prune*"` lists structured_prune only; its comment must say which."""
    page = (DOCS / "concepts.md").read_text(encoding="utf-8")
    match = re.search(r'^optkit passes "(?P<pattern>[^"]+)"\s*#\s*(?P<comment>.+)$', page, re.M)
    assert match, "concepts.md: the `optkit passes PATTERN` example should say in a comment which passes it lists"
    result = CliRunner().invoke(main, ["passes", match["pattern"]], catch_exceptions=False)
    listed = [line.split()[0] for line in result.output.splitlines() if line.strip()]
    named = re.findall(r"\b[a-z0-9]+(?:_[a-z0-9]+)+\b", match["comment"].split(":")[0])
    assert named == listed, f"the comment names {named}; `optkit passes {match['pattern']}` lists {listed}"


def test_the_sensitivity_search_is_described_with_the_spreads_it_tries():
    from optkit.passes.prune.targets.sensitivity import SPREADS

    text = flat(DOCS / "techniques" / "pruning.md")
    assert f"tries {NUMBERS[len(SPREADS)]} spreads" in text
    assert "scored once" in text, "pruning.md should say that spreads giving the same allocation are compared once"


def test_the_readme_says_model_pt_is_the_users_own_file():
    text = flat(ROOT / "README.md")
    assert "`model.pt` in these examples stands for your own trained model" in text
    assert "cp optkit/demo/fashion_resnet.pt model.pt" in text


def test_getting_started_describes_the_trained_demo():
    text = flat(DOCS / "getting-started.md")
    assert "optkit/demo/fashion_resnet.pt" in text and "fine-tunes one epoch" in text
    assert "`finetune.ckpt`" in text, "the demo also leaves its fine-tune checkpoint in runs/demo"


def test_the_documented_rounding_of_a_ratio_matches_the_shipped_model(tmp_path):
    """pruning.md: `--prune 0.3` on the shipped model keeps 16 of 32 and 32 of 64 channels, MACs about 0.30."""
    import json

    text = flat(DOCS / "techniques" / "pruning.md")
    assert "keep 16 and 32 of them at `--prune 0.3`" in text and "MACs fall to 0.30" in text
    out = tmp_path / "p"
    result = CliRunner().invoke(main, ["optimize", str(ROOT / "optkit" / "demo" / "fashion_resnet.pt"),
                                       "--prune", "0.3", "--out", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    widths = {row["before"]: row["after"] for row in report["layers"] if row["before"] in (32, 64)}
    assert widths == {32: 16, 64: 32}
    assert round(report["ratios"]["macs"], 2) == 0.30
    assert any("not the 30% asked" in note for note in report["notes"])


def test_the_readme_quotes_the_committed_recovery_figures():
    """README's sentence on recovery is accuracy.md's uniform 2x row (#42: it said 92.11% where the file has 92.13%)."""
    import json

    results = json.loads((ROOT / "benchmarks" / "results" / "accuracy.json").read_text())
    row = next(r for r in results["rows"] if r["config"] == "structured 2x fewer MACs, uniform")
    macs = row["macs"] / results["baseline"]["macs"]
    sentence = (f"a {results['baseline']['test_accuracy']:.2%} baseline pruned to {macs:.2f}× its MACs is back to "
                f"{row['finetuned']:.2%} after 2 fine-tune epochs")
    assert sentence in flat(ROOT / "README.md")


def test_the_language_model_page_counts_the_test_blocks_the_results_count():
    import json

    blocks = json.loads((ROOT / "benchmarks" / "results" / "llm.json").read_text())["blocks"]["test"]
    assert f"on all {blocks:,} test blocks" in flat(DOCS / "techniques" / "language-models.md")


def test_a_sensitivity_rerun_is_described_as_it_behaves():
    """A rerun into the same --out is refused without --force (as for every command); the cache makes it measure
    nothing again, and the figures quoted are the benchmark's."""
    import json

    measured = json.loads((ROOT / "benchmarks" / "results" / "sensitivity-resnet18.json").read_text())
    for page in (ROOT / "README.md", DOCS / "techniques" / "pruning.md"):
        text = flat(page)
        assert "a rerun is instant" not in text, page
        quoted = f"{measured['cached_seconds']:.0f} s instead of {measured['cold_seconds']:.0f} s"
        assert "`--force`" in text and quoted in text, page
