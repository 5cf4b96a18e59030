"""The joint search (:func:`optkit.passes.deploy.search.search`) on a fake deployer: each candidate pruned just
enough, aims corrected by what was measured, the most accurate chosen, and a budget none reaches refused.

The fake's models are their aims; a candidate's time is its unpruned time times what pruning buys in its
runtime (``pays``: the fraction of the aim's saving it really gets), and its accuracy falls with the MACs removed,
so the choice is deterministic and the right answer is known.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest

from optkit.core.errors import OptkitError
from optkit.passes.deploy.candidate import Candidate
from optkit.passes.deploy.search import (AIM_MARGIN, BASELINE_READINGS, CORRECTIONS, MEET_TOLERANCE, MIN_AIM,
                                         SCORE_SAMPLES, SLACK, Pruned, search, within_noise_of)

BASELINE_MS = 10.0


@dataclass
class Runtime:
    unpruned_ms: float
    accuracy: float
    pays: float = 1.0  # 1.0: the time falls as the aim says; 0.5: half of that saving shows
    refused: bool = False
    refused_at: tuple[float, ...] = ()  # pruned models (aims) whose build fails the check
    wider: float | None = None  # its accuracy on more than SCORE_SAMPLES images (None: the same)


class FakeDeployer:
    """Builds, times and scores the fake runtimes; records what it was asked."""

    def __init__(self, runtimes: dict[str, Runtime], metric: str = "accuracy", load: float = 1.0):
        self.runtimes, self.metric, self.load = runtimes, metric, load
        self.timed: list[list[tuple[str, float]]] = []
        self.scored: list[str] = []
        self.rescored: list[str] = []

    def build(self, name: str, model) -> Candidate:
        runtime, precision = name.split("-")
        candidate = Candidate(name, runtime, precision)
        candidate.built = 1.0 if model is None else model
        if self.runtimes[name].refused or candidate.built in self.runtimes[name].refused_at:
            candidate.status, candidate.reason = "refused", "agreement 80.0% below 99.0%"
        return candidate

    def ms(self, candidate: Candidate) -> float:
        spec, aim = self.runtimes[candidate.name], candidate.built
        return spec.unpruned_ms * (1 - spec.pays * (1 - aim))

    def time(self, candidates):
        self.timed.append([(c.name, c.built) for c in candidates])
        return BASELINE_MS * self.load, [self.ms(c) * self.load for c in candidates]

    def baseline_alone(self) -> float:
        return BASELINE_MS

    def score(self, candidate: Candidate, samples: int) -> dict[str, float]:
        (self.scored if samples == SCORE_SAMPLES else self.rescored).append(candidate.name)
        spec, macs = self.runtimes[candidate.name], candidate.built
        measured = spec.accuracy if samples == SCORE_SAMPLES or spec.wider is None else spec.wider
        value = measured - 0.2 * (1 - macs)
        return {"perplexity": 10 / value} if self.metric == "perplexity" else {"accuracy": value, "samples": samples}


def prune(aim: float):
    """The fake pruner: the model is its aim, and keeps that fraction of the MACs and parameters."""
    return Pruned(aim, aim, aim)


def test_each_candidate_is_pruned_just_enough_and_the_most_accurate_is_chosen():
    deployer = FakeDeployer({
        "onnxruntime-fp32": Runtime(10.0, 0.92),        # needs about half its latency cut: loses 0.10
        "openvino-int8": Runtime(4.0, 0.905),           # meets 5 ms unpruned: INT8 costs it 1.5 points only
        "openvino-bf16": Runtime(6.0, 0.915),           # needs a 17% cut: loses about 0.035
    })
    result = search(list(deployer.runtimes), deployer, prune, budget=0.5, unit="fraction", unpruned_model="full")
    points = {p.name: p for p in result.points}
    assert result.budget_ms == pytest.approx(5.0)
    assert result.chosen.name == "openvino-int8" and result.model == "full"
    assert points["openvino-int8"].macs_fraction == 1.0 and points["openvino-int8"].status == "chosen"
    for name in ("onnxruntime-fp32", "openvino-bf16"):
        point = points[name]
        assert point.status == "met" and point.ms <= 5.0
        # just enough: within SLACK of the budget, else it would have been tried with less pruning
        assert point.ms >= 5.0 * (1 - SLACK - 0.01), point.tries
        assert "met the budget, but accuracy" in point.reason
    assert points["onnxruntime-fp32"].macs_fraction == pytest.approx(0.5 * AIM_MARGIN, abs=0.01)
    assert sorted(deployer.scored) == sorted(points)


def test_the_most_accurate_meeting_candidate_wins_even_when_it_is_not_the_fastest():
    deployer = FakeDeployer({"onnxruntime-fp32": Runtime(6.0, 0.93), "onnxruntime-int8": Runtime(3.0, 0.80)})
    result = search(list(deployer.runtimes), deployer, prune, budget=5.0, unit="ms", unpruned_model="full")
    assert result.chosen.name == "onnxruntime-fp32"
    assert result.chosen.ms <= 5.0 < result.chosen.unpruned_ms
    assert result.model == result.chosen.macs_fraction < 1.0  # the pruned model (the fake's model is its aim)
    (other,) = [p for p in result.points if p is not result.chosen]
    assert other.status == "met" and other.ms < result.chosen.ms  # faster, but less accurate


def test_a_runtime_where_pruning_pays_less_gets_its_aim_corrected_by_measurement():
    # Half the predicted saving shows in this runtime: the first try misses, the corrected one meets.
    deployer = FakeDeployer({"openvino-fp32": Runtime(10.0, 0.92, pays=0.5)})
    result = search(["openvino-fp32"], deployer, prune, budget=7.0, unit="ms")
    point = result.chosen
    assert not point.tries[0].meets and point.tries[0].ms > 7.0
    assert any(t.meets for t in point.tries) and point.ms <= 7.0
    assert len(point.tries) <= 1 + CORRECTIONS
    # Efficiency = speed-up x MACs kept: below 1 where the channels removed do not pay.
    assert point.efficiency == pytest.approx(point.unpruned_ms / point.ms * point.macs_fraction, rel=1e-3)
    assert point.efficiency < 0.9


def test_a_candidate_that_cannot_meet_the_budget_is_marked_and_the_others_still_chosen():
    deployer = FakeDeployer({"onnxruntime-fp32": Runtime(10.0, 0.95, pays=0.1),   # 10 ms at best 9.1
                             "onnxruntime-int8": Runtime(5.0, 0.90),
                             "openvino-bf16": Runtime(3.0, 0.99, refused=True)})
    result = search(list(deployer.runtimes), deployer, prune, budget=4.0, unit="ms")
    points = {p.name: p for p in result.points}
    assert result.chosen.name == "onnxruntime-int8"
    assert points["onnxruntime-fp32"].status == "missed"
    assert points["onnxruntime-fp32"].reason.startswith("cannot meet 4.00 ms: fastest ")
    assert points["onnxruntime-fp32"].score is None  # never scored: it did not meet the budget
    assert points["openvino-bf16"].status == "refused" and "agreement" in points["openvino-bf16"].reason
    assert "openvino-bf16" not in [name for run in deployer.timed for name, _ in run]


def test_a_budget_no_candidate_reaches_is_refused_naming_the_fastest_latency():
    deployer = FakeDeployer({"onnxruntime-fp32": Runtime(10.0, 0.9, pays=0.2), "onnxruntime-int8": Runtime(6.0, 0.9,
                                                                                                            pays=0.2)})
    with pytest.raises(OptkitError) as caught:
        search(list(deployer.runtimes), deployer, prune, budget=1.0, unit="ms")
    fastest = min(deployer.ms(Candidate("onnxruntime-int8", "onnxruntime", "int8", built=aim))
                  for run in deployer.timed for name, aim in run if name == "onnxruntime-int8")
    message = str(caught.value)
    assert f"the fastest reachable is {fastest:.2f} ms (ONNX Runtime INT8" in message
    assert "budget of 1.00 ms" in message and "nothing was written" in message
    assert deployer.scored == []


def test_aims_below_the_floor_are_not_tried():
    deployer = FakeDeployer({"onnxruntime-fp32": Runtime(100.0, 0.9)})
    with pytest.raises(OptkitError, match="no deployment meets the budget"):
        search(["onnxruntime-fp32"], deployer, prune, budget=100.0 * MIN_AIM / 2, unit="ms")
    assert deployer.timed == [[("onnxruntime-fp32", 1.0)]]  # the unpruned timing only: nothing below MIN_AIM pruned
    deployer = FakeDeployer({"onnxruntime-fp32": Runtime(100.0, 0.9), "onnxruntime-int8": Runtime(4.0, 0.8)})
    result = search(list(deployer.runtimes), deployer, prune, budget=5.0, unit="ms")
    fp32 = next(p for p in result.points if p.name == "onnxruntime-fp32")
    assert fp32.status == "missed" and len(fp32.tries) == 1
    assert fp32.reason == "cannot meet 5.00 ms: it would need 0.05 of its unpruned 100.00 ms, below the 0.1 floor, so " \
                          "it was not pruned"


def test_times_are_rescaled_by_the_baseline_so_load_between_runs_does_not_move_them():
    deployer = FakeDeployer({"onnxruntime-fp32": Runtime(10.0, 0.9)})
    calm = search(["onnxruntime-fp32"], deployer, prune, budget=6.0, unit="ms").chosen
    deployer = FakeDeployer({"onnxruntime-fp32": Runtime(10.0, 0.9)})
    runs = itertools.chain([1.0, 1.0], itertools.repeat(1.5))  # the machine gets busier after the first runs

    def busier(candidates):
        deployer.load = next(runs)
        return FakeDeployer.time(deployer, candidates)

    deployer.time = busier
    loaded = search(["onnxruntime-fp32"], deployer, prune, budget=6.0, unit="ms").chosen
    assert loaded.ms == pytest.approx(calm.ms) and loaded.macs_fraction == calm.macs_fraction


def test_perplexity_is_lower_better():
    deployer = FakeDeployer({"onnxruntime-fp32": Runtime(4.0, 0.9), "onnxruntime-w4": Runtime(2.0, 0.8)},
                            metric="perplexity")
    result = search(list(deployer.runtimes), deployer, prune, budget=5.0, unit="ms")
    assert result.chosen.name == "onnxruntime-fp32" and result.metric == "perplexity"
    assert result.section("5 ms")["chosen"] == "onnxruntime-fp32"
    assert deployer.rescored == []  # a perplexity is its check's, on all the validation text: no second look


def test_accuracies_within_noise_of_the_best_are_decided_on_four_times_the_images():
    # All three meet 5 ms unpruned, so their scores are the fake's figures. On SCORE_SAMPLES images INT8 leads bf16
    # by one point (within noise) and FP32 trails by eleven (not); on four times the images bf16 is ahead.
    deployer = FakeDeployer({"openvino-int8": Runtime(3.0, 0.66, wider=0.64),
                             "openvino-bf16": Runtime(4.0, 0.65, wider=0.655),
                             "onnxruntime-fp32": Runtime(4.5, 0.55, wider=0.70)})
    result = search(list(deployer.runtimes), deployer, prune, budget=5.0, unit="ms")
    points = {p.name: p for p in result.points}
    assert sorted(deployer.rescored) == ["openvino-bf16", "openvino-int8"]
    assert result.chosen.name == "openvino-bf16"
    assert result.chosen.score == {"accuracy": 0.655, "samples": 4 * SCORE_SAMPLES}
    assert points["openvino-int8"].reason == "met the budget, but accuracy 64.00% against 65.50%"
    # Clearly behind on the first images: never scored again, even though more images would have favoured it.
    assert points["onnxruntime-fp32"].score == {"accuracy": 0.55, "samples": SCORE_SAMPLES}


def test_a_clear_lead_is_not_scored_again():
    deployer = FakeDeployer({"openvino-int8": Runtime(3.0, 0.70, wider=0.60), "openvino-bf16": Runtime(4.0, 0.65)})
    result = search(list(deployer.runtimes), deployer, prune, budget=5.0, unit="ms")
    assert result.chosen.name == "openvino-int8" and deployer.rescored == []


def test_within_noise_is_two_standard_errors_of_a_difference_of_two_accuracies():
    # 66 % and 61.8 % on 1000 images each: SE = sqrt((0.66 x 0.34 + 0.618 x 0.382) / 1000) = 2.146 points, so the
    # 4.2-point gap is 1.96 SE (within); 66 % and 61.5 %: SE 2.148, a 4.5-point gap is 2.10 SE (not).
    best = {"accuracy": 0.66, "samples": 1000}
    assert within_noise_of({"accuracy": 0.618, "samples": 1000}, best)
    assert not within_noise_of({"accuracy": 0.615, "samples": 1000}, best)
    # The same gap on four times the images is outside: SE halves.
    assert not within_noise_of({"accuracy": 0.618, "samples": 4000}, {"accuracy": 0.66, "samples": 4000})


def test_no_candidate_passing_its_checks_is_refused():
    deployer = FakeDeployer({"onnxruntime-int8": Runtime(1.0, 0.9, refused=True)})
    with pytest.raises(OptkitError, match="no deployment passed its checks on the unpruned model"):
        search(["onnxruntime-int8"], deployer, prune, budget=0.5, unit="fraction")


def test_candidates_whose_aims_round_alike_share_one_pruned_model():
    calls = []

    def counting(aim):
        calls.append(aim)
        return prune(aim)

    deployer = FakeDeployer({"onnxruntime-fp32": Runtime(10.0, 0.92), "openvino-fp32": Runtime(10.1, 0.92)})
    result = search(list(deployer.runtimes), deployer, counting, budget=5.0, unit="ms")
    assert calls == [0.48]  # 5 / 10 x 0.97 and 5 / 10.1 x 0.97, both rounded down to the 0.02 grid
    assert all(p.macs_fraction == 0.48 for p in result.points)


def test_an_aim_the_pruner_cannot_reach_ends_that_candidates_search_with_the_reason():
    def failing(aim):
        raise OptkitError(f"no mix of heads and MLP channels reaches params {aim:.2f}")

    deployer = FakeDeployer({"onnxruntime-fp32": Runtime(10.0, 0.9), "onnxruntime-int8": Runtime(4.0, 0.85)})
    result = search(list(deployer.runtimes), deployer, failing, budget=5.0, unit="ms", tokens_per_step=None)
    fp32 = next(p for p in result.points if p.name == "onnxruntime-fp32")
    assert result.chosen.name == "onnxruntime-int8" and fp32.status == "missed"
    assert fp32.tries[-1].reason == "pruning to 0.48 failed: no mix of heads and MLP channels reaches params 0.48"
    with pytest.raises(OptkitError, match=r"budget of 250.0 decode tokens/s: the fastest reachable is 100.0 tokens/s"):
        search(["onnxruntime-fp32"], FakeDeployer({"onnxruntime-fp32": Runtime(10.0, 0.9)}), failing, budget=4.0,
               unit="ms", tokens_per_step=1)


def test_fp32_in_a_clearly_slower_runtime_is_not_searched():
    calls = []

    def counting(aim):
        calls.append(aim)
        return prune(aim)

    deployer = FakeDeployer({"onnxruntime-fp32": Runtime(10.0, 0.92), "openvino-fp32": Runtime(20.0, 0.92),
                             "openvino-int8": Runtime(12.0, 0.91)})
    result = search(list(deployer.runtimes), deployer, counting, budget=5.0, unit="ms")
    points = {p.name: p for p in result.points}
    assert points["openvino-fp32"].status == "dominated" and points["openvino-fp32"].tries[0].aim == 1.0
    assert "computes as onnxruntime-fp32 does" in points["openvino-fp32"].reason
    assert points["openvino-int8"].status == "met"  # INT8 computes otherwise: searched
    assert calls == [0.48, 0.4]  # FP32's aim and INT8's; none for OpenVINO FP32


def test_a_time_within_the_timing_tolerance_of_the_budget_meets_it():
    deployer = FakeDeployer({"onnxruntime-fp32": Runtime(5.0 * (1 + MEET_TOLERANCE) - 1e-6, 0.9),
                             "onnxruntime-int8": Runtime(5.0 * (1 + MEET_TOLERANCE) + 0.01, 0.95)})
    result = search(list(deployer.runtimes), deployer, prune, budget=5.0, unit="ms")
    points = {p.name: p for p in result.points}
    assert points["onnxruntime-fp32"].tries == [points["onnxruntime-fp32"].tries[0]]  # met unpruned: no pruning
    assert points["onnxruntime-fp32"].macs_fraction == 1.0
    assert points["onnxruntime-int8"].macs_fraction < 1.0  # just over the tolerance: pruned


def test_a_try_that_met_the_budget_by_luck_is_timed_again_and_its_next_try_chosen():
    """Each model's first timing here is 10 % fast (a lucky run); the confirming run times it as it is. The less
    pruned try that met 5 ms only by luck (0.52 of the MACs: 5.2 ms) is dropped for the next one that met it
    (0.48: 4.8 ms), and the shipped model is that one."""
    deployer = FakeDeployer({"openvino-fp32": Runtime(10.0, 0.92)})
    _lucky_once(deployer)
    result = search(["openvino-fp32"], deployer, prune, budget=5.0, unit="ms", unpruned_model="full")
    tries = {t.aim: t for t in result.chosen.tries}
    assert sorted(tries) == [0.48, 0.52, 1.0]
    assert tries[0.52].ms == pytest.approx(4.68) and tries[0.52].confirmed_ms == pytest.approx(5.2)
    assert not tries[0.52].meets and tries[0.48].meets
    assert result.chosen.macs_fraction == 0.48 and result.model == 0.48
    assert result.chosen.ms == pytest.approx(4.8)  # the slower of its two times
    # 0.52's confirming time missed and was read once more (no faster) before 0.48 was confirmed, each run with the
    # unpruned build of the deployment
    assert deployer.timed[-3:] == ([[("openvino-fp32", 0.52), ("openvino-fp32", 1.0)]] * 2
                                   + [[("openvino-fp32", 0.48), ("openvino-fp32", 1.0)]])
    assert tries[0.52].slowed_confirmed_ms is None


def test_a_try_whose_confirming_time_alone_misses_is_read_again_and_kept():
    """The copy at aim 0.48 meets 5 ms at 4.8 in its round; the confirming run reads it at 5.5 (a burst of load),
    the reading after it 4.8 again: two of three times meet, it is kept and chosen, not dropped for a more pruned
    one."""
    deployer = FakeDeployer({"onnxruntime-fp32": Runtime(10.0, 0.92)})
    runs: list[float] = []

    def burst_in_the_second_run(candidates):
        baseline, times = FakeDeployer.time(deployer, candidates)
        runs.extend(c.built for c in candidates if c.built == 0.48)
        return baseline, [5.5 if c.built == 0.48 and runs.count(0.48) == 2 else ms for c, ms in zip(candidates, times)]

    deployer.time = burst_in_the_second_run
    result = search(["onnxruntime-fp32"], deployer, prune, budget=5.0, unit="ms", unpruned_model="full")
    kept = result.chosen.tries[-1]
    assert kept.aim == 0.48 and kept.meets and result.model == 0.48
    assert kept.slowed_confirmed_ms == pytest.approx(5.5) and kept.confirmed_ms == pytest.approx(4.8)
    assert result.chosen.ms == pytest.approx(4.8)
    # its round, the confirming run, the reading after, each with the unpruned build
    assert deployer.timed[1:] == [[("onnxruntime-fp32", 0.48), ("onnxruntime-fp32", 1.0)]] * 3


def test_times_are_scaled_to_the_unpruned_file_timed_alone_in_a_fresh_process():
    """Here the search's process runs every file 10 % slower for each file in its timing run (its state, not the
    file, sets the pace). The INT4 candidate's 4.5 ms reads 5.4 there and would miss 5 ms; scaled by the unpruned
    file's time in a fresh process it meets it unpruned."""
    deployer = FakeDeployer({"onnxruntime-fp32": Runtime(10.0, 0.95), "onnxruntime-w4": Runtime(4.5, 0.9)})

    def crowded(candidates):
        deployer.load = 1 + 0.1 * len(candidates)
        return FakeDeployer.time(deployer, candidates)

    deployer.time = crowded
    result = search(list(deployer.runtimes), deployer, prune, budget=5.0, unit="ms", unpruned_model="full")
    w4 = next(p for p in result.points if p.name == "onnxruntime-w4")
    assert result.baseline_ms == pytest.approx(BASELINE_MS)
    assert w4.tries[0].ms == pytest.approx(4.5) and w4.macs_fraction == 1.0 and w4.status in ("met", "chosen")


def test_one_slow_fresh_reading_of_the_baseline_does_not_scale_the_search():
    """The unpruned FP32 file read alone in a fresh process at 25, 10 and 10 ms: the median, 10 ms, scales every
    time, so a 5 ms budget is met at the same try as with steady readings (with 25 ms every time would read 2.5x
    slower and the try kept would be pruned far more)."""
    calm = search(["onnxruntime-fp32"], FakeDeployer({"onnxruntime-fp32": Runtime(10.0, 0.9)}), prune, budget=5.0,
                  unit="ms")
    deployer = FakeDeployer({"onnxruntime-fp32": Runtime(10.0, 0.9)})
    readings = iter([25.0, 10.0, 10.0])
    deployer.baseline_alone = lambda: next(readings)
    result = search(["onnxruntime-fp32"], deployer, prune, budget=5.0, unit="ms")
    assert BASELINE_READINGS == 3 and next(readings, None) is None  # all three read
    assert result.baseline_ms == pytest.approx(10.0)
    assert result.chosen.macs_fraction == calm.chosen.macs_fraction and result.chosen.ms == pytest.approx(calm.chosen.ms)


def test_a_runtime_running_fast_against_the_baseline_in_one_run_does_not_make_a_try_meet():
    """OpenVINO runs 12 % faster against ONNX Runtime FP32 in the run that confirms the try at aim 0.52 (its time
    5.2 ms, 5 ms asked; read 4.68 in its lucky round): the unpruned OpenVINO build in that run reads 12 % fast too,
    so the try is read at its 5.2 ms again and dropped for the one at 0.48. Scaled by the baseline alone, it would
    have read 4.58 ms, met the budget twice and been shipped at 5.2."""
    deployer = FakeDeployer({"openvino-fp32": Runtime(10.0, 0.92)})
    _lucky_once(deployer)
    lucky, seen = deployer.time, []

    def openvino_fast_when_confirming(candidates):
        baseline, times = lucky(candidates)
        seen.extend(c.built for c in candidates)
        factor = 0.88 if seen.count(0.52) == 2 and 0.52 in [c.built for c in candidates] else 1.0
        return baseline, [ms * (factor if c.runtime == "openvino" else 1.0) for c, ms in zip(candidates, times)]

    deployer.time = openvino_fast_when_confirming
    result = search(["openvino-fp32"], deployer, prune, budget=5.0, unit="ms", unpruned_model="full")
    tries = {t.aim: t for t in result.chosen.tries}
    assert tries[0.52].confirmed_ms == pytest.approx(5.2) and not tries[0.52].meets
    assert result.model == 0.48 and result.chosen.ms == pytest.approx(4.8)
    # one reading of the unpruned build per run, the fast one among them
    assert len(result.chosen.unpruned_readings) == len(deployer.timed)
    assert sorted(result.chosen.unpruned_readings)[0] == pytest.approx(8.8)
    assert sorted(result.chosen.unpruned_readings)[1:] == pytest.approx([10.0] * (len(deployer.timed) - 1))


def test_a_more_pruned_try_timed_slower_by_noise_does_not_end_the_search():
    """The first try (aim 0.84) reads slower than the unpruned model: the next aim is scaled from it, not from
    the unpruned model (which would ask for 0.84 again and stop there, missing the budget)."""
    deployer = FakeDeployer({"onnxruntime-w4": Runtime(10.0, 0.9)})

    def noisy(candidates):
        baseline, times = FakeDeployer.time(deployer, candidates)
        return baseline, [10.2 if c.built == 0.84 else ms for c, ms in zip(candidates, times)]

    deployer.time = noisy
    result = search(["onnxruntime-w4"], deployer, prune, budget=8.8, unit="ms")
    aims = [t.aim for t in result.chosen.tries]
    # 8.8 x 0.97 / 10 = 0.854 and 0.84 x 8.8 x 0.97 / 10.2 = 0.703, each on the 0.02 grid
    assert aims[:3] == [1.0, 0.84, 0.7]
    assert result.chosen.status == "chosen" and result.chosen.ms <= 8.8 * (1 + MEET_TOLERANCE)


def test_a_deployment_whose_only_try_met_the_budget_by_luck_gets_one_more_round():
    """Pruning pays 90 % of the aim's saving here, and each model's first timing is 10 % fast. The first try (aim
    0.48: 5.32 ms) meets 5 ms only by luck and misses when timed again; one more round, aimed from the slower time,
    tries 0.42 (4.78 ms), which meets it both times and is chosen."""
    deployer = FakeDeployer({"onnxruntime-fp32": Runtime(10.0, 0.92, pays=0.9)})
    _lucky_once(deployer)
    result = search(["onnxruntime-fp32"], deployer, prune, budget=5.0, unit="ms", unpruned_model="full")
    tries = {t.aim: t for t in result.chosen.tries}
    assert sorted(tries) == [0.42, 0.48, 1.0]
    assert not tries[0.48].meets and tries[0.48].confirmed_ms == pytest.approx(5.32)
    assert tries[0.42].meets and result.model == 0.42 and result.chosen.ms == pytest.approx(4.78)


def _lucky_once(deployer: FakeDeployer, factor: float = 0.9) -> None:
    """Make each pruned model's first timing ``factor`` of its time (a lucky run); later timings are as they are."""
    seen: set[float] = set()

    def lucky_once(candidates):
        baseline, times = FakeDeployer.time(deployer, candidates)
        lucky = [ms * (1.0 if c.built in seen or c.built == 1.0 else factor) for c, ms in zip(candidates, times)]
        seen.update(c.built for c in candidates)
        return baseline, lucky

    deployer.time = lucky_once


def test_a_pruned_build_that_fails_its_check_does_not_end_the_deployments_search():
    """bf16 needs 0.80 of its latency (4.85 / 6.0 on the grid), but that model's bf16 build fails the check. It is
    built next from the model already pruned for FP32 (0.48, no pruning), which meets the budget with room to
    spare; the correction up would ask for 0.80 again, so it takes the grid step below (0.78), which passes and
    is the most accurate point."""
    calls = []

    def counting(aim):
        calls.append(aim)
        return prune(aim)

    deployer = FakeDeployer({"onnxruntime-fp32": Runtime(10.0, 0.92),
                             "openvino-bf16": Runtime(6.0, 0.92, refused_at=(0.80,))})
    result = search(list(deployer.runtimes), deployer, counting, budget=5.0, unit="ms", unpruned_model="full")
    bf16 = {t.aim: t for t in next(p for p in result.points if p.name == "openvino-bf16").tries}
    assert sorted(bf16) == [0.48, 0.78, 0.8, 1.0]
    assert bf16[0.8].ms is None and "agreement" in bf16[0.8].reason
    assert bf16[0.48].meets and bf16[0.78].meets
    assert calls == [0.48, 0.8, 0.78]  # 0.48 pruned once, for FP32, and reused
    assert result.chosen.name == "openvino-bf16" and result.model == 0.78


def test_a_try_that_missed_when_timed_again_leaving_only_more_pruned_ones_gets_a_round_between():
    """A runtime where the time goes with the square of the aim, each model's first timing 15 % fast, 4.8 ms asked.
    Aim 0.46 meets with room to spare, 0.64 meets, 0.70 meets only by luck (4.16 ms, then 4.90). What is left,
    0.64, is two grid steps more pruned than the slower times point to: one more round tries 0.68 (4.62 ms when
    timed again), which is chosen."""
    deployer = FakeDeployer({"onnxruntime-fp32": Runtime(10.0, 0.92)})
    deployer.ms = lambda candidate: 10.0 * candidate.built ** 2
    _lucky_once(deployer, factor=0.85)
    result = search(["onnxruntime-fp32"], deployer, prune, budget=4.8, unit="ms", unpruned_model="full")
    tries = {t.aim: t for t in result.chosen.tries}
    assert list(tries) == [1.0, 0.46, 0.64, 0.7, 0.68]
    assert tries[0.64].meets and not tries[0.7].meets and tries[0.7].confirmed_ms == pytest.approx(4.9)
    assert result.model == 0.68 and result.chosen.ms == pytest.approx(10.0 * 0.68 ** 2)


def test_rounds_that_end_with_the_budget_unspent_get_one_more_round_between_the_closest_tries():
    """Time in proportion to the aim, 5 ms asked (4.85 aimed at), but the copy at aim 0.48 is timed at 6.9 ms (a
    copy that landed off its aim). The line through it and the unpruned model sends the next try to 0.12 (1.2 ms),
    the round between them to 0.34 (3.4 ms, the rounds run out), which leaves 32 % of the budget unspent: one more
    round interpolates between 0.34 and 0.48, 0.34 + (4.85 - 3.4) / 25 = 0.398, and 0.38 (3.8 ms) is chosen."""
    deployer = FakeDeployer({"onnxruntime-fp32": Runtime(10.0, 0.92)})
    deployer.ms = lambda candidate: 6.9 if candidate.built == 0.48 else 10.0 * candidate.built
    result = search(["onnxruntime-fp32"], deployer,
                    lambda aim: Pruned(aim, aim, aim, round(aim + 0.01, 4), [{"proposal": "macs", "aim": aim}]),
                    budget=0.5, unit="fraction", unpruned_model="full")
    tries = result.chosen.tries
    assert [t.aim for t in tries] == [1.0, 0.48, 0.12, 0.34, 0.38]
    assert result.model == 0.38 and result.chosen.ms == pytest.approx(3.8)
    assert tries[-1].confirmed_ms == pytest.approx(3.8)  # confirmed like any round's try
    # the pruner's own measure of each copy is kept beside the deployment's time
    assert [t.pruner_fraction for t in tries] == [None, 0.49, 0.13, 0.35, 0.39]
    # and the copies it compared at each aim
    assert [t.pruner_tries for t in tries] == [None] + [[{"proposal": "macs", "aim": a}] for a in (0.48, 0.12, 0.34,
                                                                                                    0.38)]


def test_a_confirmed_try_within_the_slack_of_the_budget_gets_no_more_rounds():
    deployer = FakeDeployer({"onnxruntime-fp32": Runtime(10.0, 0.92)})
    result = search(["onnxruntime-fp32"], deployer, prune, budget=5.0, unit="ms", unpruned_model="full")
    assert [t.aim for t in result.chosen.tries] == [1.0, 0.48]  # 4.8 ms: 4 % under the budget


def test_a_try_that_missed_is_timed_again_and_a_slow_first_reading_does_not_bend_the_search():
    """The copy at aim 0.48 reads 6.9 ms in its round's run (a burst of load), 4.8 ms when timed again: the second
    time replaces the first, meets 5 ms, is confirmed and chosen, with no round aimed from the slow reading."""
    deployer = FakeDeployer({"onnxruntime-fp32": Runtime(10.0, 0.92)})
    seen: set[float] = set()

    def burst_once(candidates):
        baseline, times = FakeDeployer.time(deployer, candidates)
        slowed = [6.9 if c.built == 0.48 and c.built not in seen else ms for c, ms in zip(candidates, times)]
        seen.update(c.built for c in candidates)
        return baseline, slowed

    deployer.time = burst_once
    result = search(["onnxruntime-fp32"], deployer, prune, budget=5.0, unit="ms", unpruned_model="full")
    (unpruned, kept) = result.chosen.tries
    assert kept.aim == 0.48 and kept.slowed_ms == pytest.approx(6.9) and kept.ms == pytest.approx(4.8)
    assert kept.meets and kept.confirmed_ms == pytest.approx(4.8) and result.model == 0.48
    assert unpruned.slowed_ms is None
    # its round's run, the run that timed it again, and the confirming run, each with the unpruned build
    assert deployer.timed[1:] == [[("onnxruntime-fp32", 0.48), ("onnxruntime-fp32", 1.0)]] * 3


def test_a_try_that_misses_again_keeps_its_faster_time():
    """Half the aim's saving shows (7 ms asked): the first try misses at both timings and keeps the faster of them,
    which the next aim is read from. (Each pruned model's first reading is slow; the unpruned build reads alike in
    every run.)"""
    deployer = FakeDeployer({"openvino-fp32": Runtime(10.0, 0.92, pays=0.5)})
    first: dict[float, float] = {}

    def slower_first(candidates):
        baseline, times = FakeDeployer.time(deployer, candidates)
        read = [ms * (1.05 if c.built not in first and c.built != 1.0 else 1.0) for c, ms in zip(candidates, times)]
        for c, ms in zip(candidates, read):
            first.setdefault(c.built, ms)
        return baseline, read

    deployer.time = slower_first
    result = search(["openvino-fp32"], deployer, prune, budget=7.0, unit="ms")
    missed = result.chosen.tries[1]
    assert not missed.meets and missed.slowed_ms == pytest.approx(first[missed.aim])
    assert missed.ms == pytest.approx(10.0 * (1 - 0.5 * (1 - missed.aim)))


def test_an_aim_extrapolated_from_two_close_tries_takes_its_slope_from_the_farthest():
    """OpenVINO bf16 of efficientnet_b0 on a 2-CPU EPYC: unpruned 4.37 ms, aim 0.70 timed 3.295, aim 0.64 timed
    3.27 (its slower time), 3.086 aimed at. The line through 0.64 and the unpruned model gives
    0.64 - (3.27 - 3.086) / ((4.37 - 3.27) / 0.36) = 0.580; the line through the two close tries would have given
    0.64 - 0.184 / (0.025 / 0.06) = 0.20."""
    from optkit.passes.deploy.search import Try, _next_aim

    tries = [Try(1.0, 1.0, 1.0, ms=4.37), Try(0.70, 0.6, 0.6, ms=3.295),
             Try(0.64, 0.587, 0.587, ms=3.172, confirmed_ms=3.27)]
    assert _next_aim(tries, 3.086) == pytest.approx(0.64 - (3.27 - 3.086) / ((4.37 - 3.27) / 0.36), abs=1e-9)


def test_a_try_confirmed_once_is_not_timed_a_third_time_when_another_deployment_gets_one_more_round():
    """ONNX Runtime FP32 meets 5 ms unpruned (4.9 ms) and is confirmed with the first confirming run; OpenVINO bf16's
    only try met by luck and gets one more round, whose try is confirmed in a second run. That run times only the
    new try: a third timing would give the unpruned FP32 point one more chance to miss than the other had."""
    deployer = FakeDeployer({"onnxruntime-fp32": Runtime(4.9, 0.90), "openvino-bf16": Runtime(10.0, 0.92, pays=0.9)})
    _lucky_once(deployer)
    result = search(list(deployer.runtimes), deployer, prune, budget=5.0, unit="ms", unpruned_model="full")
    timings = [aim for run in deployer.timed for name, aim in run if name == "onnxruntime-fp32"]
    assert timings == [1.0, 1.0]  # with the other unpruned candidates, then in the first confirming run
    bf16 = next(p for p in result.points if p.name == "openvino-bf16")
    assert sorted(t.aim for t in bf16.tries) == [0.42, 0.48, 1.0] and bf16.status in ("met", "chosen")
    assert deployer.timed[-1] == [("openvino-bf16", 0.42), ("openvino-bf16", 1.0)]


def test_a_refusal_of_a_budget_under_a_tenth_of_a_millisecond_shows_two_significant_digits():
    """A model of 0.1 ms where pruning pays 58 % of the aim's saving: 0.045 ms asked, 0.05 ms at best. With two
    decimals both would read 0.05."""
    deployer = FakeDeployer({"onnxruntime-fp32": Runtime(0.1, 0.9, pays=0.58)})
    with pytest.raises(OptkitError) as caught:
        search(["onnxruntime-fp32"], deployer, prune, budget=0.045, unit="ms")
    fastest = min(deployer.ms(Candidate("onnxruntime-fp32", "onnxruntime", "fp32", built=aim))
                  for run in deployer.timed for _, aim in run)
    assert 0.046 < fastest < 0.1
    message = str(caught.value)
    assert f"budget of 0.045 ms per call: the fastest reachable is {fastest:.3f} ms" in message, message
    assert f"give --target-latency {fastest * 1.05:.3f}ms or more" in message
