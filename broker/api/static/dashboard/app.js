// The dashboard: polls the broker's JSON API every few seconds and redraws what changed.
// Panels off screen and a hidden tab are not polled; sites arrive a page at a time and are
// drawn as each page lands (a 1,000-site federation paints its first dots after one page).

import { ApiError, api, forgetToken, pages, setToken, takeToken } from "./data.js";
import { SiteMap } from "./map.js";
import { ServicesPanel } from "./services.js";

const REFRESH_MS = 3000;
const SITES_PAGE = 500;
const SITE_ROWS = 100; // utilization rows in the DOM at once; the filter narrows the rest
const JOBS_LIMIT = 200;
const COLORS = ["#58a6ff", "#3fb950", "#d29922", "#bc8cff", "#39c5cf", "#f778ba", "#ff7b72",
  "#a5d6ff", "#7ee787", "#e3b341"];

const $ = (id) => document.getElementById(id);

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v;
    else if (k === "style") e.style.cssText = v;
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

function ago(seconds) {
  if (seconds == null) return "-";
  if (seconds < 90) return `${Math.round(seconds)}s`;
  if (seconds < 5400) return `${Math.round(seconds / 60)}m`;
  if (seconds < 172800) return `${(seconds / 3600).toFixed(1)}h`;
  return `${Math.round(seconds / 86400)}d`;
}

function num(v, digits = 0) {
  return Number(v || 0).toLocaleString("en-US", { maximumFractionDigits: digits });
}

function bar(used, total, label) {
  if (!total) return el("span", { class: "muted" }, "-");
  const share = Math.max(0, Math.min(1, used / total));
  const cls = share >= 0.95 ? "bar full" : share >= 0.8 ? "bar hot" : "bar";
  return el("span", {}, el("span", { class: cls }, el("i", { style: `width:${(share * 100).toFixed(1)}%` })),
    label ?? `${num(used)}/${num(total)}`);
}

function devices(cap) {
  return cap ? Object.values(cap.devices || {}).reduce((a, b) => a + b, 0) : 0;
}

// per site: total and used of each resource (capacity minus free)
function usage(site) {
  const cap = site.capacity;
  const free = site.free;
  if (!cap || !free) return null;
  return {
    gpu: [devices(cap) - devices(free), devices(cap)],
    cpu: [cap.cpu_cores - free.cpu_cores, cap.cpu_cores],
    mem: [cap.mem_gb - free.mem_gb, cap.mem_gb],
    accel: [cap.accel_mem_gb - free.accel_mem_gb, cap.accel_mem_gb],
  };
}

// A panel's status line: why it shows nothing (no permission, not served, an error).
function panelState(panel, err) {
  const line = panel.querySelector(".state");
  if (!line) return;
  if (!err) {
    line.textContent = "";
    line.hidden = true;
    return;
  }
  line.hidden = false;
  if (err.status === 403) line.textContent = `this token may not see it: ${err.message}`;
  else if (err.status === 404) line.textContent = "this broker does not serve it";
  else line.textContent = `${err.code}: ${err.message}`;
}

class Dashboard {
  constructor() {
    this.map = new SiteMap($("map"));
    this.services = new ServicesPanel($("services"), ago);
    this.sites = new Map();
    this.paused = false;
    this.busy = new Set();
    this.visible = new Set(["map-panel", "alerts-panel", "util-panel", "jobs-panel", "traffic-panel", "usage-panel", "tokens-panel", "services-panel"]);
    this.lastTraffic = null;
    this.firstSites = true;
    this.sitesMs = [];
    this.summary = { sites: "-", up: "-", gpus: "-", jobs: "-", alerts: "-" };
    const observer = new IntersectionObserver((entries) => {
      for (const e of entries) {
        if (e.isIntersecting) this.visible.add(e.target.id);
        else this.visible.delete(e.target.id);
      }
    }, { rootMargin: "50% 0px" });
    for (const panel of document.querySelectorAll(".panel")) observer.observe(panel);
    $("site-filter").addEventListener("input", () => this.drawSiteTable());
    $("site-sort").addEventListener("change", () => this.drawSiteTable());
    $("pause").addEventListener("click", () => {
      this.paused = !this.paused;
      $("pause").textContent = this.paused ? "resume" : "pause";
    });
    document.addEventListener("visibilitychange", () => {
      if (!document.hidden) this.tick();
    });
  }

  start() {
    this.tick();
    this.timer = setInterval(() => this.tick(), REFRESH_MS);
  }

  stop() {
    clearInterval(this.timer);
  }

  tick() {
    if (this.paused || document.hidden) return;
    const jobs = [
      ["map-panel", () => this.refreshSites()],
      ["alerts-panel", () => this.refreshAlerts()],
      ["jobs-panel", () => this.refreshJobs()],
      ["traffic-panel", () => this.refreshTraffic()],
      ["services-panel", () => this.services.refresh(api, el, $("services-count"))],
      ["usage-panel", () => this.refreshUsage()],
      ["tokens-panel", () => this.refreshTokens()],
    ];
    for (const [panel, run] of jobs) {
      // the sites feed the header and the utilization table too: polled while either shows
      const shown = panel === "map-panel"
        ? this.visible.has("map-panel") || this.visible.has("util-panel") || this.firstSites
        : this.visible.has(panel);
      if (!shown || this.busy.has(panel)) continue;
      this.busy.add(panel);
      run()
        .then(() => panelState($(panel), null))
        .catch((err) => this.failed(panel, err))
        .finally(() => this.busy.delete(panel));
    }
  }

  failed(panel, err) {
    if (!(err instanceof ApiError)) {
      console.error(err);
      panelState($(panel), new ApiError(0, "error", String(err)));
      return;
    }
    if (err.status === 401) {
      this.stop();
      forgetToken(); // revoked or expired meanwhile
      showLogin(err.message);
      return;
    }
    panelState($(panel), err);
    if (err.status === 0) $("refreshed").textContent = "broker not answering";
  }

  async refreshSites() {
    const started = performance.now();
    const fresh = new Map();
    this.map.begin();
    await pages("/v1/sites", SITES_PAGE, (items) => {
      for (const s of items) fresh.set(s.id, s);
      this.map.draw(items);
      if (this.firstSites) {
        this.firstSites = false;
        performance.mark("cpn:first-sites");
      }
    });
    this.sites = fresh;
    const regions = new Map();
    let up = 0;
    let gpuUsed = 0;
    let gpuTotal = 0;
    for (const s of fresh.values()) {
      const c = s.coordinates || { lat: 0, lon: 0 };
      const r = regions.get(s.region) || { sites: 0, up: 0, lat: 0, lon: 0, gpu: [0, 0], cpu: [0, 0] };
      r.sites += 1;
      r.lat += c.lat;
      r.lon += c.lon;
      if (s.state === "up") {
        r.up += 1;
        up += 1;
      }
      const u = usage(s);
      if (u && s.state === "up") {
        r.gpu[0] += u.gpu[0]; r.gpu[1] += u.gpu[1];
        r.cpu[0] += u.cpu[0]; r.cpu[1] += u.cpu[1];
        gpuUsed += u.gpu[0];
        gpuTotal += u.gpu[1];
      }
      regions.set(s.region, r);
    }
    this.map.end(regions);
    $("sites-count").textContent = `${up} of ${fresh.size} up, ${regions.size} regions`;
    const rows = [...regions.entries()].sort((a, b) => a[0].localeCompare(b[0])).map(([name, r]) =>
      el("tr", { "data-region": name }, el("td", {}, name), el("td", {}, `${r.up}/${r.sites}`),
        el("td", {}, bar(r.gpu[0], r.gpu[1])), el("td", {}, bar(r.cpu[0], r.cpu[1]))));
    $("regions").tBodies[0].replaceChildren(...rows);
    this.summary.sites = `${up}/${fresh.size}`;
    this.summary.gpus = `${num(gpuUsed)}/${num(gpuTotal)}`;
    this.drawSummary();
    this.drawSiteTable();
    document.body.dataset.sitesDrawn = String(fresh.size);
    // what the benchmark reads (bench/dashboard_paint.py): the first full drawing, the frame
    // that puts it on screen, and how long each poll of every site takes
    if (!performance.getEntriesByName("cpn:all-sites").length) {
      performance.mark("cpn:all-sites");
      requestAnimationFrame(() => setTimeout(() => performance.mark("cpn:all-sites-painted")));
    }
    this.sitesMs.push(Math.round(performance.now() - started));
    document.body.dataset.sitesMs = JSON.stringify(this.sitesMs.slice(-10));
    $("refreshed").textContent = "updated " + new Date().toLocaleTimeString();
  }

  drawSiteTable() {
    const needle = $("site-filter").value.trim().toLowerCase();
    const order = $("site-sort").value;
    let list = [...this.sites.values()];
    if (needle) list = list.filter((s) => s.id.includes(needle) || s.region.includes(needle));
    const share = (s, k) => {
      const u = usage(s);
      return u && u[k][1] ? u[k][0] / u[k][1] : -1;
    };
    const rank = { down: 0, cordoned: 1, up: 2 };
    const sorts = {
      id: (a, b) => a.id.localeCompare(b.id),
      gpu: (a, b) => share(b, "gpu") - share(a, "gpu") || a.id.localeCompare(b.id),
      cpu: (a, b) => share(b, "cpu") - share(a, "cpu") || a.id.localeCompare(b.id),
      state: (a, b) => rank[a.state] - rank[b.state] || a.id.localeCompare(b.id),
    };
    list.sort(sorts[order]);
    const shown = list.slice(0, SITE_ROWS);
    $("util-shown").textContent = list.length > SITE_ROWS
      ? `showing ${SITE_ROWS} of ${list.length}: filter to narrow` : `${list.length} sites`;
    const rows = shown.map((s) => {
      const u = usage(s);
      const cell = (k, unit) => el("td", {}, u ? bar(u[k][0], u[k][1], unit ? `${num(u[k][0])}/${num(u[k][1])} ${unit}` : undefined) : "-");
      // a site whose executor refuses every job (its confinement line says so) takes none
      const refusing = s.state === "up" && (s.confinement || "").startsWith("refusing jobs");
      // and one where attempts kept failing to start: the leader's back-off (its cordon says
      // until when and why)
      const backoff = s.cordon && s.cordon.until != null;
      const state = refusing
        ? el("td", { class: "cordoned", title: s.confinement }, "refusing jobs")
        : backoff
          ? el("td", { class: "cordoned", title: s.cordon.reason }, "backing off")
          : el("td", { class: s.state, title: s.cordon ? s.cordon.reason : "" }, s.state);
      return el("tr", { "data-site": s.id, "data-state": s.state },
        el("td", {}, s.id), el("td", {}, s.region), state,
        cell("gpu"), cell("cpu"), cell("mem", "GB"), cell("accel", "GB"),
        el("td", {}, ago(s.last_seen_ago_s)));
    });
    $("sites").tBodies[0].replaceChildren(...rows);
  }

  async refreshJobs() {
    // a placed run pulling its inputs or checkpoint (the first progress its site reported)
    const phase = (j) => {
      if (j.state !== "PLACED" || !j.staging) return j.state;
      const p = j.staging;
      return p.bytes_total ? `STAGING ${Math.round((100 * p.bytes_done) / p.bytes_total)} %` : "STAGING";
    };
    const page = await api(`/v1/jobs?state=PENDING,PLACED,RUNNING&limit=${JOBS_LIMIT}`);
    const now = Date.now() / 1000;
    const counts = { PENDING: 0, PLACED: 0, RUNNING: 0 };
    // pending first (the queue), then placed, then running; oldest first within each
    const order = { PENDING: 0, PLACED: 1, RUNNING: 2 };
    const jobs = [...page.items].sort((a, b) => order[a.state] - order[b.state] || a.created_at - b.created_at);
    const rows = jobs.map((j) => {
      counts[j.state] = (counts[j.state] || 0) + 1;
      const last = j.events.length ? j.events[j.events.length - 1].message : "";
      const why = j.state === "PENDING" ? (j.unschedulable || last || "waiting for the next placement pass") : last;
      return el("tr", { "data-job": j.id, "data-state": j.state },
        el("td", { title: j.spec.name }, j.id),
        el("td", {}, j.spec.tenant), el("td", {}, phase(j)), el("td", {}, j.spec.gpu.count || "-"),
        el("td", {}, j.placement ? j.placement.site : "-"), el("td", {}, ago(now - j.created_at)),
        el("td", { class: "why" }, why));
    });
    $("jobs").tBodies[0].replaceChildren(...rows);
    const more = page.continue ? `, first ${JOBS_LIMIT} shown` : "";
    $("jobs-count").textContent = `${counts.PENDING} pending, ${counts.PLACED} placed, ${counts.RUNNING} running${more}`;
    this.summary.jobs = `${counts.PENDING} pending / ${counts.RUNNING} running`;
    this.drawSummary();
  }

  async refreshAlerts() {
    const page = await api("/v1/alerts?state=firing&limit=200");
    const now = Date.now() / 1000;
    const rank = { critical: 0, warning: 1, info: 2 };
    const alerts = [...page.items].sort((a, b) => (rank[a.severity] ?? 3) - (rank[b.severity] ?? 3) || a.starts_at - b.starts_at);
    const items = alerts.map((a) => el("li", { class: a.severity, "data-alert": a.alertname, "data-fingerprint": a.fingerprint },
      el("div", {}, el("span", { class: "name" }, a.alertname), " ",
        el("span", { class: "muted" }, `${a.severity}, firing for ${ago(now - a.starts_at)}`)),
      el("div", {}, a.summary)));
    if (!items.length) items.push(el("li", { class: "info" }, "nothing firing"));
    $("alerts").replaceChildren(...items);
    $("alerts-count").textContent = alerts.length ? `${alerts.length} firing` : "";
    this.summary.alerts = String(alerts.length);
    this.drawSummary();
  }

  async refreshTraffic() {
    const got = await api("/v1/routes/summary");
    const at = performance.now();
    const prev = this.lastTraffic && this.lastTraffic.instance === got.instance ? this.lastTraffic : null;
    const before = new Map(prev ? prev.items.map((f) => [`${f.client_region}/${f.site}`, f.decisions]) : []);
    const byRegion = new Map();
    const siteColor = new Map();
    for (const f of got.items) {
      if (!siteColor.has(f.site)) siteColor.set(f.site, f.site === "none" ? "#f85149" : COLORS[siteColor.size % COLORS.length]);
      const list = byRegion.get(f.client_region) || [];
      list.push(f);
      byRegion.set(f.client_region, list);
    }
    const blocks = [];
    for (const [region, flows] of [...byRegion.entries()].sort()) {
      const total = flows.reduce((a, f) => a + f.decisions, 0);
      flows.sort((a, b) => b.decisions - a.decisions);
      const seconds = prev ? (at - prev.at) / 1000 : 0;
      const rate = prev && seconds > 0
        ? flows.reduce((a, f) => a + f.decisions - (before.get(`${region}/${f.site}`) || 0), 0) / seconds : null;
      blocks.push(el("div", { class: "flow", "data-client-region": region },
        el("div", {}, el("b", {}, region), el("span", { class: "muted" },
          ` ${num(total)} requests routed` + (rate !== null ? `, ${num(rate, 1)}/s now` : ""))),
        el("div", { class: "stack" }, ...flows.map((f) => el("span", {
          style: `width:${total ? (100 * f.decisions / total).toFixed(2) : 0}%;background:${siteColor.get(f.site)}`,
          title: `${f.site}: ${f.decisions}` }))),
        el("div", { class: "sites" }, ...flows.map((f) => el("span", { "data-site": f.site },
          el("i", { class: "swatch", style: `background:${siteColor.get(f.site)}` }),
          `${f.site} ${total ? Math.round(100 * f.decisions / total) : 0}%` +
          (f.proxied ? `, ${num(1000 * f.proxy_seconds_sum / f.proxied, 1)} ms avg` : ""))))));
    }
    if (!blocks.length) blocks.push(el("p", { class: "muted" }, "no inference requests routed by this broker yet"));
    $("traffic").replaceChildren(...blocks);
    this.lastTraffic = { ...got, at };
  }

  async refreshUsage() {
    const report = await api("/v1/usage?by=tenant");
    // cost: what the tenant is charged, jobs (total_usd) and inference tokens together
    const cost = (i) => i.charge_usd ?? i.total_usd;
    const items = [...report.items].sort((a, b) => cost(b) - cost(a));
    const rows = items.map((i) => el("tr", { "data-tenant": i.tenant },
      el("td", {}, i.tenant), el("td", {}, `$${num(cost(i), 2)}`),
      el("td", {}, num(i.gpu_s / 3600, 1)), el("td", {}, `${num(i.energy_kwh, 1)} kWh`),
      el("td", {}, `${num(i.co2_kg, 1)} kg`)));
    const t = report.total || {};
    if (items.length) {
      rows.push(el("tr", { class: "muted" }, el("td", {}, "total"), el("td", {}, `$${num(cost(t), 2)}`),
        el("td", {}, num((t.gpu_s || 0) / 3600, 1)), el("td", {}, `${num(t.energy_kwh, 1)} kWh`),
        el("td", {}, `${num(t.co2_kg, 1)} kg`)));
    } else {
      rows.push(el("tr", {}, el("td", { colspan: "5", class: "muted" }, "no metered runs in the window")));
    }
    $("usage").tBodies[0].replaceChildren(...rows);
  }

  async refreshTokens() {
    // the inference tokens per tenant and served model, last 30 days (docs/metering.md);
    // by model, a job's accelerator rows come too: only rows with requests are drawn
    const report = await api("/v1/usage?by=tenant,model");
    const items = report.items.filter((i) => i.inference_requests > 0)
      .sort((a, b) => b.inference_usd - a.inference_usd || b.prompt_tokens - a.prompt_tokens);
    const cells = (i) => [el("td", {}, num(i.inference_requests)), el("td", {}, num(i.prompt_tokens)),
      el("td", {}, num(i.completion_tokens)), el("td", {}, num(i.cached_tokens)),
      el("td", {}, `$${num(i.inference_usd, 2)}`)];
    const rows = items.map((i) => el("tr", { "data-tenant": i.tenant, "data-model": i.model },
      el("td", {}, i.tenant), el("td", {}, i.model), ...cells(i)));
    if (items.length) {
      rows.push(el("tr", { class: "muted" }, el("td", {}, "total"), el("td", {}), ...cells(report.total)));
    } else {
      rows.push(el("tr", {}, el("td", { colspan: "7", class: "muted" }, "no inference tokens in the window")));
    }
    $("tokens").tBodies[0].replaceChildren(...rows);
  }

  drawSummary() {
    const s = this.summary;
    const item = (label, value) => el("span", {}, el("b", {}, value), " ", label);
    $("summary").replaceChildren(item("sites up", s.sites), item("GPUs in use", s.gpus),
      item("jobs", s.jobs), item("alerts firing", s.alerts));
  }
}

let dashboard = null;

function showLogin(message) {
  $("panels").hidden = true;
  $("signout").hidden = true;
  $("login").hidden = false;
  const error = $("login-error");
  error.hidden = !message;
  error.textContent = message ? `refused: ${message}` : "";
  $("token").focus();
}

function showPanels(who) {
  $("login").hidden = true;
  $("panels").hidden = false;
  $("signout").hidden = !(who && who.auth);
  $("whoami").textContent = !who ? "" : who.auth
    ? `as ${who.role}${who.tenant ? " of " + who.tenant : ""}` : "auth off";
  if (dashboard === null) dashboard = new Dashboard();
  dashboard.stop();
  dashboard.start();
}

// Who the token is (GET /v1/whoami, public): a refused token brings the form back with the
// broker's reason; a broker with auth off needs none.
async function boot() {
  const token = takeToken();
  try {
    const who = await api("/v1/whoami");
    if (token || who.auth === false) showPanels(who);
    else showLogin("");
  } catch (err) {
    if (err instanceof ApiError && err.status === 401) {
      forgetToken(); // a refused token is not tried again on the next load
      showLogin(token ? err.message : "");
    }
    else if (token) showPanels(null); // the broker is not answering yet: the panels say so
    else showLogin("");
  }
}

$("login").addEventListener("submit", (event) => {
  event.preventDefault();
  setToken($("token").value);
  $("token").value = "";
  boot();
});

$("signout").addEventListener("click", () => {
  forgetToken();
  if (dashboard) dashboard.stop();
  showLogin("");
});

window.addEventListener("hashchange", boot);

boot();
