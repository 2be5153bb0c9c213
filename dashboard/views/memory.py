"""Memory: the thrash verdict (store.diagnosis, the same as `flashmoe-cli diagnose`) with its evidence
and one-click fix, the disk verdict beside it (who slows the agent's expert reads), then the agent's
footprint, faults, refaults, pressure stalls and cache re-reads with the verdict's thresholds drawn on them."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard import auth, components, data, figures, settings, timerange, transforms
from store import diagnosis as thrash
from store.disk_diagnosis import DiskDiagnosis
from store.units import human

VERDICT_BOX = {"agent thrashing": st.error, "pressure from another process": st.warning,
               "cache thrashing": st.warning, "healthy": st.success, "no data": st.info,
               "disk contention from another process": st.warning,
               "the agent's own reads saturate the disk": st.warning}
ANSWER = "memory-answer"      # session state: the agent's answer to the last applied recommendation
CHARTS = {                    # title -> (unit, {store series: legend label})
    "Major faults": ("faults/s", {"mem.agent.majflt_per_s": "agent", "cgroup.agent.pgmajfault_per_s": "agent cgroup",
                                  "vm.pgmajfault_per_s": "system"}),
    "Workingset refaults": ("pages/s", {"cgroup.agent.workingset_refault_file_per_s": "agent cgroup, file",
                                        "cgroup.agent.workingset_refault_anon_per_s": "agent cgroup, anon",
                                        "vm.workingset_refault_file_per_s": "system, file",
                                        "vm.workingset_refault_anon_per_s": "system, anon"}),
    "Memory pressure stall (PSI avg10)": ("%", {"psi.memory.some_avg10": "system, some",
                                                "psi.memory.full_avg10": "system, full",
                                                "cgroup.agent.psi_some_avg10": "agent cgroup, some",
                                                "cgroup.agent.psi_full_avg10": "agent cgroup, full"}),
    "Expert lookups re-reading a block the cache evicted": ("fraction", {"agent.reread_rate": "share of lookups"}),
}
FOOTPRINT = {"mem.agent.hwm_bytes": "peak RSS", "mem.agent.rss_bytes": "RSS",
             "mem.agent.rss_file_bytes": "file-backed RSS",
             "agent.cache_cap_bytes": "cache cap", "cgroup.agent.usage_bytes": "agent cgroup usage",
             "cgroup.agent.limit_bytes": "agent cgroup limit"}
DASHED = {"peak RSS": "dash",        # drawn first and dashed, so RSS (solid, on top) is never hidden behind it
           "agent cgroup limit": "dash", "cache cap": "dot"}

db, url, token = settings.db_path(), settings.agent_url(), settings.agent_token()


@components.live
def live() -> None:
    since, until = components.page_range()
    if not components.store_ready(db):
        return
    knobs = data.agent_knobs(url, token)
    d = data.diagnosis(db, since, until, knobs if isinstance(knobs, dict) else None, settings.BUCKETS)
    verdict(d)
    components.lost_notice(db, since, until)  # a thrash can make the collector miss the samples that judge it
    recommendation(d, knobs)
    disk_verdict(d.disk)
    charts(d, since, until)


def verdict(d: thrash.Diagnosis) -> None:
    VERDICT_BOX[d.verdict](f"**{d.verdict.capitalize()}**: {d.summary}")
    if d.signals:
        st.dataframe(pd.DataFrame(evidence_rows(d)), hide_index=True, width="stretch")
    st.caption(f"A signal counts when its average stays over its threshold for {thrash.SUSTAIN_S:.0f} s of the "
               f"range shown ({transforms.clock(d.since)} – {transforms.clock(d.until)}). The agent's own signals "
               f"decide first, then the machine's, then the cache's."
               + (" Not sampled here: " + ", ".join(th.label for th in d.unsampled) + "." if d.unsampled else ""))


def disk_verdict(disk: DiskDiagnosis) -> None:
    """The agent's disk: whose reads slow its expert reads, the numbers, and what to do."""
    where = f" ({disk.device})" if disk.device else ""
    VERDICT_BOX[disk.verdict](f"**Disk{where}: {disk.verdict}**: {disk.summary}")
    if disk.evidence():
        st.markdown("\n".join(f"- {line}" for line in disk.evidence()))
    if disk.recommendation:
        st.markdown(f"**What to do:** {disk.recommendation}")


def evidence_rows(d: thrash.Diagnosis) -> list[dict[str, str]]:
    """One row per judged signal, the ones that decided the verdict first."""
    ordered = sorted(d.signals, key=lambda s: not s.sustained)
    return [{"counts": "yes" if s.sustained else "", "signal": s.threshold.label, "whose": s.threshold.side,
             "peak": human(s.peak, s.threshold.unit), "mean": human(s.mean, s.threshold.unit),
             "over for": f"{s.seconds_over:,.0f} s", "threshold": human(s.threshold.limit, s.threshold.unit)}
            for s in ordered]


def recommendation(d: thrash.Diagnosis, knobs: dict | data.Unanswered) -> None:
    """The fix, one click away, unless the last change applied here still awaits its evidence: the
    verdict covers the minutes before that change, so it would only ask for the same step again."""
    rec = d.recommendation
    if rec is not None:
        st.markdown(f"**Recommendation:** {rec.text}")
    last = st.session_state.get(ANSWER)
    effects = since_change(last)
    if rec is not None and rec.changes:
        if effects and any(e.after is None for e in effects):
            st.caption(f"The change at {transforms.clock(last[2])} is taking hold: the next recommendation "
                       f"waits for {thrash.SETTLE_S:.0f} s of samples after it.")
        else:
            # a busy agent (thrash slows its answers) is sent the change all the same: it waits up to 75 s
            refused = auth.control_lock() if isinstance(knobs, dict) or knobs.busy else f"agent offline: {knobs}"
            label = "Apply: " + ", ".join(f"{k} = {transforms.value_text(k, v)}" for k, v in rec.changes.items())
            if st.button(label, key="apply-recommendation", type="primary", disabled=refused is not None,
                         help=refused):
                accepted, text = data.apply_knobs(url, token, rec.changes)
                evidence = [s.threshold.series for s in d.evidence]
                last = st.session_state[ANSWER] = (accepted, text, timerange.now(), evidence)
                effects = since_change(last)
    if last is not None:
        answer(last, effects)


def since_change(last: tuple | None) -> list[thrash.Effect] | None:
    """Each piece of evidence before and after the last change applied here, if the agent took it."""
    if last is None or not last[0] or not last[3]:
        return None
    return thrash.effect(db, last[2], timerange.now(), last[3])


def answer(last: tuple, effects: list[thrash.Effect] | None) -> None:
    """The agent's answer, red on refusal; once accepted, whether the evidence has improved since."""
    accepted, text, at, _ = last
    (st.success if accepted else st.error)(f"Agent ({transforms.clock(at)}): {text}")
    if effects:
        st.markdown("**Since the change:**\n" + "\n".join(f"- {e.sentence()}" for e in effects))


def charts(d: thrash.Diagnosis, since: float, until: float) -> None:
    loaded = {s.threshold.series: s.buckets for s in d.signals}
    lines = {th.series: figures.Threshold(th.limit, th.label) for th in thrash.THRESHOLDS}
    left, right = st.columns(2)
    with left:
        components.series_chart(db, FOOTPRINT, since, until, "Agent memory", "B", dashes=DASHED)
    for i, (title, (unit, names)) in enumerate(CHARTS.items(), start=1):
        with (left if i % 2 == 0 else right):
            components.series_chart(db, names, since, until, title, unit, loaded=loaded,
                                    thresholds=[lines[n] for n in names if n in lines and n in loaded])


live()
