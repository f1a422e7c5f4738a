"""The PCIe capability's part of `top`'s snapshot: each GPU's link (NVML's view and sysfs's, the
lower current state and the higher maximum), AER counts on its path, degraded or not and why, and
the findings when a link downtrains or comes back."""

from __future__ import annotations

from ..telemetry.snapshot import Section, Tick, finding
from .episodes import LINK_BUSY_UTIL_PCT, link_degraded


def _lo(a, b):
    return b if a is None else a if b is None else min(a, b)


def _hi(a, b):
    return b if a is None else a if b is None else max(a, b)


class PcieSection(Section):
    def __init__(self, last_pcie=lambda: None, nvml_links=lambda: {}, busy_util_pct: float = LINK_BUSY_UTIL_PCT):
        """last_pcie() -> the latest sysfs.PcieSnapshot; nvml_links() -> {GPU PCI address: (gen, gen max,
        width, width max, utilisation %)} as NVML last sampled them (gpuhealth's input gpu.links)."""
        self.last_pcie, self.nvml_links, self.busy_util_pct = last_pcie, nvml_links, busy_util_pct
        self._episodes: dict[str, object] = {}  # GPU bdf -> open LinkEpisode
        self._degraded: dict[str, str] = {}  # GPU key -> why, last tick

    def on_link_episode(self, ep) -> None:
        """A LinkEpisode from the downtraining rule: open ones mark their GPU degraded."""
        if ep.event == "closed":
            self._episodes.pop(ep.gpu_bdf, None)
        else:
            self._episodes[ep.gpu_bdf] = ep

    def gpus(self, tick: Tick) -> dict:
        pcie = self.last_pcie()
        links = getattr(pcie, "links", {}) or {}
        paths = getattr(pcie, "paths", {}) or {}
        nvml = dict(self.nvml_links() or {})
        return {bdf: self._gpu(bdf, nvml.get(bdf), links, paths) for bdf in list(nvml) + sorted(b for b in paths if b not in nvml)}

    def _gpu(self, bdf, nv, links, paths) -> dict:
        gen, gen_max, width, width_max, util = nv if nv is not None else (None, None, None, None, None)
        link = links.get(bdf)
        if link is not None and link.present:
            # NVML's view and sysfs's (read this tick) may differ by a poll: the lower current state
            # and the higher maximum, so neither hides a downtrain the other saw
            gen, width = _lo(gen, link.gen), _lo(width, link.width)
            gen_max, width_max = _hi(gen_max, link.max_gen), _hi(width_max, link.max_width)
        aer, have_aer = [0, 0, 0], False
        for dev in (bdf, *paths.get(bdf, ())):
            st = links.get(dev)
            if st is not None and st.aer is not None:
                have_aer = True
                for j, kind in enumerate(("correctable", "nonfatal", "fatal")):
                    aer[j] += st.aer.total(kind)
        why = link_degraded(gen, gen_max, width, width_max, util, self.busy_util_pct)
        ep = self._episodes.get(bdf)
        if ep is not None:
            why = ", ".join(ep.causes) or why or "episode open"
        if link is not None and not link.present:
            why = "device gone from the bus"
        return {"link_gen": gen, "link_gen_max": gen_max, "link_width": width, "link_width_max": width_max,
                "link_degraded": why is not None, "link_why": why,
                "aer_correctable": aer[0] if have_aer else None, "aer_nonfatal": aer[1] if have_aer else None,
                "aer_fatal": aer[2] if have_aer else None}

    def findings(self, tick: Tick) -> list:
        out, degraded = [], {}
        for g in tick.gpus:
            key = g.bus_id or f"gpu{g.index}"
            if g.link_degraded:
                degraded[key] = g.link_why or ""
                if key not in self._degraded:
                    out.append(finding(tick.wall_ns, "link_degraded", key,
                                       f"PCIe link downtrained on GPU {g.index} ({key}): "
                                       f"Gen{g.link_gen or '?'} x{g.link_width or '?'} of Gen{g.link_gen_max or '?'} "
                                       f"x{g.link_width_max or '?'}: {g.link_why}"))
        for key in self._degraded:
            if key not in degraded:
                out.append(finding(tick.wall_ns, "link_restored", key, f"PCIe link back at its maximum: {key}"))
        self._degraded = degraded
        return out
