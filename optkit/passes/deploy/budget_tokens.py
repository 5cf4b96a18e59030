"""A language model's side of a latency budget: its candidates built with their decode graphs, timed by the decode
step, scored by validation perplexity (see :class:`optkit.passes.deploy.search.Deployer`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optkit.core.errors import OptkitError
from optkit.passes.deploy.candidate import Candidate

if TYPE_CHECKING:
    from torch import nn

    from optkit.passes.deploy.settings import DeploySettings


class TokenDeployer:
    """Builds, times and scores a language model's candidates.

    Each model is exported with its decode graph to its own folder of ``scratch`` and built there as ``deploy``
    builds it (:class:`optkit.passes.deploy.tokens.TokenCandidates`: checked by validation perplexity on the
    ``--calib-data`` text against its precision's limit); timing runs the decode graphs in turns with the
    unpruned FP32 one (:func:`optkit.passes.deploy.tokens.decode_timer`, ms per step at the settings' batch and
    threads); the score is the candidate's validation perplexity from its check (lower is better).

    Raises:
        OptkitError: for a model whose decode step cannot be exported (its budget is a decode speed).
    """

    metric = "perplexity"

    def __init__(self, settings: DeploySettings, model: nn.Module, shape: tuple[int, ...], threads: int,
                 scratch: Path):
        from optkit.export import decode
        from optkit.kinds.tokens import max_positions

        if (why := decode.unsupported(model)) is not None:
            raise OptkitError(f"a language model's latency budget is a decode speed, but its decode step cannot be "
                              f"exported ({why})")
        self.settings, self.shape, self.threads, self.scratch = settings, shape, threads, scratch
        self.model, self.tries = model, 0
        positions = max_positions(model) or decode.PROMPT_TOKENS + decode.DECODE_STEPS
        self.prompt = max(1, min(decode.PROMPT_TOKENS, positions - decode.DECODE_STEPS))
        self.unpruned = self._export(model, "unpruned")

    def _export(self, model: nn.Module, name: str) -> Path:
        from optkit.export import decode
        from optkit.export.onnx import export_onnx

        folder = self.scratch / name
        folder.mkdir()
        export_onnx(model, folder / "model.onnx", self.shape)
        decode.export_decode(model, decode.decode_path(folder / "model.onnx"))
        return folder / "model.onnx"

    def build(self, name: str, model: nn.Module | None) -> Candidate:
        from optkit.passes.deploy.choose import build_token_candidate
        from optkit.passes.deploy.tokens import TokenCandidates

        if model is None:
            source, model = self.unpruned, self.model
        else:
            self.tries += 1
            source = self._export(model, f"try{self.tries}")
        folder = source.parent / name
        folder.mkdir(exist_ok=True)
        builder = TokenCandidates(source, folder, self.settings, self.shape, model)
        candidate = build_token_candidate(name, builder)
        if candidate.status == "verified" and candidate.check.get("perplexity") is None:
            # The FP32 file is the check's reference: its perplexity is the check's own.
            candidate.check["perplexity"] = builder.check("fp32").base.get("perplexity")
        return candidate

    def time(self, candidates: Sequence[Candidate]) -> tuple[float, list[float]]:
        from optkit.export import decode
        from optkit.passes.deploy import tokens

        baseline = decode.decode_path(self.unpruned)
        # The unpruned ONNX Runtime FP32 candidate's decode graph is the baseline's own: timed once, as the baseline.
        others = [c for c in candidates if not (c.runtime == "onnxruntime" and Path(c.decode_built) == baseline)]
        speeds = tokens.decode_timer([baseline, *(c.decode_built for c in others)], prompt_tokens=self.prompt,
                                     threads=self.threads, batch=self.settings.batch)
        by_candidate = dict(zip(map(id, others), speeds[1:]))
        return speeds[0]["median_ms"], [by_candidate.get(id(c), speeds[0])["median_ms"] for c in candidates]

    def baseline_alone(self) -> float:
        from optkit.analysis.fresh import call_fresh
        from optkit.export import decode

        return call_fresh("optkit.passes.deploy.tokens:decode_median_ms", path=str(decode.decode_path(self.unpruned)),
                          prompt_tokens=self.prompt, threads=self.threads, batch=self.settings.batch)

    def score(self, candidate: Candidate, samples: int) -> dict[str, Any]:
        perplexity = candidate.check.get("perplexity")
        if perplexity is None:
            raise OptkitError(f"{candidate.label} has no validation perplexity to be scored by: give --calib-data "
                              "text (or text:FILE|DIR)")
        return {"perplexity": perplexity}
