"""SSD: throughput, IOPS, utilisation, latency and queue depth per device; the SMART health panel."""
from __future__ import annotations

import streamlit as st

from dashboard import components, data, settings, transforms
from store.units import human

SMART_FIELDS = {          # series suffix -> (label, unit)
    "temperature_c": ("Temperature", "°C"),
    "percentage_used": ("Endurance used", "%"),
    "data_read_bytes": ("Data read", "B"),
    "data_written_bytes": ("Data written", "B"),
    "media_errors": ("Media errors", "count"),
    "critical_warning": ("Critical warning bits", "bits"),
}

db = settings.db_path()


@components.live
def live() -> None:
    since, until = components.page_range()
    if not components.store_ready(db):
        return
    names = data.series_names(db)
    devices = transforms.devices(names, "block")
    seen = data.events(db, 0.0, "collector.devices")
    if seen:
        st.caption(f"Devices ({transforms.clock(seen[-1]['t'])}): {seen[-1]['message']}")
    if not devices:
        st.info("No block-device series in the store yet: start the collector (`flashmoe-cli collect`).")
    else:
        dev = st.selectbox("Device", devices, key="ssd-device")
        b = f"block.{dev}."
        left, right = st.columns(2)
        with left:
            components.series_chart(db, {b + "read_bytes_per_s": "read", b + "write_bytes_per_s": "write"},
                                    since, until, f"{dev} throughput", "B/s")
            components.series_chart(db, {b + "util": "%util"}, since, until, f"{dev} utilisation", "fraction")
            components.series_chart(db, {b + "queue_depth": "queue depth"}, since, until,
                                    f"{dev} queue depth", "requests")
        with right:
            components.series_chart(db, {b + "reads_per_s": "read", b + "writes_per_s": "write"},
                                    since, until, f"{dev} IOPS", "IO/s")
            components.series_chart(db, {b + "r_await_s": "read", b + "w_await_s": "write"}, since, until,
                                    f"{dev} await", "s")
    smart(db, names)


def smart(db: str, names: list[str]) -> None:
    st.subheader("NVMe health (SMART)")
    controllers = transforms.devices(names, "nvme")
    for ctrl in controllers:
        st.markdown(f"**{ctrl}**")
        for col, (field, (label, unit)) in zip(st.columns(len(SMART_FIELDS)), SMART_FIELDS.items()):
            point = data.latest(db, f"nvme.{ctrl}.{field}")
            col.metric(label, human(point[1] if point else None, unit))
    down = transforms.unavailable_sources(data.events(db, 0.0, None))
    if down:
        st.warning("The collector cannot read:\n\n" + "\n".join(f"- **{s}**: {r}" for s, r in down.items()),
                   icon=":material/report:")
    elif not controllers:
        st.info("No SMART data in the store, and the collector has not said why: is it running?")


live()
