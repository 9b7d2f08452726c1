// The managed services panel: per service, its replicas per client region (desired, actual,
// ready, and the sites they run on), the demand each client region sends it, the autoscaler's
// recent decisions with their reasons, and a small time series of ready replicas against the
// demand, kept in this tab from one poll to the next.
//
// Data: GET /v1/services (the names), GET /v1/services/{name} (regions, replicas, decision,
// events) and GET /v1/routes/summary's `services`: every broker replica's gateway's cumulative
// requests per (service, client region); a rate is the difference of two polls over the time
// between them, as Prometheus' rate() does (a count that went back, a replica restarted, gives
// no rate for that poll).

const MAX_SERVICES = 12; // blocks drawn; the count says how many more there are
const HISTORY = 120; // points of the time series (6 minutes at the 3 s refresh)
const EVENTS = 6; // decisions and scalings listed per service
const SVG = "http://www.w3.org/2000/svg";

function svg(tag, attrs = {}) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  return e;
}

function rate(v) {
  if (v == null) return "-";
  return v >= 10 ? v.toFixed(0) : v.toFixed(1);
}

// A line chart 300 x 60 of ready and desired replicas (left scale) and the demand in req/s
// (right scale, filled), over the points kept.
function chart(points) {
  const w = 300;
  const h = 60;
  const root = svg("svg", { viewBox: `0 0 ${w} ${h + 12}`, class: "series", role: "img",
    "aria-label": "ready replicas and demand over time" });
  if (points.length < 2) return root;
  const t0 = points[0].t;
  const span = Math.max(1, points[points.length - 1].t - t0);
  const x = (t) => ((t - t0) / span) * w;
  const top = Math.max(1, ...points.map((p) => Math.max(p.ready, p.desired)));
  const peak = Math.max(0.1, ...points.map((p) => p.demand ?? 0));
  const yr = (v) => h - (v / top) * (h - 4);
  const yd = (v) => h - (v / peak) * (h - 4);
  const demand = points.filter((p) => p.demand != null);
  if (demand.length > 1) {
    const d = demand.map((p, i) => `${i ? "L" : "M"}${x(p.t).toFixed(1)},${yd(p.demand).toFixed(1)}`).join("");
    root.append(svg("path", { d: `${d}L${x(demand[demand.length - 1].t).toFixed(1)},${h}L${x(demand[0].t).toFixed(1)},${h}Z`, class: "demand" }));
  }
  const line = (key) => points.map((p, i) => `${i ? "L" : "M"}${x(p.t).toFixed(1)},${yr(p[key]).toFixed(1)}`).join("");
  root.append(svg("path", { d: line("desired"), class: "desired" }));
  root.append(svg("path", { d: line("ready"), class: "ready" }));
  const label = svg("text", { x: 2, y: h + 10, class: "axis" });
  label.textContent = `replicas 0-${top}   demand 0-${rate(peak)} req/s   ${Math.round(span)} s`;
  root.append(label);
  return root;
}

export class ServicesPanel {
  constructor(el, ago) {
    this.el = el;
    this.ago = ago;
    this.history = new Map(); // service -> [{t, ready, desired, demand}]
    this.lastDemand = null; // {at, counts: Map("svc/region" -> requests)}
  }

  // Per "service/region", req/s since the previous poll (none where there is no rate yet).
  rates(summary) {
    if (!summary || summary.services_at == null) return new Map();
    const prev = this.lastDemand;
    if (prev && summary.services_at <= prev.at) return prev.rates; // no newer summary yet
    const counts = new Map(summary.services.map((d) => [`${d.service}/${d.client_region}`, d.requests]));
    const out = new Map();
    if (prev) {
      const seconds = summary.services_at - prev.at;
      for (const [key, n] of counts) {
        const before = prev.counts.get(key) ?? 0;
        if (n >= before) out.set(key, (n - before) / seconds);
      }
    }
    this.lastDemand = { at: summary.services_at, counts, rates: out };
    return out;
  }

  async refresh(api, el, count) {
    const page = await api(`/v1/services?limit=${MAX_SERVICES}`);
    let summary = null;
    try {
      summary = await api("/v1/routes/summary");
    } catch (err) {
      if (err.status !== 403) throw err; // a token without metrics: no demand column
    }
    const views = await Promise.all(page.items.map((s) => api(`/v1/services/${encodeURIComponent(s.name)}`)));
    const rates = this.rates(summary);
    const now = Date.now() / 1000;
    const blocks = views.map((v) => this.block(v, rates, now, el));
    if (!blocks.length) blocks.push(el("p", { class: "muted" }, "no managed services: cpn service apply FILE"));
    this.el.replaceChildren(...blocks);
    const more = page.continue ? `, first ${MAX_SERVICES} shown` : "";
    count.textContent = views.length ? `${views.length}${more}` : "";
  }

  block(v, rates, now, el) {
    const ready = v.regions.reduce((a, r) => a + r.ready, 0);
    const desired = v.regions.reduce((a, r) => a + r.desired, 0);
    const demandOf = (region) => rates.get(`${v.name}/${region}`);
    const clientRegions = new Set([...v.spec.clients, ...v.regions.map((r) => r.region).filter((r) => r !== "*")]);
    for (const key of rates.keys()) if (key.startsWith(v.name + "/")) clientRegions.add(key.slice(v.name.length + 1));
    let total = null;
    for (const region of clientRegions) {
      const r = demandOf(region);
      if (r != null) total = (total ?? 0) + r;
    }
    const series = this.history.get(v.name) || [];
    series.push({ t: now, ready, desired, demand: total });
    if (series.length > HISTORY) series.splice(0, series.length - HISTORY);
    this.history.set(v.name, series);

    const sites = new Map(); // region -> sites of its live replicas
    for (const r of v.replicas) {
      if (r.state === "draining" || !r.site) continue;
      const list = sites.get(r.region) || [];
      list.push(r.state === "ready" ? r.site : `${r.site} (${r.state})`);
      sites.set(r.region, list);
    }
    const counts = new Map(v.regions.map((r) => [r.region, r]));
    const regionNames = [...new Set([...v.regions.map((r) => r.region), ...clientRegions])].sort();
    const rows = regionNames.map((region) => {
      const c = counts.get(region) || { desired: 0, actual: 0, ready: 0 };
      return el("tr", { "data-region": region, "data-ready": String(c.ready), "data-desired": String(c.desired) },
        el("td", {}, region === "*" ? "any" : region), el("td", {}, `${c.ready}/${c.desired}`),
        el("td", {}, String(c.actual)), el("td", { class: "demand" }, region === "*" ? "" : rate(demandOf(region))),
        el("td", { class: "why" }, (sites.get(region) || []).join(", ") || "-"));
    });
    const events = v.events.slice(0, EVENTS); // newest first
    const decision = v.decision;
    return el("div", { class: "service", "data-service": v.name, "data-ready": String(ready), "data-desired": String(desired) },
      el("div", { class: "head" }, el("b", {}, v.name), el("span", { class: "muted" },
        ` ${v.model}, tenant ${v.tenant}, ${ready}/${desired} ready (min ${v.spec.min_replicas}, max ${v.spec.max_replicas})` +
        (total != null ? `, ${rate(total)} req/s` : "") + (v.deleting ? ", DELETING" : ""))),
      chart(series),
      el("table", { class: "grid" }, el("thead", {}, el("tr", {}, el("th", {}, "client region"),
        el("th", {}, "ready/desired"), el("th", {}, "actual"), el("th", {}, "req/s"), el("th", {}, "sites"))),
        el("tbody", {}, ...rows)),
      decision ? el("p", { class: "decision" }, el("span", { class: "muted" },
        `last decision (${decision.by}, ${this.ago(now - decision.at)} ago): `),
        Object.entries(decision.replicas).map(([r, n]) => `${r} ${n}`).join(", ") || "none", " ",
        el("span", { class: "why" }, decision.reason)) : el("p", { class: "muted decision" }, "no scaling decision yet"),
      el("ul", { class: "events" }, ...events.map((e) => el("li", { "data-type": e.type },
        el("span", { class: "muted" }, `${this.ago(now - e.at)} ago `), el("b", {}, e.type), " ", e.message))));
  }
}
