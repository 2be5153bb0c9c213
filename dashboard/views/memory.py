"""Memory: the agent's footprint, paging and pressure stalls, and the thrash diagnosis."""
from __future__ import annotations

import streamlit as st

from dashboard import auth, components, data, diagnosis, settings, transforms

MIB = 2**20
FULL = "psi.memory.full_avg10"
THRESHOLDS = (
    diagnosis.Threshold(FULL, "memory PSI full (avg10)", 5.0, "%"),
    diagnosis.Threshold("psi.memory.some_avg10", "memory PSI some (avg10)", 20.0, "%"),
    diagnosis.Threshold("mem.agent.majflt_per_s", "agent major faults", 100.0, "/s"),
    diagnosis.Threshold("vm.workingset_refault_file_per_s", "file refaults", 1000.0, "pages/s"),
    diagnosis.Threshold("vm.workingset_refault_anon_per_s", "anon refaults", 100.0, "pages/s"),
)
VERDICT_BOX = {"thrashing": st.error, "under pressure": st.warning, "healthy": st.success, "no data": st.info}

db, url, token = settings.db_path(), settings.agent_url(), settings.agent_token()


@st.fragment(run_every=settings.REFRESH_S)
def live() -> None:
    if not components.store_ready(db):
        return
    since, until = components.window()
    left, right = st.columns(2)
    with left:
        components.series_chart(db, {"mem.agent.rss_bytes": "RSS", "mem.agent.hwm_bytes": "VmHWM",
                                     "mem.agent.rss_file_bytes": "RssFile"}, since, until,
                                "Agent memory", "MiB", 1 / MIB)
        components.series_chart(db, {"vm.workingset_refault_file_per_s": "file",
                                     "vm.workingset_refault_anon_per_s": "anon"}, since, until,
                                "Workingset refaults", "pages/s")
    with right:
        components.series_chart(db, {"mem.agent.majflt_per_s": "agent", "vm.pgmajfault_per_s": "system"},
                                since, until, "Major faults", "faults/s")
        components.series_chart(db, {"psi.memory.some_avg10": "some", FULL: "full"}, since, until,
                                "Memory pressure stall (PSI avg10)", "%")
    diagnose(since, until)


def diagnose(since: float, until: float) -> None:
    st.subheader("Thrash diagnosis")
    samples = {th.signal: transforms.averages(data.series(db, th.signal, since, until, settings.BUCKETS))
               for th in THRESHOLDS}
    knobs = data.agent_knobs(url, token)
    cap = knobs["cache_cap_bytes"]["value"] if isinstance(knobs, dict) else data.latest_value(db, "agent.cache_cap_bytes")
    verdict = diagnosis.diagnose(samples, THRESHOLDS, FULL, mem_total=data.latest_value(db, "mem.total_bytes"),
                                 mem_available=data.latest_value(db, "mem.available_bytes"), cache_cap=cap)
    VERDICT_BOX[verdict.verdict](f"**{verdict.verdict.capitalize()}.** {verdict.summary}")
    for e in verdict.evidence:
        st.markdown(f"- {e.sentence()}, from {transforms.clock(e.first_t)} to {transforms.clock(e.last_t)}")
    st.caption("Judged on the bucket averages of this window: "
               + "; ".join(f"{th.label} above {th.limit:g} {th.unit}" for th in THRESHOLDS)
               + f". {diagnosis.RULE}.")
    rec = verdict.recommendation
    if rec is None:
        return
    st.markdown(f"**Recommendation:** set the cache cap to {rec.reason}.")
    refused = f"agent offline: {knobs}" if not isinstance(knobs, dict) else auth.control_lock()
    if st.button(f"Apply cache cap {rec.cache_cap_bytes / MIB:,.0f} MiB", key="apply-recommendation",
                 disabled=refused is not None, help=refused):
        st.session_state["memory-answer"] = data.push(url, token, {"cache_cap_bytes": rec.cache_cap_bytes})
    if "memory-answer" in st.session_state:
        st.info(f"Agent: {st.session_state['memory-answer']}")


live()
