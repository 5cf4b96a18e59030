"""The joint search: for a latency budget, the least pruning that meets it in each deployment, then the most accurate.

Every candidate deployment (:data:`optkit.passes.deploy.settings.CANDIDATES`) is
built and checked on the unpruned model, and those that pass are timed together
with the unpruned model's ONNX Runtime FP32 file. A candidate already within the
budget needs no pruning. For the others, the aim is the budget over the
candidate's own unpruned latency; the pruner (the latency-target engine,
:mod:`optkit.passes.prune.targets.latency`) prunes a copy to that fraction of
its ONNX Runtime FP32 latency, the candidate is built from it and timed in its
own runtime and precision, and the aim is corrected by what was measured, for at
most :data:`CORRECTIONS` more rounds: down when the try missed the budget, up
(less pruning) when it met it with more than :data:`SLACK` to spare; the next aim
is interpolated between the tries closest to the budget on either side (the
unpruned model is the try at aim 1.0), else extrapolated from the closest try along
the line to the try farthest from it. Every
round's tries are timed in one interleaved run with the unpruned FP32 file and
each deployment's unpruned build (those that missed the budget once more, in a
second run, the faster time counting: one reading slowed by a burst of load
would bound every later aim). Each time is rescaled by its deployment's unpruned
build in the same run, whose own time is the median of its readings in every run
so far, each rescaled by the FP32 file's time in that run against its time alone
in a fresh process (the median of :data:`BASELINE_READINGS` readings, at the start;
see :meth:`_Search.timed`). So load
that comes and goes between runs does not move a candidate's figures, nor does
how fast one runtime runs against another in one run, nor the state of the
process that searches (see :mod:`optkit.analysis.fresh`: a file runs slower in
it than where it is deployed, which matters for a budget in milliseconds or
tokens/s). Because the
time is measured in the deployment itself, channel cuts that do not pay there
(depthwise blocks in a runtime that runs them slowly) show as a smaller
measured speed-up and are corrected away, never taken on a prediction.

Of each candidate's tries that meet the budget, the least pruned one (most MACs)
is timed once more, all of them in one interleaved run (rescaled the same way),
and keeps its place only if it meets the budget again (a confirming time over it
is read once more, at once, the faster counting: two of three times decide); else the candidate's next
least pruned try that met it is confirmed the same way; a deployment left with
none, or only with tries more pruned than the aim its slower times point to,
gets one more round at that aim, and so does one whose confirmed try leaves more
than :data:`SLACK` of the budget unspent when the rounds ran out. A ~1 ms model's
time moves 15–20 % between timing runs on a small machine, so a try that met the
budget once by luck would otherwise be chosen and then miss it when deployed; and
one try timed far off its aim bends the line the next aim is read from, so the
rounds can end on a try pruned much more than the budget needs.
The confirmed try is its point on the frontier; every such point is scored on the first
:data:`SCORE_SAMPLES` images of the ``val`` split of the data given (accuracy for images), and the most
accurate is chosen (the faster one on a tie). Points whose accuracy is within sampling noise of the best one's
(:func:`within_noise_of`) are scored again on :data:`~optkit.passes.quantize.verify.SECOND_LOOK_FACTOR` times
the images, and those scores alone decide between them: 1000 images cannot tell 66 % from 65 % (one standard
error is 1.5 points), and the best of several noisy scores is the most likely to be optimistic. A budget no
candidate reaches is an error naming the fastest latency any try reached.

The work that touches models and runtimes is a :class:`Deployer` (build, time,
score) and a pruner; tests give their own.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple, Protocol

from optkit.core.errors import OptkitError
from optkit.core.progress import progress
from optkit.passes.deploy.candidate import Candidate
from optkit.passes.quantize.verify import NOISE_SE, SECOND_LOOK_FACTOR

#: A try measured at most this much over the budget meets it (two timings of one model differ by about as much).
MEET_TOLERANCE = 0.02
#: Rounds after the first in which a candidate's aim is corrected by its measured latency.
CORRECTIONS = 2
#: A try that meets the budget with more than this fraction to spare is tried again with less pruning.
SLACK = 0.08
#: Aim a little under the budget, so that the measured latency lands within it.
AIM_MARGIN = 0.97
#: Aims (latency fractions of a candidate's unpruned latency) outside these bounds are not tried: below, the
#: model would lose most of its channels; above, the engine has nothing to remove.
MIN_AIM, MAX_AIM = 0.1, 0.98
#: Aims are rounded down to multiples of this, so candidates of about the same speed share a pruned model (the
#: latency-target engine's search is the costly part).
AIM_STEP = 0.02
#: An FP32 deployment this much slower unpruned than another runtime's FP32 is not searched (see
#: :func:`_same_math_faster`).
DOMINATED = 0.10
#: Fresh-process readings of the unpruned FP32 file at the start; their median scales every time. One reading
#: of 20 calls moved 0.135–0.231 ms (the shipped Fashion-MNIST model) and 6.6–10.7 ms (efficientnet_b0) within
#: minutes on a 2-CPU VM, and for a budget in milliseconds it scales every try.
BASELINE_READINGS = 3
#: The progress lines' stage.
STAGE = "latency budget"
#: Validation images each candidate on the frontier is scored on.
SCORE_SAMPLES = 1000


@dataclass
class Try:
    """One pruned model built and timed in one deployment.

    Attributes:
        aim: the latency fraction the pruner was asked for (1.0: the unpruned model).
        macs_fraction, params_fraction: the pruned model's MACs and parameters over the unpruned model's.
        ms: its measured latency (rescaled, see :meth:`_Search.timed`), or ``None`` when it failed its check.
        meets: whether ``ms`` (and ``confirmed_ms``, once timed) is within the budget (and
            :data:`MEET_TOLERANCE`).
        reason: why it was not timed (the pruner could not reach the aim, or the candidate failed its check).
        confirmed_ms: its time in the confirming run, for the tries that run timed again.
        slowed_ms: for a try that missed the budget and was timed faster the second time, its first time (the
            second is ``ms``): a reading taken under a burst of load (see :meth:`_Search.time_missed_again`).
        slowed_confirmed_ms: the same for its confirming time (the faster reading is ``confirmed_ms``).
        pruner_fraction: the pruner's own measure of the copy's latency as a fraction of the unpruned model's
            (the latency-target engine's, in ONNX Runtime FP32), where it gives one: set beside ``ms``, it shows
            whether a try landed off its aim in the pruner or in the deployment.
        pruner_tries: the copies the pruner compared before it kept this one, where it says (the latency-target
            engine's: proposal, measured latency and MACs fractions, and the score of those it scored): they
            show whether a copy of another size was within reach at this aim.
    """

    aim: float
    macs_fraction: float
    params_fraction: float
    ms: float | None = None
    meets: bool = False
    reason: str | None = None
    confirmed_ms: float | None = None
    slowed_ms: float | None = None
    slowed_confirmed_ms: float | None = None
    pruner_fraction: float | None = None
    pruner_tries: list[dict[str, Any]] | None = None


@dataclass
class Point:
    """One candidate deployment on the frontier.

    Attributes:
        name, label: the candidate (``openvino-int8``, ``OpenVINO INT8``).
        status: ``chosen``; ``met`` (met the budget, less accurate than the chosen one); ``missed`` (no try met
            it); ``dominated`` (FP32 in a runtime clearly slower than another's FP32: not searched); ``refused`` or
            ``unavailable`` (failed its check on the unpruned model, or cannot run here).
        unpruned_ms: its latency on the unpruned model.
        tries: every pruned model tried in it, in order.
        macs_fraction, params_fraction, ms: its point: the least pruned try that met the budget twice (``ms``
            the slower of its two times), or, when none did, the fastest try.
        speedup: its unpruned latency over ``ms``.
        efficiency: ``speedup`` x ``macs_fraction``: 1.0 when the time fell as much as the MACs did.
        score: what it scored on the data (``{"accuracy": ..., "samples": ...}``: the images of the score that
            decided), for the points that met the budget.
        reason: why it was not chosen.
        unpruned_readings: its unpruned build's time in each timing run it was in, rescaled by the FP32 file (see
            :meth:`_Search.timed`: their median scales its tries).
    """

    name: str
    label: str
    status: str
    unpruned_ms: float | None = None
    tries: list[Try] = field(default_factory=list)
    macs_fraction: float | None = None
    params_fraction: float | None = None
    ms: float | None = None
    speedup: float | None = None
    efficiency: float | None = None
    score: dict[str, float] | None = None
    reason: str | None = None
    unpruned_readings: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Deployer(Protocol):
    """What the search asks of models and runtimes."""

    #: The score that decides (``accuracy``: higher is better; ``perplexity``: lower is better).
    metric: str

    def build(self, name: str, model: Any) -> Candidate:
        """Candidate ``name`` built from ``model`` (``None``: the unpruned model) and checked; its ``status`` is
        ``verified`` when it passed, else ``refused``/``unavailable`` with a reason."""

    def time(self, candidates: Sequence[Candidate]) -> tuple[float, list[float]]:
        """The unpruned ONNX Runtime FP32 file's time and each candidate's, in ms, in one interleaved run."""

    def baseline_alone(self) -> float:
        """The unpruned ONNX Runtime FP32 file's time in ms, timed alone in a fresh process (see
        :mod:`optkit.analysis.fresh`)."""

    def score(self, candidate: Candidate, samples: int) -> dict[str, float]:
        """``{"accuracy": value, "samples": n}`` of a built candidate on the first ``samples`` images of the data's
        ``val`` split (``n``: as many as there were), or a language model's ``{"perplexity": value}`` (its check's,
        whatever ``samples``)."""


class Pruned(NamedTuple):
    """A copy pruned to an aim: the model, its MACs and parameter fractions, the pruner's own measure of its
    latency fraction (``None`` where the pruner does not time it), and the copies it compared (see
    :attr:`Try.pruner_tries`)."""

    model: Any
    macs_fraction: float
    params_fraction: float
    measured_fraction: float | None = None
    tries: list[dict[str, Any]] | None = None


#: A pruner takes an aim (a latency fraction) and returns the pruned copy.
Pruner = Callable[[float], Pruned]


@dataclass
class SearchResult:
    """What :func:`search` found.

    Attributes:
        chosen: the chosen point.
        model: its pruned model (the unpruned one when it needed no pruning).
        points: every candidate, in the order tried.
        budget_ms: the budget in ms per call.
        baseline_ms: the unpruned ONNX Runtime FP32 file's time alone in a fresh process, the median of
            :data:`BASELINE_READINGS` readings (every time is rescaled to it).
        metric: the score that decided.
    """

    chosen: Point
    model: Any
    points: list[Point]
    budget_ms: float
    baseline_ms: float
    metric: str

    def section(self, asked: str) -> dict[str, Any]:
        """The frontier for the report: the budget (``asked`` in words), each point, and the choice."""
        return {"asked": asked, "budget_ms": round(self.budget_ms, 4), "baseline_ms": round(self.baseline_ms, 4),
                "metric": self.metric, "chosen": self.chosen.name, "points": [p.to_dict() for p in self.points]}


def search(names: Sequence[str], deployer: Deployer, prune: Pruner, *, budget: float, unit: str,
           unpruned_model: Any = None, tokens_per_step: int | None = None) -> SearchResult:
    """The most accurate deployment among ``names`` that meets the budget, each pruned just enough.

    Args:
        names: the candidates, simplest first.
        deployer: builds, times and scores candidates.
        prune: prunes a copy of the model to an aim (see :data:`Pruner`).
        budget: milliseconds per call (``unit`` ``ms``), or a fraction of the unpruned ONNX Runtime FP32 file's
            time (``fraction``).
        unit: ``ms`` or ``fraction``.
        unpruned_model: what the result's ``model`` is when the chosen point needs no pruning.
        tokens_per_step: for a language model timed by its decode step, the tokens a step makes (the batch), so
            the refusal of a budget no candidate reaches names the fastest reachable tokens/s.

    Returns:
        the :class:`SearchResult`.

    Raises:
        OptkitError: when no candidate passes its checks, or none meets the budget (naming the fastest latency
            reached).
    """
    run = _Search(deployer, prune, unpruned_model)
    ready = run.build_unpruned(names)
    baseline = run.baseline = statistics.median(deployer.baseline_alone() for _ in range(BASELINE_READINGS))
    run.budget_ms = budget * baseline if unit == "fraction" else budget
    aims = run.first_aims(dict(zip(ready, run.timed([run.built[name] for name in ready]))))
    for round_ in range(1 + CORRECTIONS):
        if not aims:
            break
        aims = run.round(round_ + 1, aims)
    run.confirm(ready)
    if aims := run.after_confirmation(ready):
        run.round(2 + CORRECTIONS, aims)
        run.confirm(ready)
    meeting = run.settle(ready)
    if not meeting:
        raise OptkitError(_unreachable(run.points.values(), run.budget_ms, tokens_per_step))
    chosen = run.choose(meeting)
    return SearchResult(chosen, run.kept(chosen)[1], list(run.points.values()), run.budget_ms, baseline,
                        deployer.metric)


class _Search:
    """One search's state: every candidate's point, the build and model of every try that met the budget (by the
    try's ``id``), and the pruned models by aim (shared between candidates)."""

    def __init__(self, deployer: Deployer, prune: Pruner, unpruned_model: Any):
        self.deployer, self.prune, self.unpruned_model = deployer, prune, unpruned_model
        self.points: dict[str, Point] = {}
        self.built: dict[str, Candidate] = {}
        self.met: dict[int, tuple[Candidate, Any]] = {}
        self.cache: dict[float, Any] = {}
        self.baseline = self.budget_ms = 0.0

    @property
    def target(self) -> float:
        return self.budget_ms * AIM_MARGIN

    def meets(self, ms: float) -> bool:
        return ms <= self.budget_ms * (1 + MEET_TOLERANCE)

    def timed(self, candidates: Sequence[Candidate]) -> list[float]:
        """Each candidate's time in one interleaved run with its deployment's unpruned build, rescaled by that
        build: ``ms`` x the unpruned build's median time over every run so far / its time in this run.

        An unpruned build's time in a run is itself rescaled by the unpruned ONNX Runtime FP32 file's (the
        baseline: its time in the run against its time alone in a fresh process) before it joins the median, so
        for ONNX Runtime FP32 this is that rescaling. For other runtimes it also takes out how fast the runtime
        ran against ONNX Runtime in that run, which drifts: on a 2-CPU EPYC, OpenVINO bf16's unpruned
        efficientnet_b0 read 0.62–0.83 of ONNX Runtime FP32's time over 24 runs of 30–90 calls in fresh processes
        and in one that had fine-tuned, and a copy at half the MACs 0.36–0.53 (standard deviation 0.041); this
        estimate of the copy spread half as much (0.022). Timed back to back in one quiet process, the two agree
        (``benchmarks/results/runtime-drift.md``: 0.029 and 0.030).
        """
        names = list(dict.fromkeys(c.name for c in candidates))
        references = [self.built[name] for name in names]
        run = [*candidates, *(r for r in references if not any(r is c for c in candidates))]
        now, measured = self.deployer.time(run)
        in_run = {id(c): ms for c, ms in zip(run, measured)}
        scale = {}
        for name, reference in zip(names, references):
            readings = self.points[name].unpruned_readings
            readings.append(in_run[id(reference)] * self.baseline / now)
            scale[name] = statistics.median(readings) / in_run[id(reference)]
        return [in_run[id(c)] * scale[c.name] for c in candidates]

    def build_unpruned(self, names: Sequence[str]) -> list[str]:
        """Build and check every candidate on the unpruned model; the names of those that passed.

        Raises:
            OptkitError: when none passed.
        """
        shown = progress(STAGE, "candidates built and checked on the unpruned model", len(names))
        for name in names:
            candidate = self.built[name] = self.deployer.build(name, None)
            self.points[name] = Point(name, candidate.label, candidate.status, reason=candidate.reason)
            shown.step(detail=f"{name}: {candidate.status}")
        ready = [name for name in names if self.built[name].status == "verified"]
        if not ready:
            reasons = "; ".join(f"{p.name}: {p.reason}" for p in self.points.values())
            raise OptkitError(f"no deployment passed its checks on the unpruned model ({reasons}); nothing was "
                              "written")
        return ready

    def first_aims(self, unpruned: dict[str, float]) -> dict[str, float]:
        """Record each candidate's unpruned time (the try at aim 1.0); the aims of those that must be pruned."""
        aims = {}
        for name, ms in unpruned.items():
            point = self.points[name]
            point.status, point.unpruned_ms, point.reason = "missed", ms, None
            point.tries.append(Try(1.0, 1.0, 1.0, ms, self.meets(ms)))
            faster = _same_math_faster(self.built[name], unpruned, self.built)
            if self.meets(ms):
                self.met[id(point.tries[-1])] = (self.built[name], self.unpruned_model)
            elif faster is not None:
                point.status = "dominated"
                point.reason = (f"computes as {faster} does, which is {DOMINATED:.0%} or more faster unpruned "
                                f"({unpruned[faster]:.2f} ms against {ms:.2f}): it would need more pruning for the "
                                "same budget, so it was not searched")
            elif (aim := _on_grid(_next_aim(point.tries, self.target))) >= MIN_AIM:
                aims[name] = aim
            else:
                point.reason = (f"cannot meet {self.budget_ms:.2f} ms: it would need {self.budget_ms / ms:.2f} of its "
                                f"unpruned {ms:.2f} ms, below the {MIN_AIM:g} floor, so it was not pruned")
        return aims

    def round(self, number: int, aims: dict[str, float]) -> dict[str, float]:
        """Prune, build and time each candidate at its aim (one interleaved timing); the next round's aims.

        A candidate whose build of a pruned model failed its check is built next from another model already
        pruned, the least pruned one below its aim (see :meth:`_other_model`)."""
        trying, following = [], {}
        shown = progress(STAGE, f"tries of round {number} pruned and built", len(aims))
        for name, aim in aims.items():
            if aim not in self.cache:
                try:
                    self.cache[aim] = self.prune(aim)
                except OptkitError as e:  # the pruner cannot reach this aim: the candidate stops here
                    self.cache[aim] = e
            if isinstance(self.cache[aim], OptkitError):
                self.points[name].tries.append(Try(aim, 1.0, 1.0, reason=f"pruning to {aim:.2f} failed: "
                                                                         f"{self.cache[aim]}"))
                shown.step(detail=f"{name} at {aim:.2f} of its latency: pruning failed")
                continue
            result = self.cache[aim]
            pruned, macs = result.model, result.macs_fraction
            candidate = self.deployer.build(name, pruned)
            attempt = Try(aim, macs, result.params_fraction, pruner_fraction=result.measured_fraction,
                          pruner_tries=result.tries)
            self.points[name].tries.append(attempt)
            shown.step(detail=f"{name} at {aim:.2f} of its latency: MACs {macs:.3f}, {candidate.status}")
            if candidate.status != "verified":
                attempt.reason = candidate.reason
                if (other := self._other_model(self.points[name].tries)) is not None:
                    following[name] = other
                continue
            trying.append((name, candidate, attempt, pruned))
        if not trying:
            return following
        for (_, _, attempt, _), ms in zip(trying, self.timed([candidate for _, candidate, _, _ in trying])):
            attempt.ms = ms
            attempt.meets = self.meets(attempt.ms)
        self.time_missed_again([(candidate, attempt) for _, candidate, attempt, _ in trying])
        for name, candidate, attempt, pruned in trying:
            tries = self.points[name].tries
            if attempt.meets:
                self.met[id(attempt)] = (candidate, pruned)
            if attempt.meets and attempt.ms >= self.budget_ms * (1 - SLACK):
                continue
            if (aim := self._following_aim(tries)) is not None:
                following[name] = aim
        return following

    def time_missed_again(self, timed: Sequence[tuple[Candidate, Try]], reading: str = "ms") -> None:
        """Time the tries of ``timed`` whose ``reading`` missed the budget once more, in one interleaved run; where
        the second time is faster, it replaces that reading (``ms``, the first kept as the try's ``slowed_ms``; or
        ``confirmed_ms``, kept as ``slowed_confirmed_ms``), and decides whether the try meets.

        One slow reading (a burst of load on a shared machine during part of a run) would otherwise bound the
        search from above for good: every later aim is read from the line through it (efficientnet_b0 on a 2-CPU
        EPYC, 0.5 of its latency: a copy the pruning engine measured at 0.515 read 0.658 in the search's run, and
        the rounds after it ended at 0.23 of the MACs with a third of the budget unspent). A try that meets on its
        second time is timed a third time before it is kept, as every try that meets is (:meth:`confirm`). A
        confirming time that misses is read again the same way, so a try is kept on two times within the budget
        out of at most three, and one slow reading drops it no more than one slow first reading bends the search.
        """
        missed = [(candidate, attempt) for candidate, attempt in timed if not attempt.meets]
        if not missed:
            return
        slowed = f"slowed_{reading}"
        shown = progress(STAGE, "tries that missed the budget timed again", 1)
        for (_, attempt), again in zip(missed, self.timed([candidate for candidate, _ in missed])):
            if again < getattr(attempt, reading):
                setattr(attempt, slowed, getattr(attempt, reading))
                setattr(attempt, reading, again)
                attempt.meets = self.meets(again)
        shown.step(detail=f"{sum(getattr(a, slowed) is not None for _, a in missed)} of {len(missed)} faster the "
                          "second time")

    def confirm(self, ready: Sequence[str]) -> None:
        """Time each searched candidate's least pruned try that met the budget again, all in one interleaved run;
        a try over the budget this time is timed once more (see :meth:`time_missed_again`), and over it again no
        longer meets it: the candidate's next one is confirmed in the
        following run, until every candidate's best try is confirmed or it has none left. A try confirmed by an
        earlier call keeps its two times: a third would give a try that met twice one more chance to miss than
        the others had."""
        while True:
            pending = [best for name in ready if self.points[name].status != "dominated"
                       and (best := _best(self.points[name])) is not None and best.confirmed_ms is None]
            if not pending:
                return
            shown = progress(STAGE, "least pruned tries that met the budget timed again", 1)
            for attempt, ms in zip(pending, self.timed([self.met[id(attempt)][0] for attempt in pending])):
                attempt.confirmed_ms = ms
                attempt.meets = self.meets(attempt.confirmed_ms)
            shown.step(detail=f"{sum(a.meets for a in pending)} of {len(pending)} met it again")
            self.time_missed_again([(self.met[id(attempt)][0], attempt) for attempt in pending], "confirmed_ms")

    def after_confirmation(self, ready: Sequence[str]) -> dict[str, float]:
        """The aims of one more round for the deployments the rounds left short, where the next aim (taken from
        every time, the slower of two) is less pruned than the try left as their point:

        - the least pruned try that met the budget missed it when timed again, leaving no try or one much more
          pruned (efficientnet_b0 at 0.3 of its latency: the try at aim 0.28, 0.14 of the MACs, timed 1.45 then
          1.63 ms against 1.50, which left the one at 0.24, 0.07 of the MACs);
        - the try left meets the budget with more than :data:`SLACK` of it unspent, the rounds having run out
          (efficientnet_b0 at 0.5 on a 2-CPU EPYC: a try at aim 0.48 timed 0.69 of the unpruned latency, the line
          through it sent the next to aim 0.12, and the one between them, 0.20 of the MACs, met 0.5 at 0.33).
        """
        aims = {}
        for name in ready:
            point = self.points[name]
            if point.status == "dominated":
                continue
            left = _best(point)
            missed_again = any(t.confirmed_ms is not None and not t.meets for t in point.tries)
            unspent = left is not None and _slower(left) < self.budget_ms * (1 - SLACK)
            if not (missed_again or unspent):
                continue
            if (aim := self._following_aim(point.tries)) is not None and (left is None or aim > left.aim):
                aims[name] = aim
        return aims

    def _following_aim(self, tries: Sequence[Try]) -> float | None:
        """The next aim on the grid from ``tries``, or ``None`` when it is below :data:`MIN_AIM` or tried; an aim
        whose model failed the candidate's check gives way to the one a grid step below (another model)."""
        aim = _on_grid(_next_aim(tries, self.target))
        if any(aim == t.aim and t.ms is None and t.macs_fraction < 1.0 for t in tries):
            aim = round(aim - AIM_STEP, 4)
        return aim if aim >= MIN_AIM and all(aim != t.aim for t in tries) else None

    def _other_model(self, tries: Sequence[Try]) -> float | None:
        """The aim of the least pruned model already pruned (for another candidate) below every aim in ``tries``
        that this candidate has not tried, else one grid step below its most pruned try (``None`` under
        :data:`MIN_AIM`).

        A lower-precision build is checked against the FP32 model it was built from, and a pruned copy can fail
        where a differently pruned one passes (mobilenet_v2 in OpenVINO bf16: refused at 0.79 of the MACs with
        4 of 256 images disagreeing, passed at 0.45), so one refusal does not end the candidate's search; a model
        pruned already costs only a build.
        """
        lowest = min(t.aim for t in tries)
        pruned = [aim for aim, result in self.cache.items() if aim < lowest and not isinstance(result, OptkitError)]
        aim = max(pruned, default=round(lowest - AIM_STEP, 4))
        return aim if aim >= MIN_AIM else None

    def settle(self, ready: Sequence[str]) -> list[Point]:
        """Each searched candidate's point (its least pruned try that met the budget, else its fastest); those
        that met it."""
        meeting = []
        for name in ready:
            point = self.points[name]
            if point.status == "dominated":
                continue
            best = _best(point) or min((t for t in point.tries if t.ms is not None), key=lambda t: t.ms)
            point.macs_fraction, point.params_fraction = best.macs_fraction, best.params_fraction
            point.ms = _slower(best)
            point.speedup = round(point.unpruned_ms / point.ms, 4)
            point.efficiency = round(point.speedup * best.macs_fraction, 4)
            if best.meets:
                point.status = "met"
                meeting.append(point)
            elif point.reason is None:
                point.reason = (f"cannot meet {self.budget_ms:.2f} ms: fastest {best.ms:.2f} ms at "
                                f"{best.macs_fraction:.2f} of the MACs")
        return meeting

    def choose(self, meeting: list[Point]) -> Point:
        """Score the points that met the budget and mark the best (the faster of two alike) chosen; accuracies
        within noise of the best are scored again on more images, which decide between them."""
        metric = self.deployer.metric
        shown = progress(STAGE, "deployments that met the budget scored", len(meeting))
        for point in meeting:
            point.score = self.deployer.score(self.kept(point)[0], SCORE_SAMPLES)
            shown.step(detail=f"{point.name}: {metric} {score_figure(point, metric)}")
        sign = -1 if metric == "perplexity" else 1
        best = max(meeting, key=lambda p: (sign * p.score[metric], -p.ms))
        rescorable = metric == "accuracy" and best.score["samples"] >= SCORE_SAMPLES
        close = [p for p in meeting if within_noise_of(p.score, best.score)] if rescorable else []
        if len(close) > 1:
            shown = progress(STAGE, f"deployments within noise of the best scored on {SECOND_LOOK_FACTOR} times "
                                    "the images", len(close))
            for point in close:
                point.score = self.deployer.score(self.kept(point)[0], SECOND_LOOK_FACTOR * SCORE_SAMPLES)
                shown.step(detail=f"{point.name}: {metric} {score_figure(point, metric)}")
            best = max(close, key=lambda p: (p.score[metric], -p.ms))
        best.status = "chosen"
        for point in meeting:
            if point is not best:
                point.reason = (f"met the budget, but {metric} {score_figure(point, metric)} against "
                                f"{score_figure(best, metric)}")
        return best

    def kept(self, point: Point) -> tuple[Candidate, Any]:
        """The build and model of ``point``'s confirmed try."""
        return self.met[id(_best(point))]


def within_noise_of(score: dict[str, float], best: dict[str, float]) -> bool:
    """Whether accuracy ``score`` is at most :data:`~optkit.passes.quantize.verify.NOISE_SE` standard errors of a
    difference of two binomial accuracies below ``best`` (each on its ``samples`` images)."""
    p, q = score["accuracy"], best["accuracy"]
    spread = p * (1 - p) / max(score["samples"], 1) + q * (1 - q) / max(best["samples"], 1)
    return q - p <= NOISE_SE * math.sqrt(spread)


def _same_math_faster(candidate: Candidate, unpruned: dict[str, float], built: dict[str, Candidate]) -> str | None:
    """The candidate that computes what ``candidate`` computes (FP32 in another runtime) and is at least
    :data:`DOMINATED` faster unpruned, if any: it meets any budget with less pruning, so ``candidate`` cannot
    be the more accurate."""
    if candidate.precision != "fp32":
        return None
    mine = unpruned[candidate.name]
    return next((name for name, ms in unpruned.items() if name != candidate.name and built[name].precision == "fp32"
                 and ms * (1 + DOMINATED) <= mine), None)


def _on_grid(aim: float) -> float:
    """``aim`` rounded down to a multiple of :data:`AIM_STEP` (at most :data:`MAX_AIM`): candidates whose aims
    round alike share one pruned model."""
    return round(min(MAX_AIM, math.floor(aim / AIM_STEP + 1e-9) * AIM_STEP), 4)


def _next_aim(tries: Sequence[Try], target: float) -> float:
    """The aim whose measured time should be ``target``: interpolated between the tries closest to it on either
    side, else extrapolated from the closest along the line to the try farthest from it in aim (the unpruned
    model is a try at aim 1.0); where timing noise put those two out of order (the more pruned one slower),
    scaled from the most pruned try still too slow (or the least pruned one already fast enough), so the search
    goes on past it instead of asking for it again.

    The farthest try, not the second closest, sets the slope: two tries a grid step or two apart differ by about
    as much as one timing does, and the slope through them can send the next aim anywhere (OpenVINO bf16 of
    efficientnet_b0: 3.295 ms at aim 0.70 and 3.27 at 0.64, a slope that pointed below 0.2 for 3.09 ms).
    """
    timed = [t for t in tries if t.ms is not None]
    above, below = [t for t in timed if _slower(t) > target], [t for t in timed if _slower(t) <= target]
    if above and below:
        pair = [max(below, key=_slower), min(above, key=_slower)]
    else:
        nearest = min(timed, key=lambda t: abs(_slower(t) - target))
        pair = [nearest, max(timed, key=lambda t: abs(t.aim - nearest.aim))]
    closest = pair[0]
    if len(pair) == 2 and pair[0].aim != pair[1].aim:
        slope = (_slower(pair[1]) - _slower(pair[0])) / (pair[1].aim - pair[0].aim)
        if slope > 0:
            return closest.aim + (target - _slower(closest)) / slope
    if not (above and below):
        closest = min(above, key=lambda t: t.aim) if above else max(below, key=lambda t: t.aim)
    return closest.aim * target / _slower(closest)


def _slower(attempt: Try) -> float:
    """The slower of a try's two times (its first, when it was not timed again)."""
    return max(attempt.ms, attempt.confirmed_ms or attempt.ms)


def _best(point: Point) -> Try | None:
    """The least pruned try of ``point`` that met the budget (the faster of two alike)."""
    return max((t for t in point.tries if t.meets), key=lambda t: (t.macs_fraction, -t.ms), default=None)


def score_figure(point: Point, metric: str) -> str:
    """``point``'s score in ``metric`` as reports show it (a percentage for accuracy)."""
    value = point.score[metric]
    return f"{value:.2%}" if metric == "accuracy" else f"{value:.3f}"


def _unreachable(points: Sequence[Point] | Any, budget_ms: float, tokens_per_step: int | None) -> str:
    timed = [(t.ms, p, t) for p in points for t in p.tries if t.ms is not None]
    ms, point, attempt = min(timed, key=lambda item: item[0])
    where = f"({point.label} at {attempt.macs_fraction:.2f} of the MACs)"
    if tokens_per_step is not None:
        rate, asked = tokens_per_step * 1000.0 / ms, tokens_per_step * 1000.0 / budget_ms
        return (f"no deployment meets the budget of {asked:.1f} decode tokens/s: the fastest reachable is {rate:.1f} "
                f"tokens/s {where}; give --target-latency {rate / 1.05:.1f}tok/s or less; nothing was written")
    return (f"no deployment meets the budget of {_ms(budget_ms)} ms per call: the fastest reachable is {_ms(ms)} ms "
            f"{where}; give --target-latency {_ms(ms * 1.05)}ms or more; nothing was written")


def _ms(value: float) -> str:
    """``value`` with two decimals, or as many as show two significant digits (a model of 0.05 ms: a budget of
    0.045 ms and a fastest time of 0.048 would both read 0.05 with two)."""
    decimals = max(2, 1 - math.floor(math.log10(value))) if value > 0 else 2
    return f"{value:.{decimals}f}"
