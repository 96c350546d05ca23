"""The plan's result: one verdict per candidate from what the search found, the ranking, the
cost-vs-latency Pareto front, the answer per hardware (its cheapest feasible candidate, else its
closest), what was searched and what was cut, the nearest miss and the assumptions."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from planner.metrics import RunSummary
from planner.search.slo_capacity import SLOCapacity
from planner.search.capacity import LIGHT_LOAD_FACTOR, PROBE_SEQS_MULTIPLE, Question, Searched
from planner.search.screen import CAPACITY_SLACK, Shape
from planner.quality import NO_QUALITY_LIMIT_PCT, deployment_loss_pct
from planner.quality import describe as describe_quality
from planner.specs import SLO, Deployment


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


Verdict = Literal["recommended", "memory", "slo", "cost", "budget"]
# Whole-deployment simulations a plan may run to find its recommendation (`verified`): the cheapest
# candidate, then, while each misses, one more replica of it or the next cheapest. Each simulates up to
# VERIFY_MAX_REQUESTS requests, as long as a few probes.
MAX_VERIFICATIONS = 4


class CandidatePlan(_Out):
    """One deployment considered, what the search learnt about it, and why it lost (if it did)."""

    label: str = Field(description="Short human id: hardware, parallelism, dtypes, knobs")
    deployment: Deployment = Field(description="The deployment; replicas as needed when known, else 1")
    gpus_per_replica: int
    price_usd_per_gpu_hour: float
    capacity_bound_per_s: float | None = Field(
        None, description="Analytic estimate of the most requests/s one replica can serve (cost model, no queueing)")
    ttft_min_replicas: int | None = Field(None, description=(
        "Fewest replicas that can meet the TTFT target: with fewer, more of a replica's probe requests than the goodput "
        "share allows would wait past the limit even with every prompt prefilled at full speed in arrival order "
        "(planner/search/ttft_bound.py); none where that bound does not apply"))
    cost_bound_usd_per_hour: float | None = Field(None, description=(
        "The least it can cost: its cost when it meets the SLO, else the lower bound it was ruled out on cost by; "
        "none when no replica count serves (memory, SLO)"))
    sustained_rate_per_s: float | None = Field(
        None, description="Highest per-replica Poisson rate probed at which one replica met the SLO")
    failed_rate_per_s: float | None = Field(
        None, description="Lowest per-replica Poisson rate probed at which one replica missed the SLO")
    replicas: int | None = Field(None, description="Replicas for the target rate with headroom")
    gpus: int | None = None
    usd_per_hour: float | None = None
    usd_per_million_output_tokens: float | None = Field(None, description="At the target rate")
    ttft_p50_ms: float | None = Field(None, description="At the per-replica load it was sized for (with headroom)")
    ttft_p99_ms: float | None = None
    tpot_p50_ms: float | None = None
    tpot_p99_ms: float | None = None
    probes: int = Field(0, description="Simulations run for this candidate")
    verdict: Verdict
    reason: str = Field(description="Why it lost, prefixed by the verdict; empty for the recommendation")
    slo_miss_ratio: float | None = Field(
        None, description="Worst observed / limit at the lightest load tried (or unloaded, analytically); > 1 is a miss")
    memory_shortfall_gib: float | None = Field(None, description="Per-GPU memory missing for one longest request")
    quality_loss_pct: float | None = Field(None, description=(
        "What its weight and KV formats cost in quality, % of the 16-bit score (planner/quality.py); None: no figure"))


class SearchSpace(_Out):
    """What the search tried, what it left out before any simulation, and where it is narrower
    than the default question (`serveplan plan` without options)."""

    hardware: list[str]
    max_gpus_per_replica: int
    weight_dtypes: list[str] = Field(description="Weight formats tried on some hardware (fp8 only where native)")
    kv_dtypes: list[str]
    knobs: list[str] = Field(description="Engine settings tried: max_num_batched_tokens x max_num_seqs; "
                                         "'engine defaults' is the engine profile's own choice per device")
    engine: str
    max_quality_loss_pct: float
    excluded_for_quality: list[str] = Field(description="Format pairs left out by the quality budget, with their loss")
    narrower_than_default: list[str] = Field(description="Each dimension narrower than the default space, in words")
    outcomes: dict[str, int] = Field(description=(
        "Candidates by how the search settled them: out for memory, out at the analytic screen (SLO), pruned on "
        "cost before simulation, simulated"))


class Widening(_Out):
    """The smallest widening of a narrowed question that makes it feasible: the default space's
    answer, and what of it lies outside the question's space."""

    changes: list[str] = Field(description="What to widen, in words; empty when the wider space does not help")
    hardware: list[str] = Field(description="Hardware to add")
    max_gpus_per_replica: int | None = Field(description="Max GPUs per replica to raise to")
    weight_dtypes: list[str] = Field(description="Weight formats to add")
    kv_dtypes: list[str] = Field(description="KV formats to add")
    recommended: CandidatePlan | None = Field(description="The answer in the wider space")
    nearest_miss: str | None = Field(description="When the wider space has no answer either")

    @property
    def summary(self) -> str:
        """The one sentence front ends show."""
        if (r := self.recommended) is None:
            return f"the default search space has no answer either: {self.nearest_miss}"
        return (f"widen the search: {'; '.join(self.changes)}; the default search then recommends {r.replicas} x "
                f"{r.label} at US${r.usd_per_hour:,.2f}/h")


class PDComparison(_Out):
    """On one hardware: the best colocated candidate against the best disaggregated one, and why
    the winner won."""

    hardware: str
    colocated: CandidatePlan | None = Field(description="Cheapest colocated candidate that meets the SLO, else the closest")
    disaggregated: CandidatePlan | None = Field(description="The same among disaggregated (xPyD) candidates")
    winner: Literal["colocated", "disaggregated", "neither"]
    reason: str


class PlanResult(_Out):
    """`serveplan plan --json`: the recommendation, the ranking, the Pareto front and every rejection."""

    model: str
    workload: str
    rate_per_s: float = Field(description="Target Poisson arrival rate, requests/s")
    headroom: float = Field(description="Replicas are sized for rate_per_s x (1 + headroom)")
    slo: SLO
    budget_usd_per_hour: float | None
    requests_per_probe: int
    recommended: CandidatePlan | None
    verification: RunSummary | None = Field(
        description="The recommended deployment, all replicas behind round robin, simulated at rate_per_s")
    ranked: list[CandidatePlan] = Field(description="Candidates that meet the SLO, by US$/h (ties: lower P99 TTFT)")
    pareto_metric: str = Field(description="Latency of the cost-vs-latency front")
    pareto: list[CandidatePlan] = Field(description="Feasible candidates no other beats on both cost and latency")
    rejected: list[CandidatePlan] = Field(description="Every other candidate with the reason it lost, closest first")
    per_hardware: list[CandidatePlan] = Field(description=(
        "For each hardware: its cheapest candidate that meets the SLO, else its closest: the lowest cost bound, "
        "else the least SLO miss, else the least memory shortfall"))
    why_not: list[CandidatePlan] = Field(description="per_hardware without the recommendation's hardware")
    nearest_miss: str | None = Field(description="When nothing is recommended: the closest candidate and by how much")
    stepped_up: list[str] = Field([], description=(
        "Each verification that missed the SLO on the way to the recommendation, cheapest first: the deployment, what "
        "missed, and that it went on with one more replica"))
    verification_missed: str | None = Field(None, description=(
        "When the recommendation's verification still misses the SLO after the verifications a plan may run "
        f"({MAX_VERIFICATIONS}): what missed, and what to rerun with"))
    band_misses: str | None = Field(None, description=(
        "When the recommendation's verification meets the SLO as predicted but the band of held-out errors around it "
        "(verification.prediction_interval) reaches past a latency target: which targets, how far, and what to plan "
        "with to size against the band"))
    capacity: SLOCapacity | None = Field(None, description=(
        "The recommendation's capacity: the highest rate one replica serves within the SLO, times its replicas"))
    quality: str | None = Field(None, description="What the recommendation's formats cost in quality, with sources")
    space: SearchSpace | None = None
    widening: Widening | None = Field(None, description="When nothing is recommended in a narrowed space: what to widen")
    pd_comparison: list[PDComparison] = Field(
        [], description="Per hardware with disaggregated candidates: colocated vs disaggregated, and why one wins")
    candidates: int
    simulated_candidates: int
    probes: int
    assumptions: list[str]


def _slo_miss_ratio(summary: RunSummary) -> float:
    g = summary.goodput
    ratios = [k.observed_ms / k.limit_ms for k in g.checks]
    if g.required_share and g.share < g.required_share:
        ratios.append(g.required_share / max(g.share, 1e-9))
    return max(ratios, default=0.0)


def _verdict(s: Searched, best: Searched | None, hw_best: Searched | None, budget: float | None) -> tuple[Verdict, str]:
    """The one place a candidate's verdict is decided, from its screen and capacity search, the
    best feasible candidate (`best`: the cheapest, ties broken by P99 TTFT) and the best of its
    own hardware (`hw_best`), against which (or against `best`) it was pruned."""
    c, sc, out = s.candidate, s.screen, s.outcome
    best_usd = best.cost_bound_usd_per_hour if best is not None else None
    if sc.memory_problem is not None:
        return "memory", f"memory: {sc.memory_problem}"
    if sc.slo_problem is not None:
        return "slo", f"SLO: {sc.slo_problem}"
    if out is None:  # pruned: its bound could not beat its hardware's best, or the best on any
        assert sc.capacity_bound_per_s is not None
        if sc.ttft_min_replicas is not None and sc.ttft_min_replicas == sc.min_replicas > 1:
            basis = (f"with fewer than {sc.min_replicas} replicas the TTFT target is missed even with every prompt "
                     "prefilled at full speed in arrival order")
        else:
            basis = f"even at its analytic capacity (≤ {sc.capacity_bound_per_s * CAPACITY_SLACK:,.2f} req/s per replica)"
        return "cost", f"cost: at least US${s.cost_bound_usd_per_hour:,.2f}/h {basis}, {_beaten_by(s, best, hw_best)}"
    if out.error is not None:
        return "memory", f"memory: {out.error}"
    miss = out.lightest_miss
    if out.replicas is None:
        assert miss is not None  # every search probes at least once
        checks = ", ".join(f"{k.target} {k.observed_ms:,.0f} > {k.limit_ms:g}" for k in miss.summary.goodput.checks
                           if not k.met) or f"goodput {miss.summary.goodput.share:.1%}"
        if out.cost_capped:
            return "cost", (f"cost: misses the SLO at {miss.rate_per_s:,.2f} req/s per replica ({checks}); "
                            f"{miss.replicas + 1}+ replicas = US${s.cost_bound_usd_per_hour:,.2f}/h or more, "
                            f"{_beaten_by(s, best, hw_best)}")
        return "slo", f"SLO: misses it even at {miss.rate_per_s:,.2f} req/s per replica ({checks})"
    assert s.replicas is not None
    cost = c.usd_per_hour(s.replicas)
    if budget is not None and cost > budget:
        return "budget", f"budget: US${cost:,.2f}/h > US${budget:,.2f}/h"
    if s is best:
        return "recommended", ""
    assert best_usd is not None
    return "cost", (f"cost: US${cost:,.2f}/h vs the best US${best_usd:,.2f}/h" if cost > best_usd else
                    f"cost: ties the best US${cost:,.2f}/h with a higher P99 TTFT")


def _beaten_by(s: Searched, best: Searched | None, hw_best: Searched | None) -> str:
    """What a candidate ruled out on cost lost to: its own hardware's best where its bound is not below
    that, else the cheapest feasible candidate on any hardware (plan(..., every_hardware=False))."""
    bound = s.cost_bound_usd_per_hour
    assert bound is not None
    if hw_best is not None and hw_best.cost_bound_usd_per_hour is not None and bound >= hw_best.cost_bound_usd_per_hour:
        return f"not below the best on {s.candidate.hw.name}, US${hw_best.cost_bound_usd_per_hour:,.2f}/h"
    assert best is not None and best.cost_bound_usd_per_hour is not None
    return f"above the cheapest on any hardware, US${best.cost_bound_usd_per_hour:,.2f}/h ({best.candidate.label})"


def _candidate_plan(s: Searched, verdict: Verdict, reason: str, hours_per_million_tokens: float) -> CandidatePlan:
    c, sc, out = s.candidate, s.screen, s.outcome
    fields: dict[str, object] = {"capacity_bound_per_s": sc.capacity_bound_per_s, "ttft_min_replicas": sc.ttft_min_replicas,
                                 "slo_miss_ratio": sc.slo_miss_ratio,
                                 "memory_shortfall_gib": sc.memory_shortfall_gib,
                                 "cost_bound_usd_per_hour": s.cost_bound_usd_per_hour}
    dep = c.dep
    if out is not None:
        fields["probes"] = len(out.probes)
        fields["failed_rate_per_s"] = min((p.rate_per_s for p in out.probes if not p.passed), default=None)
        sized, miss = out.sized, out.lightest_miss
        if sized is not None:
            assert s.replicas is not None
            dep = dep.model_copy(update={"replicas": s.replicas})
            cost, t = c.usd_per_hour(s.replicas), sized.summary
            fields |= {"sustained_rate_per_s": sized.rate_per_s, "replicas": s.replicas, "gpus": dep.total_gpus,
                       "usd_per_hour": cost, "usd_per_million_output_tokens": cost * hours_per_million_tokens,
                       "ttft_p50_ms": t.ttft_ms.p50, "ttft_p99_ms": t.ttft_ms.p99,
                       "tpot_p50_ms": t.tpot_ms.p50, "tpot_p99_ms": t.tpot_ms.p99}
        elif miss is not None and out.error is None:
            fields["slo_miss_ratio"] = _slo_miss_ratio(miss.summary)
    return CandidatePlan(label=c.label, deployment=dep, gpus_per_replica=dep.gpus_per_replica,
                         price_usd_per_gpu_hour=c.price_usd_per_gpu_hour, verdict=verdict, reason=reason,
                         quality_loss_pct=deployment_loss_pct(dep.weight_dtype, dep.kv_dtype),
                         **{k: v for k, v in fields.items() if v is not None})


def _closeness(p: CandidatePlan) -> tuple[int, float, str]:
    """How near a rejected candidate came to winning: a cost bound, else an SLO miss, else memory."""
    if p.cost_bound_usd_per_hour is not None:
        return 0, p.cost_bound_usd_per_hour, p.label
    if p.slo_miss_ratio is not None:
        return 1, p.slo_miss_ratio, p.label
    return 2, p.memory_shortfall_gib if p.memory_shortfall_gib is not None else math.inf, p.label


def assemble(q: Question, shape: Shape, found: list[Searched], space: SearchSpace,
             verify: Callable[[Deployment], RunSummary], capacity: Callable[[CandidatePlan], SLOCapacity]) -> PlanResult:
    """The PlanResult; `verify` simulates a deployment at the target rate (see `verified`), `capacity`
    finds the recommendation's highest rate within the SLO."""
    found, verification, stepped_up = verified(q, found, verify)
    feasible = _feasible(found)
    best = feasible[0] if feasible else None
    hw_best: dict[str, Searched] = {}
    for s in feasible:
        hw_best.setdefault(s.candidate.hw.name, s)
    hours = _hours_per_million_tokens(q, shape)
    plans = {id(s): _candidate_plan(s, *_verdict(s, best, hw_best.get(s.candidate.hw.name), q.budget_usd_per_hour),
                                    hours) for s in found}
    ranked = [plans[id(s)] for s in feasible]
    recommended = ranked[0] if ranked and ranked[0].verdict == "recommended" else None
    rejected = sorted((p for p in plans.values() if p is not recommended), key=_closeness)
    per_hardware = {name: plans[id(s)] for name, s in hw_best.items()}
    for p in rejected:  # hardware with nothing feasible: its closest candidate
        per_hardware.setdefault(p.deployment.hardware, p)
    order = {name: i for i, name in enumerate(space.hardware)}
    answers = sorted(per_hardware.values(), key=lambda p: order.get(p.deployment.hardware, len(order)))

    slo = q.slo
    metric = "ttft_p99_ms" if (slo.ttft_p99_ms or slo.ttft_p50_ms or not (slo.tpot_p99_ms or slo.tpot_p50_ms)) else "tpot_p99_ms"
    pareto: list[CandidatePlan] = []
    for p in ranked:  # by cost: on the front when faster than everything cheaper
        if not pareto or getattr(p, metric) < getattr(pareto[-1], metric):
            pareto.append(p)

    simulated = [s.outcome for s in found if s.outcome is not None]
    outcomes = {"out for memory": sum(p.verdict == "memory" for p in plans.values()),
                "out at the analytic screen (SLO)": sum(s.screen.slo_problem is not None for s in found),
                "pruned on cost before simulation": sum(s.outcome is None and s.screen.capacity_bound_per_s is not None
                                                        for s in found),
                "simulated": len(simulated)}
    rec_dep = recommended.deployment if recommended is not None else None
    return PlanResult(
        model=q.model.name, workload=q.workload.name, rate_per_s=q.rate_per_s, headroom=q.headroom, slo=slo,
        budget_usd_per_hour=q.budget_usd_per_hour, requests_per_probe=q.requests_per_probe, recommended=recommended,
        verification=verification, stepped_up=stepped_up,
        ranked=ranked, pareto_metric=metric, pareto=pareto, rejected=rejected, per_hardware=answers,
        why_not=[p for p in answers if rec_dep is None or p.deployment.hardware != rec_dep.hardware],
        nearest_miss=None if recommended is not None else _nearest_miss(ranked, rejected, q.budget_usd_per_hour),
        verification_missed=_verification_missed(q, verification, len(stepped_up)) if verification is not None else None,
        band_misses=band_misses(verification, sized_at_confidence=q.pessimism is not None)
        if verification is not None else None,
        capacity=capacity(recommended) if recommended is not None else None,
        quality=describe_quality(rec_dep.weight_dtype, rec_dep.kv_dtype) if rec_dep is not None else None,
        space=space.model_copy(update={"outcomes": outcomes}),
        pd_comparison=pd_comparison(list(plans.values()), shape),
        candidates=len(found), simulated_candidates=len(simulated), probes=sum(len(o.probes) for o in simulated),
        assumptions=_assumptions(q, shape, space),
    )


def verified(q: Question, found: list[Searched],
             verify: Callable[[Deployment], RunSummary]) -> tuple[list[Searched], RunSummary | None, list[str]]:
    """`found` with replicas added where a whole deployment missed the SLO, the verification of the
    recommendation (None when nothing is recommended) and what each miss was.

    Each replica was probed alone at its share of the rate; a probe near a replica's capacity can end
    before its queue shows, so the cheapest candidate is simulated whole (every replica behind round
    robin at the target rate). One that misses goes back among the others with one more replica, at
    its new cost, and the cheapest again is verified: the recommendation is the cheapest deployment
    found to meet the SLO whole, within MAX_VERIFICATIONS simulations. Past them, the last one
    verified stands, and the plan says it missed (`verification_missed`)."""
    stepped_up: list[str] = []
    while True:
        feasible = _feasible(found)
        best = feasible[0] if feasible else None
        if best is None or _verdict(best, best, best, q.budget_usd_per_hour)[0] != "recommended":
            return found, None, stepped_up
        assert best.replicas is not None
        summary = verify(best.candidate.dep.model_copy(update={"replicas": best.replicas}))
        if summary.goodput.slo_met is not False or len(stepped_up) + 1 >= MAX_VERIFICATIONS:
            return found, summary, stepped_up
        more = best.replicas + 1
        stepped_up.append(f"{best.replicas} x {best.candidate.label} missed the SLO when verified at "
                          f"{q.rate_per_s:g} req/s ({'; '.join(_missed_targets(summary))}); with {more} replicas "
                          f"(US${best.candidate.usd_per_hour(more):,.2f}/h) it was ranked again")
        found = [replace(s, added_replicas=s.added_replicas + 1) if s is best else s for s in found]


def answer(q: Question, shape: Shape, found: list[Searched]) -> CandidatePlan | None:
    """The recommendation alone, as assemble() makes it from `found` (verified or not), without its
    verification and capacity."""
    feasible = _feasible(found)
    if not feasible:
        return None
    verdict, reason = _verdict(feasible[0], feasible[0], feasible[0], q.budget_usd_per_hour)
    return _candidate_plan(feasible[0], verdict, reason, _hours_per_million_tokens(q, shape)) if verdict == "recommended" else None


def _feasible(found: list[Searched]) -> list[Searched]:
    """The candidates that met the SLO, cheapest first; among equal costs, the lower P99 TTFT."""
    def cost_key(s: Searched) -> tuple[float, float, str]:
        assert s.outcome is not None and s.outcome.sized is not None and s.cost_bound_usd_per_hour is not None
        return s.cost_bound_usd_per_hour, s.outcome.sized.summary.ttft_ms.p99, s.candidate.label

    return sorted((s for s in found if s.outcome is not None and s.outcome.sized is not None), key=cost_key)


def _hours_per_million_tokens(q: Question, shape: Shape) -> float:
    return 1e6 / (q.rate_per_s * shape.requests_per_arrival * shape.mean_output_tokens * 3600)


def _best(plans: list[CandidatePlan]) -> CandidatePlan | None:
    """The cheapest that meets the SLO, else the closest miss."""
    feasible = [p for p in plans if p.usd_per_hour is not None]
    if feasible:
        return min(feasible, key=lambda p: (p.usd_per_hour, p.ttft_p99_ms or 0.0, p.label))
    return min(plans, key=_closeness, default=None)


def pd_comparison(plans: list[CandidatePlan], shape: Shape) -> list[PDComparison]:
    """For each hardware that had disaggregated candidates: which kind wins, and why."""
    out = []
    for hw in dict.fromkeys(p.deployment.hardware for p in plans if p.deployment.disaggregation is not None):
        mine = [p for p in plans if p.deployment.hardware == hw]
        colocated = _best([p for p in mine if p.deployment.disaggregation is None])
        split = _best([p for p in mine if p.deployment.disaggregation is not None])
        winner, reason = _pd_reason(colocated, split, shape)
        out.append(PDComparison(hardware=hw, colocated=colocated, disaggregated=split, winner=winner, reason=reason))
    return out


def _pd_reason(colocated: CandidatePlan | None, split: CandidatePlan | None,
               shape: Shape) -> tuple[Literal["colocated", "disaggregated", "neither"], str]:
    """The winner by cost (a tie goes to colocated: fewer moving parts), and the facts behind it:
    requests/s each GPU serves within the SLO, and TPOT P99 at that load (prefill chunks in
    colocated decode steps are what disaggregation removes)."""
    def served(p: CandidatePlan) -> str:
        assert p.sustained_rate_per_s is not None
        per_gpu = p.sustained_rate_per_s / p.deployment.gpus_per_group
        return (f"{p.replicas} x {p.label}: US${p.usd_per_hour:,.2f}/h, {per_gpu:,.3g} req/s per GPU within the SLO, "
                f"TPOT P99 {p.tpot_p99_ms:,.1f} ms there")

    prompts = f"prompts average {shape.mean_prompt_tokens:,.0f} tokens for {shape.mean_output_tokens:,.0f} output tokens"
    best: dict[Literal["colocated", "disaggregated"], CandidatePlan | None] = {"colocated": colocated,
                                                                              "disaggregated": split}
    meets = {kind: p for kind, p in best.items() if p is not None and p.usd_per_hour is not None}
    if not meets:
        return "neither", "neither meets the SLO; " + "; ".join(
            f"{kind}: {p.reason if p else 'no candidate'}" for kind, p in best.items())
    cost = {kind: p.usd_per_hour for kind, p in meets.items() if p.usd_per_hour is not None}  # all of `meets`
    winner = min(cost, key=lambda kind: (cost[kind], kind != "colocated"))
    loser: Literal["colocated", "disaggregated"] = "disaggregated" if winner == "colocated" else "colocated"
    win, lose = meets[winner], best[loser]
    head = "disaggregation wins" if winner == "disaggregated" else "colocated wins"
    if loser not in meets:
        return winner, f"{head}: {served(win)}; {loser} misses the SLO ({lose.reason if lose else 'no candidate'}); {prompts}"
    assert lose is not None
    if lose.usd_per_hour == win.usd_per_hour:
        return winner, f"a tie on cost, colocated kept (fewer moving parts): {served(win)}; vs {served(lose)}; {prompts}"
    why = ("each prefill chunk a colocated decode step carries stretches every running request's TPOT, so colocated "
           "replicas must run emptier" if winner == "disaggregated" else
           "the prefill chunks cost colocated decodes less than separate pools cost in instances that wait on each "
           "other and in KV transfers")
    return winner, f"{head}: {served(win)}, vs {served(lose)}; {prompts}: {why}"


def _nearest_miss(ranked: list[CandidatePlan], rejected: list[CandidatePlan], budget: float | None) -> str:
    if ranked:  # feasible, but none within the budget
        cheapest = ranked[0]
        return (f"no deployment meets the SLO within US${budget:,.2f}/h; the cheapest that does is "
                f"{cheapest.replicas} x {cheapest.label}: {cheapest.gpus} GPUs, US${cheapest.usd_per_hour:,.2f}/h")
    p = rejected[0] if rejected else None  # nothing feasible: SLO misses by ratio, then memory by shortfall
    if p is not None and p.slo_miss_ratio is not None:
        return (f"no candidate meets the SLO; the closest is {p.label}, {p.slo_miss_ratio:.2f}x the limit: "
                + p.reason.removeprefix("SLO: ").removeprefix("cost: "))
    if p is not None and p.memory_shortfall_gib is not None:
        return (f"the model fits on no candidate; the closest is {p.label}, {p.memory_shortfall_gib:,.1f} GiB per GPU "
                f"short: " + p.reason.removeprefix("memory: "))
    return "no candidate deployment: the hardware list and parallelism limits leave nothing to try"


def _missed_targets(summary: RunSummary) -> list[str]:
    goodput = summary.goodput
    missed = [f"{c.target} {c.observed_ms:,.0f} ms > {c.limit_ms:,.0f}" for c in goodput.checks if not c.met]
    if goodput.required_share is not None and goodput.share < goodput.required_share:
        missed.append(f"goodput {goodput.share:.1%} < {goodput.required_share:.0%}")
    return missed


def _verification_missed(q: Question, verification: RunSummary, stepped_up: int) -> str | None:
    """What to tell a user whose recommendation missed the SLO when verified whole (None when it met it). Its
    every replica passed its probes, but a probe of a replica near its capacity can end before its queue
    shows; the verification runs all the replicas' probes' requests at the whole rate."""
    if verification.goodput.slo_met is not False:
        return None
    after = f", as did the {stepped_up} verified before it (stepped_up)" if stepped_up else ""
    return (f"the verification run, every replica behind round robin at {q.rate_per_s:g} req/s, missed the SLO "
            f"({'; '.join(_missed_targets(verification))}){after}, although each replica's probes of "
            f"{q.requests_per_probe} requests met it (a probe can end before a queue near capacity shows). Plan again "
            "with longer probes (requests_per_probe) or headroom (headroom) before relying on this answer")


def band_misses(verification: RunSummary, *, sized_at_confidence: bool) -> str | None:
    """What to tell a user whose recommendation meets the SLO as predicted but could miss it as measured
    (RunSummary.band_caution), and what to plan with; None when it met the SLO with its whole band, or
    missed outright (verification_missed says so)."""
    caution = verification.band_caution()
    if caution is None:
        return None
    then = ("it was sized at the confidence given; a higher one (confidence) sizes further" if sized_at_confidence else
            "plan at a confidence (confidence), e.g. 0.9, to size against the band's pessimistic end")
    return f"{caution}; {then}"


def _assumptions(q: Question, shape: Shape, space: SearchSpace) -> list[str]:
    margin = f" x {q.pessimism.rate_factor:.2f} (confidence)" if q.pessimism else ""
    quality = ("no quality limit" if space.max_quality_loss_pct >= NO_QUALITY_LIMIT_PCT else
               f"formats whose published quality loss (weights + KV cache) exceeds {space.max_quality_loss_pct:g} % of "
               "the 16-bit score are left out (planner/data/quality.yaml; mean of published evaluations)")
    return [
        f"Poisson arrivals; replicas sized for {q.rate_per_s:g} x (1 + {q.headroom:g}){margin} = {q.sized_rate_per_s:g} "
        "req/s, each replica probed alone at its share of that rate",
        *([q.pessimism.note] if q.pessimism else []),
        f"max({q.requests_per_probe}, {PROBE_SEQS_MULTIPLE} x max_num_seqs"
        + ("" if q.workload.conversation is None else f" x {q.workload.requests_per_arrival:g} mean turns") +
        f") requests per probe drawn from workload {q.workload.name!r} with seed {q.workload.seed}; a probe passes when "
        "the simulated run meets every SLO target and the goodput share"
        + ("" if q.workload.conversation is None else "; the rate counts conversation starts"),
        f"longest request {shape.longest_tokens} tokens: memory planned so that one fits; mean prompt "
        f"{shape.mean_prompt_tokens:.0f}, mean output {shape.mean_output_tokens:.0f} tokens",
        "cost = replicas x GPUs per replica x the profile's price per GPU-hour; per 1M output tokens at the target rate",
        *([f"GPU-family and engine figures from the fit given: {q.fit.source}"] if q.fit is not None else []),
        f"analytic capacity bounds are inflated x{CAPACITY_SLACK:g} before pruning; a candidate that misses the SLO at "
        f"1/{LIGHT_LOAD_FACTOR} of its first probe's load is not probed further",
        "latencies of candidates are at the per-replica load they were sized for (with headroom); the "
        "verification run is the recommended deployment at the target rate behind round robin; a cheapest candidate "
        f"that misses there is ranked again with one more replica, up to {MAX_VERIFICATIONS} verifications",
        quality,
        "each hardware's candidates are pruned against that hardware's best cost only, so every hardware gets its "
        "cheapest feasible candidate",
    ]
