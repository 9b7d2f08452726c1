"""A routing decision in words: which rule chose the site and which signal decided. Pure.

explain(ranking, choice, overflow=...) -> list[str], for the /v1/route answer's `reasons`
(computed only when asked, never on the proxy's path):

1. how the site was chosen (the only near-best site, p2c, kept, session affinity, the prefix's
   home, a spill from the prefix's home, or an overflow);
2. when a nearer site (lower network_ms) lost: the score part that outweighed its nearness
   (its queue, its KV cache, its penalty, its service time);
3. the chosen site's signals (running, waiting, KV-cache use, their age);
4. every excluded site with its reason.
"""

from __future__ import annotations

from routing.decision.choice import Choice, ChoiceMode
from routing.decision.ranking import Ranking, Scored

__all__ = ["explain", "signals_text"]


def explain(ranking: Ranking, choice: Choice | None, *, overflow: bool = False) -> list[str]:
    out: list[str] = []
    best = ranking.best
    if choice is None or best is None:
        out.append("no site: every candidate is excluded" if ranking.excluded else "no site")
    else:
        out.append(_how(ranking, choice, best, overflow))
        nearest = min(ranking.ranked, key=lambda s: (s.score.network_ms, s.site))
        if (
            nearest.site != choice.site
            and nearest.score.network_ms < choice.scored.score.network_ms
        ):
            out.append(_why_not(nearest, choice.scored))
        out.append(f"{choice.site}: {signals_text(choice.scored, ranking.now)}")
    out.extend(f"{e.site} excluded ({e.reason.value}): {e.detail}" for e in ranking.excluded)
    return out


def _how(ranking: Ranking, choice: Choice, best: Scored, overflow: bool) -> str:
    site, total = choice.site, choice.scored.total_ms
    if overflow:
        return f"{site}: every allowed site is full; the request queues where it waits least"
    if choice.home is not None:
        home = ranking.get(choice.home)
        why = "" if home is None else f" ({_parts(home)})"
        return (
            f"{site}: spilled from the prefix's home {choice.home}, which scores "
            f"{home.total_ms if home else 0:.1f} ms, past prefix_slack_ms of the best "
            f"{best.total_ms:.1f} ms{why}"
        )
    mode = choice.mode
    if mode is ChoiceMode.prefix:
        return (
            f"{site}: the prefix's home (rendezvous hashing over {', '.join(choice.pool)}); "
            f"{total:.1f} ms is within prefix_slack_ms of the best {best.total_ms:.1f} ms"
        )
    if mode is ChoiceMode.affinity:
        return f"{site}: the session key hashes here (among {', '.join(choice.pool)})"
    if mode is ChoiceMode.sticky:
        return f"{site}: kept, {total:.1f} ms is within the hysteresis of the best"
    if mode is ChoiceMode.p2c:
        return (
            f"{site}: power of two choices in the near-best band ({', '.join(choice.pool)}), "
            "the less loaded"
        )
    return f"{site}: the best score, {total:.1f} ms, alone in the near-best band"


def _why_not(nearest: Scored, chosen: Scored) -> str:
    a, b = nearest.score, chosen.score
    nearer = b.network_ms - a.network_ms
    parts = {
        "its queue": a.wait_ms - b.wait_ms,
        "its KV cache": a.kv_ms - b.kv_ms,
        "its penalty (errors, draining)": a.penalty_ms - b.penalty_ms,
        "its service time": (a.service_ms - a.wait_ms) - (b.service_ms - b.wait_ms),
    }
    signal, extra = max(parts.items(), key=lambda kv: kv[1])
    return (
        f"{nearest.site} is {nearer:.1f} ms nearer but lost on {signal}: +{extra:.1f} ms "
        f"({_parts(nearest)})"
    )


def _parts(s: Scored) -> str:
    sc = s.score
    c = s.candidate
    words = [f"{c.in_flight} running, {c.queue} waiting: queue {sc.wait_ms:.1f} ms"]
    if sc.kv_ms > 0:
        usage = c.endpoint.kv_cache_usage
        shown = "stale" if usage is None else f"{usage:.0%}"
        words.append(f"KV cache {shown}: {sc.kv_ms:.1f} ms")
    if sc.penalty_ms > 0:
        words.append(f"penalty {sc.penalty_ms:.1f} ms")
    return ", ".join(words)


def signals_text(s: Scored, now: float) -> str:
    """The signals a candidate was scored on, in words."""
    c, ep = s.candidate, s.candidate.endpoint
    words = [f"{c.in_flight} running, {c.queue} waiting of {ep.max_concurrency} slots"]
    if ep.kv_cache_usage is not None:
        words.append(f"KV cache {ep.kv_cache_usage:.0%}")
    if ep.ttft_ms is not None:
        words.append(f"TTFT {ep.ttft_ms:.0f} ms")
    if ep.signals_at is not None:
        words.append(f"{ep.signals} signals {max(0.0, now - ep.signals_at):.1f} s old")
    else:
        words.append("no model-server signals")
    return ", ".join(words)
