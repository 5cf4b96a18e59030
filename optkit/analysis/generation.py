"""A causal language model's report section on generating text: decode speed and a greedy sample, before and after.

Decode is what a user of a language model waits for: after a prompt, one token
per call, each reading the cache of all earlier tokens. The section times it at
batch 1 with every core in PyTorch (the model's own cache) and, when the run
exported, in ONNX Runtime (the decode-step graphs of the original and the
result, which the caller builds with :func:`optkit.export.decode.export_decode`),
and shows the same greedy continuation of one prompt from both models, so a
reader sees what pruning did to the text.

The PyTorch timings before and after are taken minutes apart (before and
after the passes), so each records the load average around it and the
spread of its steps (:class:`optkit.analysis.latency.Conditions`); a timing
taken on a loaded machine is retried once, and if still loaded (or noisy) its
line says so instead of presenting the figures as a result.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optkit.analysis.latency import measured_steadily, timing_flag

if TYPE_CHECKING:
    from torch import nn

#: Tokens generated for the sample, and the prompt's length when it comes from the evaluation text.
SAMPLE_TOKENS = 20
PROMPT_TOKENS = 8


@dataclass
class GenerationProbe:
    """Measures a causal LM before the passes (:meth:`start`) and the result after them (:meth:`finish`).

    Attributes:
        prompt: the prompt's token ids.
        tokenizer: the model's tokenizer, or ``None`` (the sample is then ids).
        before: PyTorch decode speed and the greedy sample of the original.
        original_decode: the original's decode-step graph, when the run exports.
    """

    prompt: list[int]
    tokenizer: Any
    before: dict[str, Any]
    original_decode: Path | None = None
    notes: list[str] = field(default_factory=list)

    @classmethod
    def start(cls, model: nn.Module, *, tokenizer: Any, prompt: list[int] | None) -> GenerationProbe | None:
        """Measure ``model`` before the passes; ``None`` for a model that does not generate.

        A run that exports ONNX builds the original's decode graph and sets :attr:`original_decode`
        (or adds a note saying why there is none).

        Args:
            model: the model as loaded.
            tokenizer: its tokenizer, or ``None``.
            prompt: the prompt's ids (default: the tokenizer's beginning-of-text token, or id 0).
        """
        from optkit.export import decode

        if decode.unsupported(model) is not None:
            return None
        if not prompt:
            start = getattr(tokenizer, "bos_token_id", None)
            start = start if start is not None else getattr(tokenizer, "eos_token_id", None)
            prompt = [start if start is not None else 0]
        return cls(list(prompt), tokenizer, _measure(model, prompt))

    def finish(self, model: nn.Module, result_decode: Path | None) -> dict[str, Any]:
        """The report's ``generation`` section, measuring the result ``model`` and its decode graph."""
        from optkit.export import decode

        after = _measure(model, self.prompt)
        section: dict[str, Any] = {
            "prompt": self._text(self.prompt), "prompt_ids": self.prompt, "sample_tokens": SAMPLE_TOKENS,
            "before": self._sample(self.before), "after": self._sample(after),
            "pytorch": _pair(self.before["speed"], after["speed"]),
            "decode_prompt_tokens": decode.PROMPT_TOKENS, "notes": list(self.notes)}
        if self.original_decode is not None and result_decode is not None:
            (fp32_before, fp32_after), conditions = measured_steadily(
                lambda: decode.onnx_decode_speed([self.original_decode, result_decode]), threads=None,
                spreads=lambda speeds: [_spread(s) for s in speeds], retries=1)
            for speed in (fp32_before, fp32_after):
                speed["conditions"] = conditions.to_dict()
            section["onnxruntime"] = _pair(fp32_before, fp32_after)
            onnx_ids = decode.generate_onnx(result_decode, self.prompt, SAMPLE_TOKENS)
            section["after_onnx_matches"] = onnx_ids == after["ids"]
        section["load_avg_1min"] = round(os.getloadavg()[0], 2)
        return section

    def _sample(self, measured: dict[str, Any]) -> dict[str, Any]:
        return {"ids": measured["ids"], "text": self._text(measured["ids"])}

    def _text(self, ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(ids)


def _measure(model: nn.Module, prompt: list[int]) -> dict[str, Any]:
    """PyTorch decode speed (retried once when taken under load, with its conditions) and the greedy
    continuation of ``prompt``."""
    import torch

    from optkit.export import decode

    ids = decode.generate_torch(model, prompt, SAMPLE_TOKENS)  # also the timing's warm-up
    speed, conditions = measured_steadily(lambda: decode.torch_decode_speed(model, warmup=False),
                                          threads=torch.get_num_threads(), spreads=lambda s: [_spread(s)], retries=1)
    speed["conditions"] = conditions.to_dict()
    return {"speed": speed, "ids": ids}


def _spread(speed: dict[str, Any]) -> float:
    return speed["p90_ms"] / speed["median_ms"] if speed["median_ms"] else 1.0


def _pair(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    pair = {"before": before, "after": after,
            "speedup": round(before["median_ms"] / after["median_ms"], 3) if after["median_ms"] else None}
    flag = timing_flag(before, after)
    if flag:
        pair["not_a_result"] = flag
    return pair


def generation_lines(section: dict[str, Any]) -> list[str]:
    """The section in words: decode speed per runtime and the two samples."""
    lines = []
    for runtime, label in (("pytorch", "PyTorch"), ("onnxruntime", "ONNX Runtime")):
        pair = section.get(runtime)
        if pair:
            figures = f"{pair['before']['tokens_per_s']:,.0f} -> {pair['after']['tokens_per_s']:,.0f} tokens/s"
            flag = pair.get("not_a_result") or timing_flag(pair["before"], pair["after"])
            lines.append(f"decode with a KV cache after {section['decode_prompt_tokens']} prompt tokens, batch 1, "
                         f"{pair['before']['threads']} thread(s), {label}: "
                         + (f"{flag} ({figures})" if flag else f"{figures} ({pair['speedup']:.2f}x)"))
    prompt = section["prompt"] if section["prompt"] is not None else section["prompt_ids"]
    for stage in ("before", "after"):
        sample = section[stage]["text"] if section[stage]["text"] is not None else section[stage]["ids"]
        lines.append(f"greedy {section['sample_tokens']} tokens {stage}: {prompt!r} -> {sample!r}")
    if section.get("after_onnx_matches") is False:
        lines.append("the decode graph's greedy tokens differ from PyTorch's after the passes (rounding in a near tie)")
    return lines + section["notes"]
