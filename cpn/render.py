"""Tables and JSON documents for the CLI."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sites.model.capacity import normalize_inventory
from sites.model.catalog import DeviceCatalog
from sites.model.layout import layout
from sites.model.status import NodeUsage, SiteView


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    return "\n".join(lines)


def ago(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    if seconds < 172800:
        return f"{seconds / 3600:.0f}h ago"
    return f"{seconds / 86400:.0f}d ago"


def _num(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def sites_table(views: Sequence[SiteView], *, catalog: DeviceCatalog, now: float) -> str:
    headers = ["SITE", "STATE", "LAST SEEN", "REGION", "GPUS FREE/TOTAL", "NODES IDLE",
               "FP16 TFLOPS", "CPU", "MEM GB", "STORAGE TB", "CONFINEMENT",
               "NEAREST PEERS (RTT ms)"]  # fmt: skip
    rows = []
    for v in views:
        if v.status is not None:
            cap, free = v.status.capacity, v.status.free
            gpus = ", ".join(
                f"{m} {free.devices.get(m, 0)}/{n}" for m, n in sorted(cap.devices.items())
            )
        else:
            cap = normalize_inventory(v.spec.inventory, catalog)
            gpus = ", ".join(f"{m} -/{n}" for m, n in sorted(cap.devices.items()))
        peers = ", ".join(f"{p} {ms:.1f}" for p, ms in list(v.rtt_ms.items())[:3])
        rows.append([
            v.id,
            site_state(v),
            ago(None if v.last_seen is None else now - v.last_seen),
            v.region,
            gpus or "-",
            nodes_idle(v, catalog=catalog),
            _num(cap.fp16_tflops),
            str(cap.cpu_cores),
            _num(cap.mem_gb),
            _num(cap.storage_tb),
            confinement_short(v.status.confinement if v.status is not None else ""),
            peers or "-",
        ])  # fmt: skip
    return table(headers, rows) if rows else "no sites joined"


class NodeRow:
    """One declared node (docs/topology.md): its size from the spec, what it has free from the
    agent's last status (None before the agent published it)."""

    __slots__ = ("cpu", "devices", "free", "island", "mem_gb", "name")

    def __init__(
        self,
        name: str,
        island: str | None,
        devices: dict[str, int],
        cpu: int,
        mem_gb: float,
        free: NodeUsage | None,
    ) -> None:
        self.name = name
        self.island = island
        self.devices = devices  # (pseudo-)model -> devices (or slices) on the node
        self.cpu = cpu
        self.mem_gb = mem_gb
        self.free = free

    @property
    def idle(self) -> bool:
        """Nothing held on it: every device, core and GB free."""
        free = self.free
        return (
            free is not None
            and all(free.free_devices.get(m, 0) >= n for m, n in self.devices.items())
            and free.free_cpu >= self.cpu
            and free.free_mem_gb >= self.mem_gb - 1e-6
        )


def node_rows(v: SiteView, *, catalog: DeviceCatalog) -> list[NodeRow]:
    """The site's declared nodes in declaration order ([] for a site that declares none)."""
    topology = v.spec.topology
    if topology is None:
        return []
    published = {n.node: n for n in v.status.nodes} if v.status is not None else {}
    slots = layout(v.spec, catalog).nodes
    rows = []
    for group in topology.nodes:
        for i, name in enumerate(group.node_names()):
            devices = {m: len(ix) for m, ix in slots.get(name, {}).items() if ix}
            rows.append(NodeRow(name, group.island_of(i), devices, group.cpu_cores,
                                group.mem_gb, published.get(name)))  # fmt: skip
    return rows


def nodes_idle(v: SiteView, *, catalog: DeviceCatalog) -> str:
    """`idle/nodes` for a site with nodes (`-/nodes` before its agent published them)."""
    rows = node_rows(v, catalog=catalog)
    if not rows:
        return "-"
    if all(row.free is None for row in rows):
        return f"-/{len(rows)}"
    return f"{sum(row.idle for row in rows)}/{len(rows)}"


def nodes_table(views: Sequence[SiteView], *, catalog: DeviceCatalog) -> str:
    """Per declared node: its island and what it has free of what it has."""
    headers = ["SITE", "NODE", "ISLAND", "GPUS FREE/TOTAL", "CPU FREE/TOTAL", "MEM GB FREE/TOTAL"]
    rows = []
    for v in views:
        for row in node_rows(v, catalog=catalog):
            free = row.free
            gpus = ", ".join(
                f"{m} {'-' if free is None else free.free_devices.get(m, 0)}/{n}"
                for m, n in sorted(row.devices.items())
            )
            rows.append([
                v.id,
                row.name,
                row.island or "-",
                gpus or "-",
                f"{'-' if free is None else free.free_cpu}/{row.cpu}",
                f"{'-' if free is None else _num(free.free_mem_gb)}/{_num(row.mem_gb)}",
            ])  # fmt: skip
    return table(headers, rows) if rows else "no site declares its nodes"


def site_state(v: SiteView) -> str:
    """The STATE column: the site's state; a site the leader backs off from (attempts kept
    failing to start there: its automatic cordon, broker.leader.start_backoff) says so."""
    if v.cordon is not None and v.cordon.until is not None:
        return "backing off"
    return v.state.value


def confinement_short(line: str) -> str:
    """The table's word for how a site confines runs (the whole line: `cpn sites -o json`)."""
    if not line:
        return "-"
    if line.startswith("refusing"):
        return "REFUSING JOBS"
    parts = [p.strip() for p in line.split(",")]
    network = next((p.removeprefix("network ") for p in parts if p.startswith("network ")), "")
    first = parts[0].removesuffix(" sandbox").replace("NO sandbox", "UNSANDBOXED")
    first = first.split(" (")[0]
    return f"{first}, net {network}" if network else first


def site_json(v: SiteView, *, now: float) -> dict[str, Any]:
    status = v.status
    return {
        "id": v.id,
        "region": v.region,
        "country": v.spec.country,
        "provider": v.spec.provider.value,
        "state": v.state.value,
        "alive": v.alive,
        "last_seen": v.last_seen,
        "last_seen_ago_s": None if v.last_seen is None else round(now - v.last_seen, 3),
        "rtt_ms": v.rtt_ms,
        "links": {dst: ln.model_dump(mode="json") for dst, ln in v.links.items()},
        "capacity": None if status is None else status.capacity.model_dump(mode="json"),
        "free": None if status is None else status.free.model_dump(mode="json"),
        "host": None if status is None else status.host.model_dump(mode="json"),
        "nodes": None
        if status is None or not status.nodes
        else [n.model_dump(mode="json") for n in status.nodes],
        "agent": None if v.agent is None else v.agent.model_dump(mode="json"),
        "cordon": None if v.cordon is None else v.cordon.model_dump(mode="json"),
        "services": [ep.model_dump(mode="json") for ep in v.services],
        "labels": v.spec.labels,
        "confinement": None if status is None else status.confinement or None,
    }


def gpus_wanted(gpu: dict[str, Any], model: str | None) -> str:
    if not gpu["count"]:
        return "cpu"
    what = model or gpu.get("model") or ",".join(gpu.get("models") or [])
    return f"{gpu['count']} x {what or '>=' + str(gpu.get('min_mem_gb')) + 'GB'}"


JOB_HEADERS = ("JOB", "TENANT", "STATE", "SITE", "GPUS", "ATTEMPT", "AGE", "WAITING FOR")


def jobs_table(records: Sequence[dict[str, Any]], *, now: float) -> str:
    rows = job_rows(records, now=now)
    return table(JOB_HEADERS, rows) if rows else "no jobs"


class PagedTable:
    """A table printed a page at a time: column widths come from the first page (a later
    longer cell widens its line only), so a million rows need not be held to align them."""

    def __init__(self, headers: Sequence[str]) -> None:
        self.headers = headers
        self.widths: list[int] | None = None

    def lines(self, rows: Sequence[Sequence[str]]) -> list[str]:
        if not rows:
            return []
        out = []
        if self.widths is None:
            self.widths = [len(h) for h in self.headers]
            for row in rows:
                self.widths = [max(w, len(c)) for w, c in zip(self.widths, row, strict=True)]
            out.append(self._line(self.headers))
        return out + [self._line(row) for row in rows]

    def _line(self, cells: Sequence[str]) -> str:
        assert self.widths is not None
        return "  ".join(c.ljust(w) for c, w in zip(cells, self.widths, strict=True)).rstrip()


def job_rows(records: Sequence[dict[str, Any]], *, now: float) -> list[list[str]]:
    rows = []
    for r in records:
        placement = r.get("placement") or {}
        rows.append([
            r["id"],
            r["spec"]["tenant"],
            phase(r),
            placement.get("site", "-"),
            gpus_wanted(r["spec"]["gpu"], placement.get("model")),
            str(r["attempt"]),
            ago(now - r["created_at"]),
            (r.get("unschedulable") or "")[:70] if r["state"] == "PENDING" else "",
        ])  # fmt: skip
    return rows


def phase(r: dict[str, Any]) -> str:
    """The job's state, or STAGING while its placed run pulls its inputs or checkpoint."""
    return "STAGING" if r["state"] == "PLACED" and r.get("staging") else r["state"]


def size(n: float) -> str:
    """Bytes in words, powers of 1000: '512 B', '30.0 MB', '4.2 GB'."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def staging_line(progress: dict[str, Any]) -> str:
    """'1.2 of 4.0 GB (30 %) from abroad at 85.3 MB/s, about 38 s left'."""
    done, total = progress["bytes_done"], progress["bytes_total"]
    pct = f" ({100 * done / total:.0f} %)" if total else ""
    source = f" from {progress['source']}" if progress.get("source") else ""
    rate = progress.get("rate_bps") or 0.0
    speed = f" at {rate / 1e6:.1f} MB/s" if rate else ""
    eta = progress.get("eta_s")
    left = f", about {eta:.0f} s left" if eta is not None else ""
    what = f"{progress['what']}: " if progress.get("what") else ""
    return f"{what}{size(done)} of {size(total)}{pct}{source}{speed}{left}"


def placement_nodes(placement: dict[str, Any], *, most: int = 8) -> str:
    """A placement's nodes and island in words ("g-2 (8 x H100), g-3 (8 x H100) in island
    g-i1"); "" for a placement without nodes."""
    shares = placement.get("nodes") or []
    if not shares:
        return ""
    model = placement.get("model")
    parts = [
        f"{s['node']} ({s['gpus']} x {model})" if s.get("gpus") and model
        else f"{s['node']} ({s.get('cpu', 0)} cores)"
        for s in shares[:most]
    ]  # fmt: skip
    text = ", ".join(parts)
    if len(shares) > most:
        text += f" and {len(shares) - most} more"
    island = placement.get("island")
    return f"{text} in island {island}" if island else text


def describe_job(r: dict[str, Any]) -> str:
    import time as _time

    spec = r["spec"]
    placement = r.get("placement")
    lines = [
        f"Name:        {r['id']}",
        f"Tenant:      {spec['tenant']}",
        f"Priority:    {spec['priority']}",
        f"State:       {phase(r)} (attempt {r['attempt']}, "
        f"retries {r['retries']}/{spec['max_retries']})",
    ]
    if placement:
        what = (
            f"{placement['gpus']} x {placement['model']}" if placement.get("model") else "CPU only"
        )
        share = placement.get("share")
        if share:  # a share of one device of a sharing pool (docs/gpu-sharing.md)
            what = (
                f"{share['share']:g} of {placement['model']} device {share['device']} "
                f"({share['mode']}, {share['mem_gb']:g} GB)"
            )
        lines.append(
            f"Site:        {placement['site']} ({placement['region']}), {what}, "
            f"est. {placement['cost_usd']:.2f} USD"
        )
        nodes = placement_nodes(placement)
        if nodes:
            lines.append(f"Nodes:       {nodes}")
        lines.append(f"Why:         {placement['reason']}")
    if r.get("unschedulable") and r["state"] == "PENDING":
        lines.append(f"Waiting:     {r['unschedulable']}")
    if r.get("staging") and r["state"] == "PLACED":
        lines.append(f"Staging:     {staging_line(r['staging'])}")
    for i, item in enumerate(spec.get("inputs") or []):
        head = "Inputs:     " if i == 0 else "            "
        lines.append(f"{head} {item['dataset']} at {item['path']} ({size(item['bytes'])})")
    for i, item in enumerate(spec.get("outputs") or []):
        head = "Outputs:    " if i == 0 else "            "
        lines.append(f"{head} {item['path']} -> dataset {item['dataset']}")
    mark = r.get("checkpoint")
    if mark:
        step = f", step {mark['step']}" if mark.get("step") is not None else ""
        when = _time.strftime("%H:%M:%S", _time.localtime(mark["at"]))
        lines.append(
            f"Checkpoint:  {mark['seq']} at {when}{step}, kept at {mark['site']} "
            f"({size(mark['bytes'])})"
        )
    link = r.get("workflow")
    if link:
        lines.append(f"Workflow:    {link['workflow']}, step {link['step']}")
    if r.get("exit_code") is not None:
        lines.append(f"Exit code:   {r['exit_code']}")
    lines.append(f"Command:     {' '.join(spec['command'])}")
    lines.append("Events:")
    rows = [
        [
            _time.strftime("%H:%M:%S", _time.localtime(e["at"])),
            e["type"],
            e.get("site") or "-",
            e["message"],
        ]
        for e in r.get("events", [])
    ]
    lines += ["  " + line for line in table(["TIME", "TYPE", "SITE", "MESSAGE"], rows).splitlines()]
    return "\n".join(lines)


def tokens_table(tokens: Sequence[dict[str, Any]], *, now: float) -> str:
    rows = [
        [
            t["id"],
            t["role"],
            t.get("tenant") or "-",
            ago(now - t["created_at"]),
            "never" if t.get("expires_at") is None else f"in {ago(t['expires_at'] - now)}",
            "never" if t.get("last_used_at") is None else ago(now - t["last_used_at"]),
            t.get("created_by", ""),
            t.get("description", ""),
        ]
        for t in tokens
    ]
    headers = ["ID", "ROLE", "TENANT", "AGE", "EXPIRES", "LAST USED", "CREATED BY", "DESCRIPTION"]
    return table(headers, rows) if rows else "no tokens"


def audit_table(entries: Sequence[dict[str, Any]]) -> str:
    import time as _time

    rows = [
        [
            _time.strftime("%Y-%m-%d %H:%M:%S", _time.gmtime(e["at"])),
            f"{e.get('role') or '-'}:{e['actor']}",
            e.get("tenant") or e.get("actor_tenant") or "-",
            e["action"],
            e.get("target") or "-",
            str(e["status"]),
            e["outcome"],
            e["request_id"],
        ]
        for e in entries
    ]
    headers = ["TIME (UTC)", "WHO", "TENANT", "ACTION", "TARGET", "STATUS", "OUTCOME", "REQUEST"]
    return table(headers, rows) if rows else "no audit entries"


def describe_workflow(w: dict[str, Any]) -> str:
    """A workflow's DAG, parents first: each step's state, site and what it waits for."""
    lines = [
        f"Workflow:    {w['id']} (tenant {w['tenant']})",
        f"State:       {w['state']}",
        f"On failure:  {w['on_failure']}"
        + (f", retried {w['retries']} time(s)" if w.get("retries") else ""),
        "Steps:",
    ]
    rows = []
    for s in w["steps"]:
        after = ", ".join(s["after"]) or "-"
        note = s.get("held") or (s.get("reason") if s["state"] != "SUCCEEDED" else "") or ""
        rows.append([s["name"], s["state"], s.get("site") or "-", after, s["job"], note])
    head = ["STEP", "STATE", "SITE", "AFTER", "JOB", "NOTE"]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=False)]
    for row in (head, *rows):
        cells = [str(c).ljust(width) for c, width in zip(row[:-1], widths, strict=False)]
        lines.append(("  " + "  ".join(cells) + "  " + str(row[-1])).rstrip())
    return "\n".join(lines)
